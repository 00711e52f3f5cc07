/* lanes.c: many rows of x with AVX-512 VNNI (PN_ZMM): 16 tokens across a vector's lanes,
 * the weights broadcast, so a scale step and a horizontal sum serve 16 rows of x. From 13
 * rows (K-quants) and 11 (blocks of 32; SmolLM2 batch 16: 398 -> 557 tok/s). */
/* Rows of x from which pn_matmul_int takes the token-lane products (PnOptions.ktile_k:
 * K-quants, ktile_b: q4 / q8; 0 turns them off). Below 16 the last group is part zeros;
 * one core, alternated, on Qwen2.5-1.5B's Q4_K / Q6_K and SmolLM2's Q4_1 matrices the
 * lanes overtake the row kernels from 13 (Q4_K's gate / up: 2.51 against 2.79 ns per
 * super-block, row and token; at 12: 2.59 against 2.18) and 10-11 (Q4_1) rows. */
#define KTILE_K 13
#define KTILE_B 11

#if defined(PN_ZMM)
/* -- K-quant products of many rows of x, tokens across the vector lanes ------------------
 * gemv_k_rows puts K along a vector's lanes, so every row of x pays its own scale step
 * and horizontal sum per super-block and row of W. Here a vector holds one pair of K
 * positions for 16 rows of x (tokens), the weights' pair (int16, sub-scale multiplied in,
 * as load_super512 widens it) is broadcast from memory, and one `vpdpwssd` gives 32
 * products for 16 tokens; the sums are flushed to floats once per sub-block of 32 and
 * row of W for all 16 tokens together (16 pair products per lane: Q6_K's |q * sc| <= 4096
 * times 16000, twice, 16 times stays below 2^31), and the mins meet x's sums per 32 the
 * same way. W's super-blocks are widened once per chunk of x (not once per group of
 * tokens); x is laid out once per product: xt[group][block][pair][token]. From 13 rows
 * of x (KTILE_K above; a last group short of 16 tokens is padded with zeros). */
#define TT 16               /* tokens per vector */
#define TR 8                /* rows of W per pass (their sums in registers) */

typedef struct {
    int code; const uint8_t *qs; int64_t N, K, M, G; const int32_t *xt; const float *dx, *xs;
    float *out; int64_t rows;
} TileArgs;

static __thread float *kt_fa;
static __thread int64_t kt_fa_cap;

static void ktile_chunk(const void *p, int64_t c) {
    const TileArgs *a = p;
    const int64_t nb = a->K / 256, bytes = k_bytes(a->code), G = a->G;
    const int64_t n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    int16_t wbuf[TR][256] __attribute__((aligned(64)));
    float dr[TR], mins[TR][8];
    float facc[TR * TT] __attribute__((aligned(64)));
    if (G > kt_fa_cap) {    /* per group of tokens: TR x TT running sums */
        free(kt_fa);
        kt_fa = aligned_alloc(64, sizeof(float) * (size_t)(G * TR * TT));
        if (!kt_fa) abort();                /* a few KiB */
        kt_fa_cap = G;
    }
    float *fa = kt_fa;
    for (int64_t r0 = n0; r0 < n1; r0 += TR) {
        const int nr = n1 - r0 < TR ? (int)(n1 - r0) : TR;
        memset(fa, 0, sizeof(float) * (size_t)(G * TR * TT));
        for (int64_t blk = 0; blk < nb; blk++) {
            for (int r = 0; r < TR; r++) {
                if (r >= nr) {
                    memset(wbuf[r], 0, sizeof wbuf[r]);
                    dr[r] = 0.0f;
                    memset(mins[r], 0, sizeof mins[r]);
                    continue;
                }
                const uint8_t *b = a->qs + ((r0 + r) * nb + blk) * bytes;
                if (r0 + TR < n1)   /* the next pass's rows, the same block: W streams from memory */
                    for (int64_t l = 0; l < bytes; l += 64)
                        _mm_prefetch((const char *)b + TR * nb * bytes + l, _MM_HINT_T0);
                Super512 S;
                load_super512(a->code, b, &S);
                for (int j = 0; j < 8; j++) _mm512_store_si512((void *)(wbuf[r] + 32 * j), S.w[j]);
                dr[r] = S.d;
                _mm256_storeu_ps(mins[r], S.mf);
            }
            const int has_min = a->code == Q4K || a->code == Q5K;
            for (int64_t g = 0; g < G; g++) {
                const int32_t *xt = a->xt + (g * nb + blk) * 128 * TT;
                const __m512 dxv = _mm512_loadu_ps(a->dx + (g * nb + blk) * TT);
                __m512 f[TR];       /* this block's sum of d * (each sub-block's int sums) */
                for (int r = 0; r < TR; r++) f[r] = _mm512_setzero_ps();
                for (int j = 0; j < 8; j++) {
                    __m512i acc[TR];
                    for (int r = 0; r < TR; r++) acc[r] = _mm512_setzero_si512();
                    const int32_t *w32 = (const int32_t *)wbuf[0] + 16 * j;   /* row r: + 128 r */
                    const int32_t *xj = xt + 16 * j * TT;
#pragma GCC unroll 2
                    for (int q = 0; q < 16; q++) {
                        const __m512i xv = _mm512_load_si512((const void *)(xj + q * TT));
#pragma GCC unroll 8
                        for (int r = 0; r < TR; r++)
                            acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_set1_epi32(w32[128 * r + q]), xv);
                    }
#pragma GCC unroll 8
                    for (int r = 0; r < TR; r++)
                        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(dr[r]), f[r]);
                }
                for (int r = 0; r < TR; r++) {      /* times x's scale per token */
                    __m512 t = _mm512_fmadd_ps(f[r], dxv, _mm512_load_ps(fa + (g * TR + r) * TT));
                    if (has_min)
                        for (int j = 0; j < 8; j++)
                            t = _mm512_fmadd_ps(_mm512_set1_ps(mins[r][j]),
                                                _mm512_loadu_ps(a->xs + ((g * nb + blk) * 8 + j) * TT), t);
                    _mm512_store_ps(fa + (g * TR + r) * TT, t);
                }
            }
        }
        for (int64_t g = 0; g < G; g++) {      /* out[token][row] */
            memcpy(facc, fa + g * TR * TT, sizeof facc);
            for (int t = 0; t < TT && g * TT + t < a->M; t++)
                for (int r = 0; r < nr; r++) a->out[(g * TT + t) * a->N + r0 + r] = facc[r * TT + t];
        }
    }
}

static __thread int32_t *tile_xt;
static __thread float *tile_dx, *tile_xs;
static __thread int64_t tile_cap;

/* x laid out for `need` int32 pairs (G groups x 16 tokens x K / 2), with a scale and a sum
 * per token and 32 values at most (need / 16 floats each: per 256 and per 32 fit) */
static void tile_scratch(int64_t need) {
    if (need <= tile_cap) return;
    free(tile_xt), free(tile_dx), free(tile_xs);
    tile_xt = aligned_alloc(64, (size_t)need * 4);
    tile_dx = aligned_alloc(64, (size_t)(need / 16 + 16) * 4);
    tile_xs = aligned_alloc(64, (size_t)(need / 16 + 16) * 4);
    if (!tile_xt || !tile_dx || !tile_xs) abort();      /* the host is out of memory */
    tile_cap = need;
}

/* x quantized (xq int16 [M, K], a scale per block of `per` values, `S` sums per block)
 * laid out for the lanes: xt[group][block][pair][token], dx[group][block][token],
 * xs[group][block][sum][token]; tokens past M are zeros, never stored back. */
static int64_t tile_layout(const int16_t *xq, const float *xd, const float *xs, int64_t M,
                           int64_t K, int64_t per, int S) {
    const int64_t nb = K / per, P = per / 2, G = (M + TT - 1) / TT;
    tile_scratch(G * TT * K / 2);
    const int32_t *x32 = (const int32_t *)xq;          /* pairs of int16 */
    for (int64_t g = 0; g < G; g++)
        for (int64_t blk = 0; blk < nb; blk++) {
            int32_t *xt = tile_xt + (g * nb + blk) * P * TT;
            float *dx = tile_dx + (g * nb + blk) * TT, *xsv = tile_xs + (g * nb + blk) * S * TT;
            for (int t = 0; t < TT; t++) {
                const int64_t m = g * TT + t;
                const int in = m < M;
                for (int64_t pp = 0; pp < P; pp++) xt[pp * TT + t] = in ? x32[m * (K / 2) + blk * P + pp] : 0;
                dx[t] = in ? xd[m * nb + blk] : 0.0f;
                for (int j = 0; j < S; j++) xsv[j * TT + t] = in ? xs[(m * nb + blk) * S + j] : 0.0f;
            }
        }
    return G;
}

static int64_t KTILE_MIN[2] = {KTILE_K, KTILE_B};

/* out[M, N] = x @ W.T for a K-quant W (not Q2_K) through ktile_chunk; x already quantized
 * by pn_quantize_xk into xq, xd, xs. */
static void gemm_k_tiled(int code, const uint8_t *qs, int64_t N, int64_t K, const int16_t *xq,
                         const float *xd, const float *xs, int64_t M, float *out) {
    const int64_t G = tile_layout(xq, xd, xs, M, K, 256, 8), rows = piece_rows(N);
    TileArgs a = {code, qs, N, K, M, G, tile_xt, tile_dx, tile_xs, out, rows};
    pool_run(ktile_chunk, &a, (N + rows - 1) / rows);
}

/* The same turn for q4 and q8 (blocks of 32, an fp16 scale and maybe a min each), from
 * 11 rows of x (SmolLM2 batch 16, alternated: 398 -> 557 tok/s; at 8 rows, half the
 * lanes empty, the row kernels win: 332 against 280): each block's int sums take the row's
 * scale times x's scale per token (16 pair products per lane: 128 x 16383, twice, 16
 * times, far below 2^31), the mins x's float sums per block. A pass widens its TR rows
 * of W whole (int16 [TR][K]) and meets every group of 16 tokens with them; beyond the
 * row kernels' 16 rows the tiles of dequantized floats and OpenBLAS took these before. */
typedef struct {
    const PnMat *m; int64_t M, G; const int32_t *xt; const float *dx, *xs; float *out;
    int64_t rows;
} BTileArgs;
#define XB_MAX 32767.0f    /* x's steps per block of 32 here */

static __thread int16_t *bt_w;
static __thread float *bt_sc;
static __thread int64_t bt_cap;

static void btile_chunk(const void *p, int64_t c) {
    const BTileArgs *a = p;
    const PnMat *m = a->m;
    const int64_t K = m->K, N = m->N, nb = K / 32, G = a->G;
    const int64_t n0 = c * a->rows, n1 = n0 + a->rows < N ? n0 + a->rows : N;
    const int with_min = m->code == Q4 || m->code == Q8M;
    if (bt_cap < K) {
        free(bt_w), free(bt_sc);
        bt_w = aligned_alloc(64, (size_t)(TR * K) * 2);
        bt_sc = aligned_alloc(64, (size_t)(2 * TR * nb) * 4 + 64);
        if (!bt_w || !bt_sc) abort();
        bt_cap = K;
    }
    float *scf = bt_sc, *mnf = bt_sc + TR * nb;
    float facc[TR * TT] __attribute__((aligned(64)));
    for (int64_t r0 = n0; r0 < n1; r0 += TR) {
        const int nr = n1 - r0 < TR ? (int)(n1 - r0) : TR;
        for (int r = 0; r < TR; r++) {
            int16_t *w = bt_w + r * K;
            if (r >= nr) {
                memset(w, 0, (size_t)K * 2);
                for (int64_t blk = 0; blk < nb; blk++) scf[r * nb + blk] = mnf[r * nb + blk] = 0.0f;
                continue;
            }
            const int64_t row = r0 + r;
            if (m->code == Q4) {            /* byte i of a block: element i (low), i + 16 (high) */
                const __m128i low4 = _mm_set1_epi8(15);
                for (int64_t blk = 0; blk < nb; blk++) {
                    const __m128i raw = _mm_loadu_si128((const __m128i *)(m->qs + row * (K / 2) + 16 * blk));
                    _mm256_store_si256((__m256i *)(w + 32 * blk), _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4)));
                    _mm256_store_si256((__m256i *)(w + 32 * blk + 16),
                                       _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
                }
            } else if (m->code == IQ4NL) {  /* q4's layout, the levels looked up */
                const __m128i low4 = _mm_set1_epi8(15), lut = _mm_loadu_si128((const __m128i *)IQ4_LEVELS);
                for (int64_t blk = 0; blk < nb; blk++) {
                    const __m128i raw = _mm_loadu_si128((const __m128i *)(m->qs + row * (K / 2) + 16 * blk));
                    _mm256_store_si256((__m256i *)(w + 32 * blk), _mm256_cvtepi8_epi16(
                        _mm_shuffle_epi8(lut, _mm_and_si128(raw, low4))));
                    _mm256_store_si256((__m256i *)(w + 32 * blk + 16), _mm256_cvtepi8_epi16(
                        _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), low4))));
                }
            } else {
                for (int64_t k = 0; k < K; k += 32)
                    _mm512_store_si512((void *)(w + k), _mm512_cvtepi8_epi16(
                        _mm256_loadu_si256((const __m256i *)((const int8_t *)m->qs + row * K + k))));
            }
            for (int64_t blk = 0; blk < nb; blk++) {
                scf[r * nb + blk] = half_to_float(m->sc[row * nb + blk]);
                mnf[r * nb + blk] = with_min ? half_to_float(m->mn[row * nb + blk]) : 0.0f;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            __m512 f[TR];
            for (int r = 0; r < TR; r++) f[r] = _mm512_setzero_ps();
            for (int64_t blk = 0; blk < nb; blk++) {
                __m512i acc[TR];
                for (int r = 0; r < TR; r++) acc[r] = _mm512_setzero_si512();
                const int32_t *xj = a->xt + (g * nb + blk) * 16 * TT;
                const int32_t *w32 = (const int32_t *)bt_w + 16 * blk;     /* row r: + K / 2 r */
#pragma GCC unroll 2
                for (int q = 0; q < 16; q++) {
                    const __m512i xv = _mm512_load_si512((const void *)(xj + q * TT));
#pragma GCC unroll 8
                    for (int r = 0; r < TR; r++)
                        acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_set1_epi32(w32[(K / 2) * r + q]), xv);
                }
                const __m512 dxv = _mm512_load_ps(a->dx + (g * nb + blk) * TT);
                const __m512 xsv = _mm512_load_ps(a->xs + (g * nb + blk) * TT);
#pragma GCC unroll 8
                for (int r = 0; r < TR; r++) {
                    f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]),
                                           _mm512_mul_ps(_mm512_set1_ps(scf[r * nb + blk]), dxv), f[r]);
                    if (with_min) f[r] = _mm512_fmadd_ps(_mm512_set1_ps(mnf[r * nb + blk]), xsv, f[r]);
                }
            }
            for (int r = 0; r < TR; r++) _mm512_store_ps(facc + r * TT, f[r]);
            for (int t = 0; t < TT && g * TT + t < a->M; t++)
                for (int r = 0; r < nr; r++) a->out[(g * TT + t) * N + r0 + r] = facc[r * TT + t];
        }
    }
}

/* out[M, N] = x @ W.T for q4 / q8 (bs 32) through btile_chunk: x quantized per 32
 * (pn_quantize_x, not paired) into the scratch, then laid out tokens across lanes */
static void gemm_b_tiled(const PnMat *m, const float *x, int64_t M, const PnScratch *s, float *out) {
    const int64_t K = m->K, nb = K / 32;
    for (int64_t b = 0; b < M; b++)         /* the full int16 range: no pair of products */
        for (int64_t blk = 0; blk < nb; blk++)      /* here can overflow (see above) */
            s->xd[b * nb + blk] = quantize32(x + b * K + blk * 32, XB_MAX, s->xq + b * K + blk * 32,
                                             s->xq + b * K + blk * 32 + 16, &s->xs[b * nb + blk]);
    const int64_t G = tile_layout(s->xq, s->xd, s->xs, M, K, 32, 1), rows = piece_rows(m->N);
    BTileArgs a = {m, M, G, tile_xt, tile_dx, tile_xs, out, rows};
    pool_run(btile_chunk, &a, (m->N + rows - 1) / rows);
}
int pn_has_lanes(void) { return 1; }
#else
int pn_has_lanes(void) { return 0; }
#endif
