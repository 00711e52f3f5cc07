/* b_groups.c: blocks of 32 with more rows of x than the row kernels' MAXB, 256-bit builds
 * (the AVX-512 builds take the token lanes): W's rows across the lanes, 8 rows of W met
 * by 6 rows of x a pass; one conversion, scale and sum per 8 rows of W where the row
 * kernels pay one per row (SmolLM2 prefill 1.18-1.39x the dequantized tiles and BLAS). */
/* from how many rows of x a blocks-of-32 product takes the groups (PnOptions.bgroups;
 * 0: never, for comparisons): past the row kernels' MAXB */
#define BG_MIN_ROWS (MAXB + 1)

/* the kinds of runs with an fp16 scale (and maybe a min) each: q4, iq4nl, q8 */
static inline int i8_kind(int code) {
    return code == Q4 || code == Q8 || code == Q8M || code == IQ4NL;
}
static inline int blocks32(const PnMat *m) { return i8_kind(m->code) && m->bs == 32; }

/* -- blocks of 32, many rows of x, 256-bit builds: weight rows across the lanes --------
 * A prefill chunk (more rows than the row kernels' MAXB) multiplied by a q4 / q8 / iq4nl
 * matrix with blocks of 32. Each thread widens a group of 8 rows of W to int16 once per
 * call, interleaved so that one vector holds one pair of K positions of all 8 rows
 * (lanes 2i, 2i + 1: row i), into its own buffer (8 x K x 2 bytes: L1 or L2); 6 rows of
 * x then pass the group at a time: a pair of x's int16 values is broadcast and meets the
 * 8 rows in one `vpmaddwd`, so a block's 16 products of a row of x leave its 8 rows'
 * sums in one int32 vector, scaled by the 8 rows' block scales times x's in one
 * multiply-add (and the mins by x's exact block sums in another). The row kernels pay a
 * conversion, a scale and a horizontal sum per block, row of W and row of x; here one per
 * 8 rows of W. x stays int16 per block of 32 in the full range (bg_quantize, as the
 * AVX-512 token lanes). W keeps the file's layout: nothing is repacked at load. */
#if defined(__AVX2__) && !defined(PN_ZMM)
#define BG_X 6              /* rows of x a pass (4: 0.84x, 5: 0.95x, 8: 0.80x of 6, alternated) */

static __thread int16_t *bg_w;      /* a thread's group of 8 rows, widened and interleaved */
static __thread float *bg_s;        /* their block scales then mins, [K/32][8] each */
static __thread int64_t bg_cap;

/* 8 vectors of 8 int32 → their transpose (r[i] lane j ← r[j] lane i) */
static inline void transpose8(__m256i r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_castsi256_ps(_mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]));
        t[2 * i + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]));
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) {
            u[4 * i + h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0x44);
            u[4 * i + 2 + h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0xEE);
        }
    /* u[0]: lanes 0,1 of rows 0-3 at (0,4),(1,5)...: u[0] = rows 0..3 col 0 | col 4 */
    const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    __m256 v[8];
    for (int i = 0; i < 8; i++) v[i] = u[order[i]];
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_castps_si256(_mm256_permute2f128_ps(v[i], v[i + 4], 0x20));
        r[i + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
    }
}

/* rows n0 .. n0+7 of W (rows past N: zeros) → bg_w [K/32][16 pairs][8 rows x 2] and their
 * scales and mins as floats → bg_s [K/32][8], bg_s + K/4 [K/32][8] */
static void bg_widen(const PnMat *m, int64_t n0) {
    const int64_t nx = m->K / 32, row_bytes = m->code == Q4 || m->code == IQ4NL ? m->K / 2 : m->K;
    const int with_min = m->code == Q4 || m->code == Q8M;
    float *sw = bg_s, *mw = bg_s + nx * 8;
    for (int64_t blk = 0; blk < nx; blk++) {
        __m256i lo[8], hi[8];                   /* row i's pairs 0..7, 8..15 as int32 */
        for (int i = 0; i < 8; i++) {
            const int64_t n = n0 + i;
            if (n < m->N) {
                load_block(m->code, m->qs + n * row_bytes, blk, &lo[i], &hi[i]);
                sw[blk * 8 + i] = half_to_float(m->sc[n * nx + blk]);
                mw[blk * 8 + i] = with_min ? half_to_float(m->mn[n * nx + blk]) : 0.0f;
            } else {
                lo[i] = hi[i] = _mm256_setzero_si256();
                sw[blk * 8 + i] = mw[blk * 8 + i] = 0.0f;
            }
        }
        transpose8(lo);
        transpose8(hi);
        __m256i *dst = (__m256i *)(bg_w + blk * 256);
        for (int j = 0; j < 8; j++) {
            _mm256_store_si256(dst + j, lo[j]);
            _mm256_store_si256(dst + 8 + j, hi[j]);
        }
    }
}

static inline __m256i pair_of(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* BG_X rows of x (xr[r]: its int16 values; rows past the last repeat it) against the
 * widened group: out rows get the group's 8 sums each */
static inline __attribute__((always_inline)) void bg_tile(
        int64_t nx, int with_min, const int16_t *const xr[BG_X], const float *const dr[BG_X],
        const float *const sr[BG_X], __m256 res[BG_X]) {
    const float *sw = bg_s, *mw = bg_s + nx * 8;
    __m256 f[BG_X];
    for (int r = 0; r < BG_X; r++) f[r] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nx; blk++) {
        const __m256i *w = (const __m256i *)(bg_w + blk * 256);
        __m256i acc[BG_X];
        for (int r = 0; r < BG_X; r++) acc[r] = _mm256_setzero_si256();
        for (int j = 0; j < 16; j++) {
            const __m256i wj = _mm256_load_si256(w + j);
            for (int r = 0; r < BG_X; r++)
                acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(wj, pair_of(xr[r] + blk * 32 + 2 * j)));
        }
        const __m256 s = _mm256_loadu_ps(sw + blk * 8);
        for (int r = 0; r < BG_X; r++)
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]),
                                   _mm256_mul_ps(s, _mm256_broadcast_ss(dr[r] + blk)), f[r]);
        if (with_min) {
            const __m256 mn = _mm256_loadu_ps(mw + blk * 8);
            for (int r = 0; r < BG_X; r++)
                f[r] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(sr[r] + blk), f[r]);
        }
    }
    for (int r = 0; r < BG_X; r++) res[r] = f[r];
}

typedef struct {
    const PnMat *m; const int16_t *xq; const float *xd, *xs; int64_t B; float *out;
} BgArgs;

static void bg_chunk(const void *p, int64_t g) {        /* group g: rows 8g .. 8g+7 */
    const BgArgs *a = p;
    const PnMat *m = a->m;
    const int64_t K = m->K, nx = K / 32, N = m->N, n0 = 8 * g;
    if (K * 8 > bg_cap) {
        int16_t *nw = aligned_alloc(64, sizeof(int16_t) * (size_t)K * 8);
        float *ns = aligned_alloc(64, sizeof(float) * (size_t)(nx * 16 + 16));
        if (!nw || !ns) { free(nw); free(ns); abort(); }
        free(bg_w), free(bg_s);
        bg_w = nw, bg_s = ns, bg_cap = K * 8;
    }
    bg_widen(m, n0);
    const int with_min = m->code == Q4 || m->code == Q8M;
    const int whole = n0 + 8 <= N;
    for (int64_t b0 = 0; b0 < a->B; b0 += BG_X) {
        const int16_t *xr[BG_X];
        const float *dr[BG_X], *sr[BG_X];
        for (int r = 0; r < BG_X; r++) {
            const int64_t b = b0 + r < a->B ? b0 + r : a->B - 1;
            xr[r] = a->xq + b * K, dr[r] = a->xd + b * nx, sr[r] = a->xs + b * nx;
        }
        __m256 res[BG_X];
        if (with_min) bg_tile(nx, 1, xr, dr, sr, res);
        else bg_tile(nx, 0, xr, dr, sr, res);
        for (int r = 0; r < BG_X && b0 + r < a->B; r++) {
            float *o = a->out + (b0 + r) * N + n0;
            if (whole) _mm256_storeu_ps(o, res[r]);
            else {
                float t[8];
                _mm256_storeu_ps(t, res[r]);
                for (int i = 0; n0 + i < N; i++) o[i] = t[i];
            }
        }
    }
}

/* x [B, K] → int16 per block of 32 in the full range (32767 steps: the weights here are
 * at most 127 in size, so no pair of products comes near int32's limits; with the row
 * kernels' 16383 one near-tied position of a tiny Qwen3.5 model flipped), its step and
 * its exact block sums: pn_quantize_x's arithmetic otherwise. */
static void bg_quantize(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd, float *xs) {
    quantize_x16(x, B, K, xq, xd, xs, 32767.0f);
}

static void gemm_b_groups(const PnMat *m, const float *x, int64_t B, const PnScratch *s,
                          float *out) {
    bg_quantize(x, B, m->K, s->xq, s->xd, s->xs);
    BgArgs a = {m, s->xq, s->xd, s->xs, B, out};
    pool_run(bg_chunk, &a, (m->N + 7) / 8);
}
#endif
