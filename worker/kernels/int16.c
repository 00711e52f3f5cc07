/* int16.c: the 256-bit integer primitives every integer product shares (AVX2 builds): a
 * block of 32 widened to int16 (load_block: q4, iq4nl, q8), a row's scales as floats
 * (row_scales, with the weight stream's prefetch), the madd dot products. int16
 * activations, not llama.cpp's int8: int8 kept top-1 at only 97.3 % of SmolLM2's
 * positions against fp32. */
#if defined(__AVX2__)
#include <immintrin.h>
/* Integer path (decode): x is quantized per block of 32 to int16 with a float scale
 * (xq, xd; a relative error of 2^-16, where int8 activations as llama.cpp uses them
 * kept top-1 at only 97.3 % of SmolLM2's positions against fp32) and its exact block sums
 * kept (xs, for the mins). A block of weights, widened to int16, meets each row of x
 * in two madd (s16 x s16 pairs → s32) products, scaled into eight float lanes. */

/* 32 weights as int16 (w0: elements 0..15, w1: 16..31) against 32 int16 of x. */
static inline __m256i dot16(__m256i w0, __m256i w1, const int16_t *x) {
    __m256i a = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x));
    __m256i b = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16)));
    return _mm256_add_epi32(a, b);
}

/* acc + pairs of a x b (int16 → int32 lanes): one VNNI instruction where there is one. */
static inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 floats' largest */
static inline float hmax8(__m256 m) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
}

/* 8 int32's sum */
static inline int32_t hsum_epi32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

#define GROUP 8     /* rows of x that share one pass over a row of W (registers) */
#ifndef PF_AHEAD
/* The products wait on W's stream from memory unless software prefetches run this far
 * ahead (Qwen2.5-1.5B decode, steps alternated in one process: batch 1 15.5-16.5 ->
 * 17.4-18.7 tok/s at 2048, 17.9 at 1024, 18.8 at 4096; batch 8 41.8 -> 48.4) */
#define PF_AHEAD 2048
#endif

/* The 32 weights of block `blk` as int16: w0 elements 0..15, w1 elements 16..31. */
static inline void load_block(int code, const uint8_t *restrict row, int64_t blk,
                              __m256i *w0, __m256i *w1) {
    if (code == Q4) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(row + blk * 16));
        __m128i low4 = _mm_set1_epi8(15);
        *w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
        *w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        return;
    }
    if (code == IQ4NL) {        /* q4's nibbles, each looked up among the levels */
        __m128i raw = _mm_loadu_si128((const __m128i *)(row + blk * 16));
        __m128i low4 = _mm_set1_epi8(15), lut = _mm_loadu_si128((const __m128i *)IQ4_LEVELS);
        *w0 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(lut, _mm_and_si128(raw, low4)));
        *w1 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
        return;
    }
    const int8_t *q = (const int8_t *)row + blk * 32;
    *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
    *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
}

/* n fp16 values → floats, eight at a time. */
static inline void halves(const uint16_t *restrict h, int64_t n, float *restrict out) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = half_to_float(h[i]);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One block of one row of x: acc += scale * (w . x) in eight float lanes; `sf` holds the
 * row's scales as floats (one per block, or two per block for runs of 16). */
static inline __m256 block_dot(int64_t bs, __m256i w0, __m256i w1, const int16_t *x,
                               const float *sf, float xd, int64_t blk, __m256 acc) {
    if (bs == 32) {
        __m256 p = _mm256_cvtepi32_ps(dot16(w0, w1, x));
        return _mm256_fmadd_ps(p, _mm256_set1_ps(sf[blk] * xd), acc);
    }
    __m256 p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)));
    __m256 p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16))));
    acc = _mm256_fmadd_ps(p0, _mm256_set1_ps(sf[2 * blk] * xd), acc);
    return _mm256_fmadd_ps(p1, _mm256_set1_ps(sf[2 * blk + 1] * xd), acc);
}

#define MAX_RUNS 4096   /* scale entries per row held on the stack (K up to 65536) */

/* Row n of a q4 / q8 matrix (row_bytes of values, ns fp16 scales and mins): fetch the
 * stream PF_AHEAD on (W streams from memory), and its scales (and mins) as floats. */
static inline void row_scales(const uint8_t *restrict row, int64_t row_bytes,
                              const uint16_t *restrict sc, const uint16_t *restrict mn,
                              int64_t ns, int with_min, float *restrict sf, float *restrict mf) {
    for (int64_t l = 0; l < row_bytes; l += 64)
        _mm_prefetch((const char *)row + PF_AHEAD + l, _MM_HINT_T0);
    _mm_prefetch((const char *)sc + PF_AHEAD / 8, _MM_HINT_T0);
    if (with_min) _mm_prefetch((const char *)mn + PF_AHEAD / 8, _MM_HINT_T0);
    halves(sc, ns, sf);
    if (with_min) halves(mn, ns, mf);
}

#endif
