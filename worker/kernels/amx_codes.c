/* amx_codes.c: decode steps (16 rows of x or fewer) on AMX tiles (PN_AMX): the weights'
 * own codes, exact in bf16, meet x's hi and lo halves, each run scaled in the vector
 * registers; decoding every weight into float halves cost more than the integer products
 * at these batch sizes. */
#if defined(PN_AMX)
static void super_bf16(int code, const uint8_t *b, uint16_t *hi, uint16_t *lo) {
    Super512 S;
    load_super512(code, b, &S);
    float mins[8];
    _mm256_storeu_ps(mins, S.mf);
    const __m512 d = _mm512_set1_ps(S.d);
    for (int j = 0; j < 8; j++) {
        const __m512 mj = _mm512_set1_ps(mins[j]);
        __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(S.w[j])));
        __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(S.w[j], 1)));
        store_split(hi + 32 * j, lo + 32 * j, _mm512_fmadd_ps(a, d, mj), _mm512_fmadd_ps(c, d, mj));
    }
}

/* -- decode steps on AMX tiles: the weights' own codes, exact in bf16 --------------------
 * For 16 rows of x or fewer, decoding every weight into float halves costs more than the
 * integer products (above). Here a weight's code (q4: 0 .. 15, q8: -128 .. 127, Q6_K's
 * q - 32) is already an exact bf16, so one tile of codes meets x's hi and lo halves in two
 * tile products per run (32 values; Q6_K's runs of 16), and each run's sums take their
 * scale (and min, times x's sum over the run) in the vector registers: 16 rows of W, one
 * accumulator per row, the run's products summed exactly as a float product would be, to
 * x's hi + lo (~2^-17). */
static uint16_t lut_codes[96];      /* bf16 of 0 .. 15 (q4), then of -32 .. 31 (Q6_K) */

static int amx_codes_ok(const PnMat *m) {
    if (!lut_codes[1]) {
        for (int i = 0; i < 96; i++) {
            float f = i < 32 ? (float)(i & 15) : (float)(i - 64);
            uint32_t u;
            memcpy(&u, &f, 4);
            __atomic_store_n(&lut_codes[i], (uint16_t)(u >> 16), __ATOMIC_RELAXED);
        }
    }
    return m->code == Q4K || m->code == Q6K || m->code == Q4
           || ((m->code == Q8 || m->code == Q8M) && m->bs == 32);
}

#define UNIT 256                    /* values of a row decoded at a time (a super-block) */

/* Codes of row r, values [k0, k0 + n) (n <= UNIT, k0 on a super-block for K-quants),
 * into codes[0 ..), with each run's scale and min (the min multiplies x's sum over it). */
static void row_codes(const PnMat *m, int64_t r, int64_t k0, int64_t n, uint16_t *codes,
                      float *sc, float *mn) {
    const int64_t K = m->K;
    if (m->code == Q4K) {
        const uint8_t *b = m->qs + (r * (K / 256) + k0 / 256) * Q4K_BYTES;
        const __m512i lut = _mm512_loadu_si512((const void *)lut_codes);
        const __m256i low4 = _mm256_set1_epi8(15);
        uint8_t sm[16];
        k_scales_fast(b + 4, sm);
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)sm))), _mm512_mask_blend_ps(0xFF00,
            _mm512_set1_ps(half_to_float(load_u16(b))), _mm512_set1_ps(-half_to_float(load_u16(b + 2)))));
        _mm256_storeu_ps(sc, _mm512_castps512_ps256(f));             /* d * sc[j] */
        _mm256_storeu_ps(mn, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
        for (int g = 0; g < 4; g++) {  /* bytes 32g..: low nibbles 64g + i, high 64g + 32 + i */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * g));
            _mm512_storeu_si512(codes + 64 * g, _mm512_permutexvar_epi16(
                _mm512_cvtepu8_epi16(_mm256_and_si256(raw, low4)), lut));
            _mm512_storeu_si512(codes + 64 * g + 32, _mm512_permutexvar_epi16(
                _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4)), lut));
        }
        return;
    }
    if (m->code == Q6K) {
        const uint8_t *b = m->qs + (r * (K / 256) + k0 / 256) * Q6K_BYTES;
        const uint8_t *ql = b, *qh = b + 128;
        const __m512i lo = _mm512_loadu_si512((const void *)(lut_codes + 32));
        const __m512i hi = _mm512_loadu_si512((const void *)(lut_codes + 64));
        const __m512i low4 = _mm512_set1_epi16(15), two = _mm512_set1_epi16(0x30);
        _mm512_storeu_ps(sc, _mm512_mul_ps(_mm512_set1_ps(half_to_float(load_u16(b + 208))),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))))));
        (void)mn;                   /* no mins */
        for (int h = 0; h < 2; h++) {   /* as load_super512: elements 128h + 32k + l */
            __m512i l0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 64 * h)));
            __m512i l1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32)));
            __m512i bits = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)));
            __m512i q[4] = {
                _mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_and_si512(_mm512_slli_epi16(bits, 4), two)),
                _mm512_or_si512(_mm512_and_si512(l1, low4), _mm512_and_si512(_mm512_slli_epi16(bits, 2), two)),
                _mm512_or_si512(_mm512_srli_epi16(l0, 4), _mm512_and_si512(bits, two)),
                _mm512_or_si512(_mm512_srli_epi16(l1, 4), _mm512_and_si512(_mm512_srli_epi16(bits, 2), two))};
            for (int k = 0; k < 4; k++)
                _mm512_storeu_si512(codes + 128 * h + 32 * k, _mm512_permutex2var_epi16(lo, q[k], hi));
        }
        return;
    }
    const int64_t nb = K / 32;
    for (int64_t blk = k0 / 32, j = 0; j < n / 32; blk++, j++) {
        sc[j] = half_to_float(m->sc[r * nb + blk]);
        mn[j] = m->code == Q8 ? 0.0f : half_to_float(m->mn[r * nb + blk]);
        __m512i v;
        if (m->code == Q4) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(m->qs + r * (K / 2) + 16 * blk));
            const __m128i low4 = _mm_set1_epi8(15);
            const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(
                _mm_and_si128(raw, low4)), _mm_and_si128(_mm_srli_epi16(raw, 4), low4), 1);
            v = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(both),
                                         _mm512_loadu_si512((const void *)lut_codes));
        } else {
            const int8_t *q = (const int8_t *)m->qs + r * K + 32 * blk;
            __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
            __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
            v = (__m512i)_mm512_cvtne2ps_pbh(b, a);       /* integers of 8 bits: exact */
        }
        _mm512_storeu_si512(codes + 32 * j, v);
    }
}

static void amx_codes_config(int run, int side) {
    TileCfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    if (side) {                     /* sums 0-3, codes 4-5, x 6-7 */
        for (int t = 0; t < 4; t++) c.colsb[t] = 64, c.rows[t] = 16;
        for (int t = 4; t < 6; t++) c.colsb[t] = (uint16_t)(2 * run), c.rows[t] = 16;
        for (int t = 6; t < 8; t++) c.colsb[t] = 64, c.rows[t] = (uint8_t)(run / 2);
        _tile_loadconfig(&c);
        return;
    }
    for (int t = 0; t < 2; t++) {   /* two runs in flight: tiles t, 2 + t, 4 + 2t, 5 + 2t */
        c.colsb[t] = 64, c.rows[t] = 16;                        /* sums: rows of W x 16 of x */
        c.colsb[2 + t] = (uint16_t)(2 * run), c.rows[2 + t] = 16;   /* codes: rows of W x run */
        c.colsb[4 + 2 * t] = c.colsb[5 + 2 * t] = 64;               /* x's hi and lo halves */
        c.rows[4 + 2 * t] = c.rows[5 + 2 * t] = (uint8_t)(run / 2);
    }
    _tile_loadconfig(&c);
}

static __thread uint16_t *amx_codes;   /* a thread's 16 rows of codes, UNIT each */

/* acc[i] += run j's sums of row i times its scale (+ its min times x's sums xs) */
static inline void codes_scale(__m512 acc[16], float sums[16][16], float sc[16][16],
                               float mn[16][16], int64_t j, const float *xs) {
    if (xs) {
        const __m512 s = _mm512_load_ps(xs);
        #pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            acc[i] = _mm512_fmadd_ps(s, _mm512_set1_ps(mn[i][j]), _mm512_fmadd_ps(
                _mm512_loadu_ps(sums[i]), _mm512_set1_ps(sc[i][j]), acc[i]));
        return;
    }
    #pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(sums[i]), _mm512_set1_ps(sc[i][j]), acc[i]);
}

/* run j of the codes (tile A) against x's halves side by side (tile X) into sums tile C */
#define CODES_RUN1(C, A, X, j) do {                                                        \
        const int64_t k_ = k0 + (j) * run;                                                 \
        _tile_zero(C);                                                                     \
        _tile_loadd(A, amx_codes + (j) * run, UNIT * 2);                                   \
        _tile_loadd(X, a->xp + 2 * (k_ / 32) * 256 + (k_ % 32) / 2 * 16, 64);              \
        _tile_dpbf16ps(C, A, X);                                                           \
    } while (0)

/* run j of the codes (tile A) against x's halves (tiles XH, XL) into sums tile C */
#define CODES_RUN(C, A, XH, XL, j) do {                                                   \
        const int64_t k_ = k0 + (j) * run;                                                 \
        const uint32_t *xh_ = a->xp + 2 * (k_ / 32) * 256 + (k_ % 32) / 2 * 16;            \
        _tile_zero(C);                                                                     \
        _tile_loadd(A, amx_codes + (j) * run, UNIT * 2);                                   \
        _tile_loadd(XH, xh_, 64);                                                          \
        _tile_loadd(XL, xh_ + 256, 64);                                                    \
        _tile_dpbf16ps(C, A, XH);                                                          \
        _tile_dpbf16ps(C, A, XL);                                                          \
    } while (0)

static void amx_codes_chunk(const void *p, int64_t c) {
    const AmxArgs *a = p;
    const PnMat *m = a->m;
    const int64_t K = m->K, N = m->N;
    const int run = m->code == Q6K ? 16 : 32;
    const int has_min = m->code == Q4K || m->code == Q4 || m->code == Q8M;
    if (!amx_codes && !(amx_codes = aligned_alloc(64, 16 * UNIT * 2))) abort();
    float sc[16][16], mn[16][16], sums[16][16];
    const int64_t rowb = is_k(m->code) ? K / 256 * k_bytes(m->code) : m->code == Q4 ? K / 2 : K,
                  tile_b = 16 * rowb;   /* bytes of 16 rows of W */
    amx_codes_config(run, a->side);
    const int64_t first = AMX_CODES_ROWS * c;
    for (int64_t o = 0; o < tile_b; o += 64)    /* this piece's first 16 rows, all at once */
        _mm_prefetch((const char *)m->qs + first * rowb + o, _MM_HINT_T0);
    for (int64_t n0 = first; n0 < first + AMX_CODES_ROWS && n0 < N; n0 += 16) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < K; k0 += UNIT) {
            const int64_t n = K - k0 < UNIT ? K - k0 : UNIT;
            if (n0 + 16 < N && n0 + 16 < first + AMX_CODES_ROWS) {
                /* the next 16 rows' part (one stream, not 16 sparse ones) */
                const char *nx = (const char *)m->qs + (n0 + 16) * rowb;
                for (int64_t o = k0 * tile_b / K; o < (k0 + n) * tile_b / K; o += 64)
                    _mm_prefetch(nx + o, _MM_HINT_T0);
            }
            for (int i = 0; i < 16; i++)
                if (n0 + i < N) row_codes(m, n0 + i, k0, n, amx_codes + i * UNIT, sc[i], mn[i]);
                else {
                    memset(amx_codes + i * UNIT, 0, UNIT * 2);
                    memset(sc[i], 0, sizeof sc[i]), memset(mn[i], 0, sizeof mn[i]);
                }
            /* runs in pairs: the second's products run on the tiles while the first's
             * sums take their scales */
            const int64_t nr = n / run;
            if (a->side) {
                /* one product per run (x's hi and lo halves side by side), four runs' sums
                 * tiles in turn: a run's sums take their scales two runs after its product
                 * was issued, while the next ones run on the tiles */
#define CODES_FIX(C, j) do {                                                               \
        _tile_stored(C, sums, 64);                                                         \
        codes_scale(acc, sums, sc, mn, j, has_min ? a->xs + 16 * ((k0 + (j) * run) / 32) : NULL); \
    } while (0)
                if (nr > 0) CODES_RUN1(0, 4, 6, 0);
                if (nr > 1) CODES_RUN1(1, 5, 7, 1);
                for (int64_t j = 0; j < nr; j += 4) {
                    if (j + 2 < nr) CODES_RUN1(2, 4, 6, j + 2);
                    CODES_FIX(0, j);
                    if (j + 3 < nr) CODES_RUN1(3, 5, 7, j + 3);
                    if (j + 1 < nr) CODES_FIX(1, j + 1);
                    if (j + 4 < nr) CODES_RUN1(0, 4, 6, j + 4);
                    if (j + 2 < nr) CODES_FIX(2, j + 2);
                    if (j + 5 < nr) CODES_RUN1(1, 5, 7, j + 5);
                    if (j + 3 < nr) CODES_FIX(3, j + 3);
                }
#undef CODES_FIX
                continue;
            }
            for (int64_t j = 0; j < nr; j += 2) {
                CODES_RUN(0, 2, 4, 5, j);
                if (j + 1 < nr) CODES_RUN(1, 3, 6, 7, j + 1);
                _tile_stored(0, sums, 64);
                codes_scale(acc, sums, sc, mn, j, has_min ? a->xs + 16 * ((k0 + j * run) / 32) : NULL);
                if (j + 1 < nr) {
                    _tile_stored(1, sums, 64);
                    codes_scale(acc, sums, sc, mn, j + 1,
                                has_min ? a->xs + 16 * ((k0 + (j + 1) * run) / 32) : NULL);
                }
            }
        }
        for (int i = 0; i < 16; i++)    /* side by side: lanes 8-15 hold the lo halves' sums */
            _mm512_storeu_ps(sums[i], a->side ? _mm512_add_ps(acc[i], _mm512_shuffle_f32x4(
                acc[i], acc[i], 0x4E)) : acc[i]);
        for (int64_t r = 0; r < a->M; r++)
            for (int i = 0; i < 16 && n0 + i < N; i++) a->out[r * N + n0 + i] = sums[i][r];
    }
}
#endif
