/* rows.c: blocks of 32 (q4, q8, iq4nl) at decode batch sizes, up to MAXB rows of x: x
 * quantized to int16 per block (pn_quantize_x), then the row kernels — one read of W
 * serves every row of x (memory-bound decode) — on 256-bit vectors, or, with AVX-512,
 * two blocks per 512-bit vector (pairs: 1.74 against 1.93 ns per block and row at batch
 * 1, 0.91 against 1.13 at 16). */
#if defined(__AVX2__)
/* Rows [n0, n1) of a q4 or q8 matrix against B quantized rows of x. A row's scales and
 * mins are converted to floats once, and its mins meet x's exact block sums in one dot
 * product after the blocks (the min term of a block is min * sum of its x). */
static void gemv_i8_rows(int code, const uint8_t *restrict qs, const uint16_t *restrict sc,
                         const uint16_t *restrict mn, int64_t K, int64_t bs, int64_t N,
                         const int16_t *restrict xq, const float *restrict xd,
                         const float *restrict xs, int64_t B, float *restrict out,
                         int64_t n0, int64_t n1) {
    const int64_t nx = K / 32, ns = K / bs, row_bytes = code == Q4 || code == IQ4NL ? K / 2 : K;
    const int with_min = code == Q4 || code == Q8M;
    float sf[MAX_RUNS], mf[MAX_RUNS];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = qs + n * row_bytes;
        /* mins only with bs 32: ns == nx */
        row_scales(row, row_bytes, sc + n * ns, mn + n * ns, ns, with_min, sf, mf);
        if (B == 1) {                 /* four chains of blocks: the FMAs overlap */
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
            for (int64_t blk = 0; blk < nx; blk++) {
                __m256i w0, w1;
                load_block(code, row, blk, &w0, &w1);
                acc[blk & 3] = block_dot(bs, w0, w1, xq + blk * 32, sf, xd[blk], blk,
                                         acc[blk & 3]);
            }
            out[n] = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),
                                        _mm256_add_ps(acc[2], acc[3])))
                     + (with_min ? dot(mf, xs, nx) : 0.0f);
            continue;
        }
        for (int64_t b0 = 0; b0 < B; b0 += GROUP) {
            int64_t g = B - b0 < GROUP ? B - b0 : GROUP;
            __m256 acc[GROUP];
            for (int64_t b = 0; b < g; b++) acc[b] = _mm256_setzero_ps();
            for (int64_t blk = 0; blk < nx; blk++) {
                __m256i w0, w1;
                load_block(code, row, blk, &w0, &w1);
                for (int64_t b = 0; b < g; b++) {
                    const int64_t xb = (b0 + b) * nx + blk;
                    acc[b] = block_dot(bs, w0, w1, xq + xb * 32, sf, xd[xb], blk, acc[b]);
                }
            }
            for (int64_t b = 0; b < g; b++)
                out[(b0 + b) * N + n] = hsum(acc[b])
                    + (with_min ? dot(mf, xs + (b0 + b) * nx, nx) : 0.0f);
        }
    }
}

/* Q8M (5-bit values with a min, bs 32) has a min per block too: handled above. Mins of
 * the bs 16 kind do not occur (Q6_K has none). */

/* x [B, K] → int16 per block of 32 (xq), its scale (xd) and exact block sums (xs).
 * `paired`: each pair of blocks a, b is stored as a0..15 b0..15 a16..31 b16..31, the
 * order in which the AVX-512 kernels below widen two blocks of weights (an odd last
 * block stays as it is). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 32 values → int16 in two halves of 16 at lo, hi, with the scalar code's arithmetic (r =
 * v * inv, then r + copysign(0.5, r) truncated); returns the step d, *sum the block's sum
 * (in a different order than the scalar code: the last bits may differ). */
static inline float quantize32(const float *v, float step_max, int16_t *lo, int16_t *hi,
                               float *sum) {
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    const float d = amax / step_max, inv = d > 0 ? 1.0f / d : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv), half = _mm512_set1_ps(0.5f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 ra = _mm512_mul_ps(a, vinv), rb = _mm512_mul_ps(b, vinv);
    ra = _mm512_add_ps(ra, _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(ra), sign), _mm512_castps_si512(half))));
    rb = _mm512_add_ps(rb, _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(rb), sign), _mm512_castps_si512(half))));
    _mm256_storeu_si256((__m256i *)lo, _mm512_cvtsepi32_epi16(_mm512_cvttps_epi32(ra)));
    _mm256_storeu_si256((__m256i *)hi, _mm512_cvtsepi32_epi16(_mm512_cvttps_epi32(rb)));
    return d;
}
#endif

/* x [B, K] → int16 per block of 32 in `steps` steps (16383: the row kernels, whose madd
 * pairs of products must not overflow; 32767: the b_groups), eight at a time with the
 * scalar loop's arithmetic in pn_quantize_x; xd the steps, xs the exact block sums. */
static inline void quantize_x16(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd,
                                float *xs, float steps) {
    const int64_t nx = K / 32;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 half = _mm256_set1_ps(0.5f);
    for (int64_t b = 0; b < B; b++)
        for (int64_t blk = 0; blk < nx; blk++) {
            const float *v = x + b * K + blk * 32;
            int16_t *q = xq + b * K + blk * 32;
            __m256 a[4], m = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
            for (int h = 0; h < 4; h++) {
                a[h] = _mm256_loadu_ps(v + 8 * h);
                m = _mm256_max_ps(m, _mm256_and_ps(a[h], absmask));
                sum = _mm256_add_ps(sum, a[h]);
            }
            const float d = hmax8(m) / steps, inv = d > 0 ? 1.0f / d : 0.0f;
            const __m256 vinv = _mm256_set1_ps(inv);
            __m256i iv[4];
            for (int h = 0; h < 4; h++) {
                __m256 r = _mm256_mul_ps(a[h], vinv);
                iv[h] = _mm256_cvttps_epi32(_mm256_add_ps(r, _mm256_or_ps(_mm256_and_ps(r, sign), half)));
            }
            _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[0], iv[1]), 0xD8));
            _mm256_storeu_si256((__m256i *)(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[2], iv[3]), 0xD8));
            xd[b * nx + blk] = d;
            xs[b * nx + blk] = hsum(sum);
        }
}

void pn_quantize_x(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd, float *xs,
                   int paired) {
    int64_t nx = K / 32;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int64_t b = 0; b < B; b++)
        for (int64_t blk = 0; blk < nx; blk++) {
            int16_t *q = xq + b * K + blk * 32;
            int16_t *lo = q, *hi = q + 16;
            if (paired && (blk | 1) < nx) {     /* a0..15 b0..15 a16..31 b16..31 */
                int16_t *base = xq + b * K + (blk & ~(int64_t)1) * 32 + (blk & 1) * 16;
                lo = base;
                hi = base + 32;
            }
            xd[b * nx + blk] = quantize32(x + b * K + blk * 32, 16383.0f, lo, hi, &xs[b * nx + blk]);
        }
#else
    if (!paired) {              /* AVX2: eight at a time, the arithmetic of the loop below */
        quantize_x16(x, B, K, xq, xd, xs, 16383.0f);
        return;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t blk = 0; blk < nx; blk++) {
            const float *v = x + b * K + blk * 32;
            float amax = 0.0f, sum = 0.0f;
            for (int i = 0; i < 32; i++) {
                float a = v[i] < 0 ? -v[i] : v[i];
                amax = a > amax ? a : amax;
                sum += v[i];
            }
            /* 16383, not 32767: a madd pair of two full-range products would overflow */
            float d = amax / 16383.0f, inv = d > 0 ? 1.0f / d : 0.0f;
            int16_t *q = xq + b * K + blk * 32;
            const int pair = paired && (blk | 1) < nx, second = blk & 1;
            for (int i = 0; i < 32; i++) {
                float r = v[i] * inv;
                int16_t qv = (int16_t)(r < 0 ? r - 0.5f : r + 0.5f);
                if (pair)       /* within the pair's 64: halves of a, b interleaved */
                    xq[b * K + (blk & ~(int64_t)1) * 32 + (i / 16) * 32 + second * 16 + i % 16] = qv;
                else
                    q[i] = qv;
            }
            xd[b * nx + blk] = d;
            xs[b * nx + blk] = sum;
        }
#endif
}

#if defined(PN_ZMM)
/* AVX-512 for q4 and q8 (bs 32): two blocks a, b of a row widen into two vectors of 32
 * int16, [a0..15 b0..15] and [a16..31 b16..31], which meet x stored in that order
 * (pn_quantize_x, paired) in two dpwssd; lanes 0..7 then hold a's partial sums and
 * 8..15 b's, converted and scaled in one multiply-add. Against the 256-bit path this
 * is about a third of the instructions per block. */
static inline void load_pair(int code, const uint8_t *restrict row, int64_t k,
                             __m512i *lo, __m512i *hi) {
    if (code == Q4) {           /* 32 bytes: a's 16 then b's; nibbles low = i, high = 16 + i */
        __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + 32 * k)));
        *lo = _mm512_and_si512(raw, _mm512_set1_epi16(15));
        *hi = _mm512_srli_epi16(raw, 4);
        return;
    }
    if (code == IQ4NL) {        /* q4's layout; the levels (twice: 32 int16) looked up */
        const __m512i lut = _mm512_cvtepi8_epi16(_mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)IQ4_LEVELS)));
        __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + 32 * k)));
        *lo = _mm512_permutexvar_epi16(_mm512_and_si512(raw, _mm512_set1_epi16(15)), lut);
        *hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4), lut);
        return;
    }
    __m256i a = _mm256_loadu_si256((const __m256i *)(row + 64 * k));
    __m256i b = _mm256_loadu_si256((const __m256i *)(row + 64 * k + 32));
    *lo = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, b, 0x20));
    *hi = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, b, 0x31));
}

/* One row of W (its scales sf, mins mf as floats) against G rows of x from xq0 / xd0 /
 * xs0 (paired layout), G a constant at each call: the accumulators stay in registers. */
static inline __attribute__((always_inline)) void pair_rows(
        int code, const uint8_t *restrict row, const float *restrict sf,
        const float *restrict mf, int with_min, int64_t K, const int16_t *restrict xq0,
        const float *restrict xd0, const float *restrict xs0, float *restrict out,
        int64_t N, const int G) {
    const int64_t nx = K / 32, np2 = nx / 2;
    const __m512i half = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[GROUP];
    for (int b = 0; b < G; b++) acc[b] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < np2; k0 += 8) {         /* 8 pairs: 16 scales per load */
        const int64_t k1 = k0 + 8 < np2 ? k0 + 8 : np2;
        const __mmask16 live = (__mmask16)((1u << (2 * (k1 - k0))) - 1);
        const __m512 w16 = _mm512_maskz_loadu_ps(live, sf + 2 * k0);
        __m512 s16[GROUP];
        for (int b = 0; b < G; b++)
            s16[b] = _mm512_mul_ps(w16, _mm512_maskz_loadu_ps(live, xd0 + b * nx + 2 * k0));
        __m512i idx = half;
        for (int64_t k = k0; k < k1; k++) {
            __m512i lo, hi;
            load_pair(code, row, k, &lo, &hi);
            for (int b = 0; b < G; b++) {
                const int16_t *x = xq0 + b * K + 64 * k;
                __m512i c = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo,
                                                _mm512_loadu_si512((const void *)x));
                c = _mm512_dpwssd_epi32(c, hi, _mm512_loadu_si512((const void *)(x + 32)));
                acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c),
                                         _mm512_permutexvar_ps(idx, s16[b]), acc[b]);
            }
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2));
        }
    }
    for (int b = 0; b < G; b++) {
        float t = _mm512_reduce_add_ps(acc[b]);
        if (nx & 1) {                           /* an odd last block, as stored */
            __m256i w0, w1;
            load_block(code, row, nx - 1, &w0, &w1);
            t += hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(dot16(w0, w1, xq0 + b * K + K - 32)),
                                    _mm256_set1_ps(sf[nx - 1] * xd0[b * nx + nx - 1])));
        }
        out[b * N] = t + (with_min ? dot(mf, xs0 + b * nx, nx) : 0.0f);
    }
}

/* Rows [n0, n1) of a q4 / q8 (bs 32) matrix against B rows of x (paired layout). */
static void gemv_i8_rows512(int code, const uint8_t *restrict qs, const uint16_t *restrict sc,
                            const uint16_t *restrict mn, int64_t K, int64_t N,
                            const int16_t *restrict xq, const float *restrict xd,
                            const float *restrict xs, int64_t B, float *restrict out,
                            int64_t n0, int64_t n1) {
    const int64_t nx = K / 32, row_bytes = code == Q4 || code == IQ4NL ? K / 2 : K;
    const int with_min = code == Q4 || code == Q8M;
    float sf[MAX_RUNS], mf[MAX_RUNS];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = qs + n * row_bytes;
        row_scales(row, row_bytes, sc + n * nx, mn + n * nx, nx, with_min, sf, mf);
        for (int64_t b0 = 0; b0 < B;) {
            const int64_t left = B - b0;
            const int G = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const int16_t *x0 = xq + b0 * K;
            const float *d0 = xd + b0 * nx, *s0 = xs + b0 * nx;
            float *o = out + b0 * N + n;
            if (G == 8) pair_rows(code, row, sf, mf, with_min, K, x0, d0, s0, o, N, 8);
            else if (G == 4) pair_rows(code, row, sf, mf, with_min, K, x0, d0, s0, o, N, 4);
            else if (G == 2) pair_rows(code, row, sf, mf, with_min, K, x0, d0, s0, o, N, 2);
            else pair_rows(code, row, sf, mf, with_min, K, x0, d0, s0, o, N, 1);
            b0 += G;
        }
    }
}
/* Whether x goes in pairs of blocks for these weights and rows (the pairs win at every
 * batch: one core, a [1536, 576] q4 matrix, variants alternated in one process, ns per
 * block and row at 1 / 4 / 8 / 16 rows: 1.74 / 1.02 / 0.93 / 0.91 against 1.93 / 1.30 /
 * 1.58 / 1.13 with 256-bit vectors). */
int pn_pairs_x(int code, int64_t bs, int64_t B) {
    (void)B;
    return (code == Q4 || code == Q8 || code == Q8M || code == IQ4NL) && bs == 32;
}
#else
int pn_pairs_x(int code, int64_t bs, int64_t B) { return 0; }
#endif

typedef struct {
    int code; const uint8_t *qs; const uint16_t *sc, *mn; int64_t N, K, bs;
    const int16_t *xq; const float *xd, *xs; int64_t B; float *out; int64_t rows;
} I8Args;

static void i8_chunk(const void *p, int64_t c) {
    const I8Args *a = p;
    int64_t n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
#if defined(PN_ZMM)
    if (pn_pairs_x(a->code, a->bs, a->B)) {
        gemv_i8_rows512(a->code, a->qs, a->sc, a->mn, a->K, a->N, a->xq, a->xd, a->xs,
                        a->B, a->out, n0, n1);
        return;
    }
#endif
    gemv_i8_rows(a->code, a->qs, a->sc, a->mn, a->K, a->bs, a->N, a->xq, a->xd, a->xs,
                 a->B, a->out, n0, n1);
}

/* out[B, N] = W @ x with x given quantized (pn_quantize_x): q4 and q8 kinds only. */
void pn_gemv_i8(int code, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                int64_t N, int64_t K, int64_t bs, const int16_t *xq, const float *xd,
                const float *xs, int64_t B, float *out) {
    I8Args a = {code, qs, sc, mn, N, K, bs, xq, xd, xs, B, out, piece_rows(N)};
    pool_run(i8_chunk, &a, (N + a.rows - 1) / a.rows);
}
#else
void pn_quantize_x(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd, float *xs,
                   int paired) {}
int pn_pairs_x(int code, int64_t bs, int64_t B) { return 0; }
void pn_gemv_i8(int code, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                int64_t N, int64_t K, int64_t bs, const int16_t *xq, const float *xd,
                const float *xs, int64_t B, float *out) {}
#endif
