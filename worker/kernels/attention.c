/* attention.c: a step's single-token queries over their slots' KV caches (fp32, f16,
 * q8_0, q4_0), one work item per (query, kv head) on the pool: NumPy took ~15 calls and
 * two batched products per layer for this (65 us at 8 queries; figures below). */
/* -- attention of a step's single-token queries over their slots' fp32 caches ----------
 * One work item per (query, kv head): its group of query heads meets the keys of
 * positions [first, last] (contiguous rows of the cache), a softmax, and the values.
 * numpy took ~15 calls and two batched products per layer for this (65 us at 8 queries
 * of 100 positions, SmolLM2's shape); one call reads each key and value row once. */
#if defined(__AVX512F__)
/* e^x for x <= 0 (softmax after the max is taken off): 2^n * p(r), |r| <= ln2 / 2, a
 * degree-6 polynomial; relative error below 2e-7; x < -87 gives 0. */
static inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    p = _mm512_scalef_ps(p, n);
    return _mm512_maskz_mov_ps(~tiny, p);
}
#endif

/* a query as two int8 digits (query_digits) */
typedef struct { int8_t *qi, *qi2; float *dq; int32_t *qs, *qs2; } QDigits;

typedef struct {
    const float *q; int64_t q_stride, Hq, Hkv, hd; const void *K, *V; int64_t ctx;
    const int64_t *slots, *first, *last; float *out; int64_t out_stride; int kv;
} AttnArgs;

/* -- KV cache element types (common/kv_cache.py): kv = k type | v type << 2, each
 * 0 f32, 1 f16, 2 q8_0, 3 q4_0. A quantized row is head_dim / 32 blocks of llama.cpp's
 * layout: an fp16 scale d, then q8_0 32 int8 (x = d q), q4_0 16 bytes (element j in the
 * low nibble of byte j, j + 16 in its high nibble; x = d (nibble - 8)). Rows are
 * quantized once when stored and read a row at a time: no dequantized copy of a cache. */
static inline int64_t kv_row_bytes(int t, int64_t hd) {
    return t == 0 ? 4 * hd : t == 1 ? 2 * hd : t == 2 ? hd / 32 * 34 : hd / 32 * 18;
}

static float f32_of_half(uint16_t h);

/* x [hd] → one stored row of type t (the reference quantizers of llama.cpp's ggml) */
static void kv_store_row(int t, void *restrict dst, const float *restrict x, int64_t hd);

/* one stored row of type t → y [hd] floats */
static inline void kv_load_row(int t, const void *restrict src, float *restrict y, int64_t hd) {
    if (t == 0) { memcpy(y, src, sizeof(float) * hd); return; }
    if (t == 1) {
        for (int64_t i = 0; i < hd; i++) y[i] = f32_of_half(((const uint16_t *)src)[i]);
        return;
    }
    const uint8_t *b = src;
    for (int64_t blk = 0; blk < hd / 32; blk++, y += 32) {
        uint16_t dh;
        memcpy(&dh, b, 2);
        const float d = f32_of_half(dh);
        if (t == 2) {
            const int8_t *qs = (const int8_t *)(b + 2);
            for (int i = 0; i < 32; i++) y[i] = d * (float)qs[i];
            b += 34;
        } else {
            const uint8_t *qs = b + 2;
            for (int i = 0; i < 16; i++) {
                y[i] = d * (float)((qs[i] & 15) - 8);
                y[i + 16] = d * (float)((qs[i] >> 4) - 8);
            }
            b += 18;
        }
    }
}

static __thread float *attn_buf;
static __thread int64_t attn_cap;
static __thread float *attn_wide;      /* one key or value row, widened */
static __thread int64_t attn_wide_cap;

/* float -> fp16, round to nearest even (NumPy's astype), overflow to infinity */
static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return (uint16_t)(sign | 0x7C00 | (ax > 0x7F800000u ? 0x200 : 0));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);       /* rounds past 65504 */
    if (ax < 0x38800000u) {                          /* below 2^-14: a subnormal half */
        float v;
        memcpy(&v, &ax, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(v * 16777216.0f));
    }
    const uint32_t e = ax - 0x38000000u;             /* exponent rebiased by 127 - 15 */
    return (uint16_t)(sign | ((e + 0xFFF + ((e >> 13) & 1)) >> 13));
#endif
}

static float f32_of_half(uint16_t h) { return half_to_float(h); }

static void kv_store_row(int t, void *restrict dst, const float *restrict x, int64_t hd) {
    if (t == 0) { memcpy(dst, x, sizeof(float) * hd); return; }
    if (t == 1) {
        for (int64_t i = 0; i < hd; i++) ((uint16_t *)dst)[i] = f32_to_f16(x[i]);
        return;
    }
    uint8_t *b = dst;
    for (int64_t blk = 0; blk < hd / 32; blk++, x += 32) {
        if (t == 2) {                                   /* quantize_row_q8_0_ref */
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const uint16_t dh = f32_to_f16(d);
            memcpy(b, &dh, 2);
            for (int i = 0; i < 32; i++) ((int8_t *)(b + 2))[i] = (int8_t)roundf(x[i] * id);
            b += 34;
        } else {                                        /* quantize_row_q4_0_ref */
            float amax = 0.0f, max = 0.0f;
            for (int i = 0; i < 32; i++)
                if (amax < fabsf(x[i])) { amax = fabsf(x[i]); max = x[i]; }
            const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const uint16_t dh = f32_to_f16(d);
            memcpy(b, &dh, 2);
            for (int i = 0; i < 16; i++) {
                const int8_t a0 = (int8_t)(x[i] * id + 8.5f), a1 = (int8_t)(x[i + 16] * id + 8.5f);
                const uint8_t q0 = a0 < 15 ? (uint8_t)a0 : 15, q1 = a1 < 15 ? (uint8_t)a1 : 15;
                b[2 + i] = (uint8_t)(q0 | (q1 << 4));
            }
            b += 18;
        }
    }
}

static inline float dotf(const float *restrict a, const float *restrict b, int64_t n) {
    int64_t i = 0;
    float t = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    t = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    /* two chains, 16 lanes as the 512-bit build: half the rounding steps per lane */
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc2);
    }
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    t = hsum(_mm256_add_ps(acc, acc2));
#endif
    double tail = 0.0;          /* the portable build's whole sum: in double, as BLAS is close */
    for (; i < n; i++) tail += (double)a[i] * b[i];
    return t + (float)tail;
}

static int attn_generic;        /* tests: the portable loops for every head size */

#if defined(__AVX512F__)
/* r[i] = the sum of v[i]'s 16 lanes: a transposing tree of 45 shuffles and adds where
 * 16 separate reductions took 128 dependent steps. */
static inline __m512 reduce16(const __m512 *v) {
    __m512 t[8], u[4], x[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }   /* u[i], 128-bit lane k: v[4i .. 4i+3] summed over lane k's four floats */
    for (int i = 0; i < 2; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                         _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
}

/* One (query, kv head) item for head sizes of NC * 16 floats: scores 16 positions at a
 * time (rows past the last repeat it and are not stored), values with the group's
 * accumulators in registers, 16 / NC heads at a time, each value row read once. */
/* 16 cached values from p (floats, or fp16 widened) */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t at, const int T,
                                                            const int64_t hd) {
    if (T == 1) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at)));
    if (T == 0) return _mm512_loadu_ps((const float *)p + at);
    /* a block type: elements at .. at + 15 are half of one block of 32 (hd / 32 blocks a row) */
    const int64_t r = at / hd, c = at % hd, bb = T == 2 ? 34 : 18;
    const uint8_t *blk = (const uint8_t *)p + (r * (hd / 32) + c / 32) * bb;
    uint16_t dh;
    memcpy(&dh, blk, 2);
    const __m512 d = _mm512_set1_ps(half_to_float(dh));
    if (T == 2)
        return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(blk + 2 + (c & 31))))));
    __m128i b = _mm_loadu_si128((const __m128i *)(blk + 2));
    if (c & 16) b = _mm_srli_epi16(b, 4);
    b = _mm_and_si128(b, _mm_set1_epi8(15));
    return _mm512_mul_ps(d, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)),
                                          _mm512_set1_ps(8.0f)));
}

/* one stored row of block type T (2 q8_0, 3 q4_0; NC * 16 elements) → floats at y
 * (64-byte aligned): each block's fp16 scale converted once per 32 elements */
static inline __attribute__((always_inline)) void
deq_row16(const int T, const uint8_t *restrict b, float *restrict y, const int NC) {
    for (int blk = 0; blk < NC / 2; blk++, y += 32) {
        uint16_t dh;
        memcpy(&dh, b, 2);
        const __m512 d = _mm512_set1_ps(half_to_float(dh));
        if (T == 2) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 2));
            _mm512_store_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)))));
            _mm512_store_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))));
            b += 34;
        } else {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), m = _mm_set1_epi8(15),
                          e = _mm_set1_epi8(8);
            const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m), e),
                          hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m), e);
            _mm512_store_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo))));
            _mm512_store_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi))));
            b += 18;
        }
    }
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* dwords r[0..15] (16 rows of 16 dwords) → column c of them at out[c * 16] (16 rows) */
static inline __attribute__((always_inline)) void transpose16(__m512i *r, __m512i *out) {
    __m512i t[16], u[16], v[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int m = 0; m < 4; m++) {      /* u[4m + c], 128-bit lane k: column 4k + c, rows 4m.. */
        u[4 * m] = _mm512_unpacklo_epi64(t[4 * m], t[4 * m + 2]);
        u[4 * m + 1] = _mm512_unpackhi_epi64(t[4 * m], t[4 * m + 2]);
        u[4 * m + 2] = _mm512_unpacklo_epi64(t[4 * m + 1], t[4 * m + 3]);
        u[4 * m + 3] = _mm512_unpackhi_epi64(t[4 * m + 1], t[4 * m + 3]);
    }
    for (int c = 0; c < 4; c++) {
        v[c] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        v[4 + c] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        v[8 + c] = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        v[12 + c] = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    }
    for (int c = 0; c < 4; c++) {
        out[c] = _mm512_shuffle_i32x4(v[c], v[8 + c], 0x88);
        out[8 + c] = _mm512_shuffle_i32x4(v[c], v[8 + c], 0xDD);
        out[4 + c] = _mm512_shuffle_i32x4(v[4 + c], v[12 + c], 0x88);
        out[12 + c] = _mm512_shuffle_i32x4(v[4 + c], v[12 + c], 0xDD);
    }
}

/* Scores sc[j L + l] of block keys (KT 2 q8_0, 3 q4_0) against the group's queries as two
 * int8 digits (query_digits): integer dots with vpdpbusd, 16 positions a lane each. A
 * tile's keys are made unsigned bytes (q8_0 + 128; q4_0: its nibbles, 0..15) and
 * transposed once, so that a dword of a query digit broadcast against a vector of 16 keys'
 * dwords adds 4 products to each position's sum; each block's two sums less their offset
 * (128 or 8 times the digit's block sum) are scaled once, by the key's scale and the
 * query's (d, d / 254). Per head and 16 positions: hd / 2 vpdpbusd and hd / 16
 * conversions, where floats took hd fused multiply-adds (and the widening) and a
 * reduction. */
static inline __attribute__((always_inline)) void
attn_kscores_i8(const QDigits *restrict qr, const void *restrict Kh, int64_t L, int64_t g,
                float *restrict sc, const int NC, const int KT) {
    const float *dq = qr->dq;
    const int32_t *qs = qr->qs, *qs2 = qr->qs2;
    const int64_t hd = 16 * NC, nb = NC / 2, krb = kv_row_bytes(KT, hd);
    const int32_t off = KT == 2 ? 128 : 8;
    uint8_t rows[16 * 16 * NC] __attribute__((aligned(64)));     /* [16][hd] unsigned */
    uint16_t dk[8 * 16] __attribute__((aligned(64)));            /* [nb][16] key scales */
    __m512i kt[4 * NC];                                          /* [hd / 4] dwords x 16 */
    const int32_t *qd = (const int32_t *)qr->qi, *qd2 = (const int32_t *)qr->qi2;
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
        const int64_t n = L - l0 < 16 ? L - l0 : 16;
        for (int i = 0; i < 16; i++) {
            const uint8_t *b = (const uint8_t *)Kh + (l0 + (i < n ? i : n - 1)) * krb;
            uint8_t *y = rows + i * hd;
            for (int blk = 0; blk < nb; blk++, y += 32) {
                memcpy(dk + blk * 16 + i, b, 2);
                if (KT == 2) {
                    _mm256_store_si256((__m256i *)y, _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8(-128)));
                    b += 34;
                } else {
                    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)),
                                  m = _mm_set1_epi8(15);
                    _mm_store_si128((__m128i *)y, _mm_and_si128(q, m));
                    _mm_store_si128((__m128i *)(y + 16), _mm_and_si128(_mm_srli_epi16(q, 4), m));
                    b += 18;
                }
            }
        }
        for (int t = 0; t < NC / 4; t++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = _mm512_load_si512((const void *)(rows + i * hd + 64 * t));
            transpose16(r, kt + 16 * t);
        }
        __m512 dkv[8];
        for (int blk = 0; blk < nb; blk++)
            dkv[blk] = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(dk + blk * 16)));
        const __mmask16 keep = (__mmask16)((1u << n) - 1);
        for (int64_t j = 0; j < g; j++) {
            const int32_t *qj = qd + j * hd / 4, *qj2 = qd2 + j * hd / 4;
            __m512 s = _mm512_setzero_ps();
            for (int blk = 0; blk < nb; blk++) {
                __m512i a = _mm512_set1_epi32(-off * qs[j * nb + blk]),
                        b = _mm512_set1_epi32(-off * qs2[j * nb + blk]);
                for (int k = 0; k < 8; k++) {
                    a = _mm512_dpbusd_epi32(a, kt[blk * 8 + k], _mm512_set1_epi32(qj[blk * 8 + k]));
                    b = _mm512_dpbusd_epi32(b, kt[blk * 8 + k], _mm512_set1_epi32(qj2[blk * 8 + k]));
                }
                const __m512 d = _mm512_mul_ps(dkv[blk], _mm512_set1_ps(dq[j * nb + blk]));
                s = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(b),
                                                    _mm512_set1_ps(1.0f / 254.0f),
                                                    _mm512_cvtepi32_ps(a)), d, s);
            }
            _mm512_mask_storeu_ps(sc + j * L + l0, keep, s);
        }
    }
}
#endif

/* vectors c0 .. c0 + 3 (floats 16 c0 .. 16 c0 + 63) of value row l, as floats: fp16 widened,
 * blocks (two of 32) dequantized with each one's scale converted once */
static inline __attribute__((always_inline)) void
load_v4(const void *restrict Vh, int64_t l, int c0, __m512 *vr, const int VT, const int NC) {
    const int64_t hd = 16 * NC;
    if (VT == 0) {
        for (int c = 0; c < 4; c++) vr[c] = _mm512_loadu_ps((const float *)Vh + l * hd + 16 * (c0 + c));
        return;
    }
    if (VT == 1) {
        for (int c = 0; c < 4; c++)
            vr[c] = _mm512_cvtph_ps(_mm256_loadu_si256(
                (const __m256i *)((const uint16_t *)Vh + l * hd + 16 * (c0 + c))));
        return;
    }
    const uint8_t *b = (const uint8_t *)Vh + l * kv_row_bytes(VT, hd) + c0 / 2 * (VT == 2 ? 34 : 18);
    for (int k = 0; k < 2; k++) {
        uint16_t dh;
        memcpy(&dh, b, 2);
        const __m512 d = _mm512_set1_ps(half_to_float(dh));
        if (VT == 2) {
            vr[2 * k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(b + 2)))));
            vr[2 * k + 1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(b + 18)))));
            b += 34;
        } else {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), m = _mm_set1_epi8(15),
                          e = _mm_set1_epi8(8);
            vr[2 * k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_sub_epi8(_mm_and_si128(q, m), e))));
            vr[2 * k + 1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m), e))));
            b += 18;
        }
    }
}

static inline __attribute__((always_inline)) void
attn_fast(const float *restrict qb, const void *restrict Kh, const void *restrict Vh,
          int64_t L, int64_t g, float *restrict sc, float *restrict ob, const int NC,
          const int KT, const int VT, const int scored) {
    const int64_t hd = 16 * NC;
    for (int64_t l0 = 0; l0 < (scored ? 0 : L); l0 += 16) {
        const int64_t n = L - l0 < 16 ? L - l0 : 16;
        int64_t rows[16];
        for (int i = 0; i < 16; i++) rows[i] = (l0 + (i < n ? i : n - 1)) * hd;
        /* block keys: the tile's 16 rows widened once into scratch (16 rows x hd floats,
         * in L1), then read by each head of the group as float rows */
        float tile[KT >= 2 ? 16 * 16 * NC : 1] __attribute__((aligned(64)));
        const void *Kt = Kh;
        int T = KT;
        if (KT >= 2) {
            for (int i = 0; i < 16; i++) {
                deq_row16(KT, (const uint8_t *)Kh + rows[i] / hd * kv_row_bytes(KT, hd),
                          tile + i * hd, NC);
                rows[i] = i * hd;
            }
            Kt = tile, T = 0;
        }
        for (int64_t j = 0; j < g; j++) {
            const float *qj = qb + j * hd;
            __m512 p[16];
            for (int i = 0; i < 16; i++) {
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qj), load16(Kt, rows[i], T, hd));
                for (int c = 1; c < NC; c++)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * c),
                                          load16(Kt, rows[i] + 16 * c, T, hd), acc);
                p[i] = acc;
            }
            _mm512_mask_storeu_ps(sc + j * L + l0, (__mmask16)((1u << n) - 1), reduce16(p));
        }
    }
    for (int64_t j = 0; j < g; j++) {                    /* softmax of each head's row */
        float *s = sc + j * L;
        __m512 vm = _mm512_set1_ps(-INFINITY);
        int64_t l = 0;
        for (; l + 16 <= L; l += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + l));
        float m = _mm512_reduce_max_ps(vm);
        for (; l < L; l++) m = s[l] > m ? s[l] : m;
        vm = _mm512_set1_ps(m);
        __m512 vs = _mm512_setzero_ps();
        for (l = 0; l < L; l += 16) {
            const __mmask16 k = (__mmask16)(L - l >= 16 ? 0xFFFF : (1u << (L - l)) - 1);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + l), vm));
            e = _mm512_maskz_mov_ps(k, e);
            _mm512_mask_storeu_ps(s + l, k, e);
            vs = _mm512_add_ps(vs, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vs));
        for (l = 0; l < L; l += 16) {
            const __mmask16 k = (__mmask16)(L - l >= 16 ? 0xFFFF : (1u << (L - l)) - 1);
            _mm512_mask_storeu_ps(s + l, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + l), inv));
        }
    }
    /* values: a column pass of 64 floats (4 vectors) for up to 6 heads at a time (24
     * accumulators in registers), so that each value row's vectors are read, widened or
     * dequantized (a block's scale converted once) once per pass and used by every head */
    for (int c0 = 0; c0 < NC; c0 += 4) {
        for (int64_t j0 = 0; j0 < g; j0 += 6) {
            const int jn = g - j0 < 6 ? (int)(g - j0) : 6;
            __m512 acc[24];
            for (int i = 0; i < 24; i++) acc[i] = _mm512_setzero_ps();
            const float *w0 = sc + j0 * L;
            for (int64_t l = 0; l < L; l++) {
                __m512 vr[4];
                load_v4(Vh, l, c0, vr, VT, NC);
                for (int jj = 0; jj < 6; jj++) {
                    if (jj >= jn) break;
                    const __m512 w = _mm512_set1_ps(w0[jj * L + l]);
                    for (int c = 0; c < 4; c++)
                        acc[jj * 4 + c] = _mm512_fmadd_ps(w, vr[c], acc[jj * 4 + c]);
                }
            }
            for (int jj = 0; jj < jn; jj++)
                for (int c = 0; c < 4; c++)
                    _mm512_storeu_ps(ob + (j0 + jj) * hd + 16 * (c0 + c), acc[jj * 4 + c]);
        }
    }
}
#endif

/* A query of g heads as two int8 digits per element for the integer key dots: for each
 * block of 32, d = max |x| / 127, x / d = q1 + q2 / 254 with q1 = round(x / d) and q2 =
 * round(254 (x / d - q1)), both in [-127, 127]; x is then within d / 508 of d (q1 + q2 /
 * 254), finer than an fp16 query (one digit, llama.cpp's q8_0 query, moved a tiny
 * model's logits 3e-4 nats from the float path's). qi [g][hd] and qi2 the digits, dq [g][hd / 32]
 * the scales, qs and qs2 the blocks' sums of each digit. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
/* e^x for x <= 0 (the softmax's), 8 lanes: exp512's reduction and polynomial, 2^n built
 * in the exponent bits; x < -87 gives 0 */
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* one stored row of type T (0 f32, 1 f16, 2 q8_0, 3 q4_0; hd floats) → floats at y:
 * fp16 widened, each block's scale converted once per 32 elements */
static inline __attribute__((always_inline)) void
widen_row8(const int T, const void *restrict src, float *restrict y, const int64_t hd) {
    if (T == 0) { memcpy(y, src, sizeof(float) * hd); return; }
    if (T == 1) {
        for (int64_t c = 0; c < hd; c += 8)
            _mm256_store_ps(y + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + c))));
        return;
    }
    const uint8_t *b = src;
    for (int64_t blk = 0; blk < hd / 32; blk++, y += 32) {
        uint16_t dh;
        memcpy(&dh, b, 2);
        const __m256 d = _mm256_set1_ps(half_to_float(dh));
        __m128i q0, q1;                  /* elements 0..15, 16..31 as int8 */
        if (T == 2) {                    /* widened straight from memory, 8 at a time */
            for (int c = 0; c < 4; c++)
                _mm256_store_ps(y + 8 * c, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * c))))));
            b += 34;
            continue;
        } else {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), m = _mm_set1_epi8(15),
                          e = _mm_set1_epi8(8);
            q0 = _mm_sub_epi8(_mm_and_si128(q, m), e);
            q1 = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m), e);
            b += 18;
        }
        _mm256_store_ps(y, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0))));
        _mm256_store_ps(y + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8)))));
        _mm256_store_ps(y + 16, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1))));
        _mm256_store_ps(y + 24, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8)))));
    }
}

/* The 256-bit builds' attention item (head sizes of NC8 * 8 floats, NC8 a multiple of 4):
 * tiles of 16 positions whose keys, then values, are widened or dequantized once into
 * scratch (in L1) and read there by every head of the group. Scores: 8 positions a time
 * in 8 accumulators, reduced by a tree of horizontal adds; values: 6 heads x 16 floats a
 * pass (12 accumulators: 16 registers hold them, two value vectors and a weight), kept in
 * `ob` between tiles. */
static inline __attribute__((always_inline)) void
attn_fast8(const float *restrict qb, const void *restrict Kh, const void *restrict Vh,
           int64_t L, int64_t g, float *restrict sc, float *restrict ob, const int NC8,
           const int KT, const int VT) {
    const int64_t hd = 8 * NC8, krb = kv_row_bytes(KT, hd), vrb = kv_row_bytes(VT, hd);
    float tile[16 * 8 * NC8] __attribute__((aligned(32)));
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
        const int64_t n = L - l0 < 16 ? L - l0 : 16;
        const float *rows[16];
        for (int i = 0; i < 16; i++) {
            const int64_t l = l0 + (i < n ? i : n - 1);
            if (KT == 0) rows[i] = (const float *)((const char *)Kh + l * krb);
            else if (i < n) widen_row8(KT, (const char *)Kh + l * krb, tile + i * hd, hd), rows[i] = tile + i * hd;
            else rows[i] = rows[n - 1];
        }
        for (int64_t j = 0; j < g; j++) {
            const float *qj = qb + j * hd;
            for (int h = 0; h < 16 && h < n; h += 8) {
                __m256 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
                for (int c = 0; c < NC8; c++) {
                    const __m256 qv = _mm256_loadu_ps(qj + 8 * c);
                    for (int i = 0; i < 8; i++)
                        a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[h + i] + 8 * c), a[i]);
                }
                const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]),
                             t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
                const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
                const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                               _mm256_permute2f128_ps(u0, u1, 0x31));
                if (n - h >= 8) {
                    _mm256_storeu_ps(sc + j * L + l0 + h, r);
                } else {
                    float out8[8];
                    _mm256_storeu_ps(out8, r);
                    for (int i = 0; i < n - h; i++) sc[j * L + l0 + h + i] = out8[i];
                }
            }
        }
    }
    for (int64_t j = 0; j < g; j++) {                    /* softmax of each head's row */
        float *s = sc + j * L, m = s[0];
        int64_t l = 0;
        __m256 vm = _mm256_set1_ps(-INFINITY);
        for (; l + 8 <= L; l += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + l));
        float mm[8];
        _mm256_storeu_ps(mm, vm);
        for (int i = 0; i < 8; i++) m = mm[i] > m ? mm[i] : m;
        for (; l < L; l++) m = s[l] > m ? s[l] : m;
        vm = _mm256_set1_ps(m);
        __m256 vs = _mm256_setzero_ps();
        for (l = 0; l + 8 <= L; l += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + l), vm));
            _mm256_storeu_ps(s + l, e);
            vs = _mm256_add_ps(vs, e);
        }
        float sum = hsum(vs);
        for (; l < L; l++) { s[l] = expf(s[l] - m); sum += s[l]; }
        const __m256 inv = _mm256_set1_ps(1.0f / sum);
        for (l = 0; l + 8 <= L; l += 8) _mm256_storeu_ps(s + l, _mm256_mul_ps(_mm256_loadu_ps(s + l), inv));
        for (; l < L; l++) s[l] *= 1.0f / sum;
    }
    for (int64_t i = 0; i < g * hd; i += 8) _mm256_storeu_ps(ob + i, _mm256_setzero_ps());
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
        const int64_t n = L - l0 < 16 ? L - l0 : 16;
        const float *rows[16];
        for (int i = 0; i < n; i++) {
            if (VT == 0) rows[i] = (const float *)((const char *)Vh + (l0 + i) * vrb);
            else widen_row8(VT, (const char *)Vh + (l0 + i) * vrb, tile + i * hd, hd), rows[i] = tile + i * hd;
        }
        for (int c0 = 0; c0 < NC8; c0 += 2) {         /* 6 heads x 16 floats a pass */
            for (int64_t j0 = 0; j0 < g; j0 += 6) {
                const int jn = g - j0 < 6 ? (int)(g - j0) : 6;
                __m256 acc[12];
                for (int jj = 0; jj < 6; jj++) {
                    if (jj >= jn) break;
                    for (int c = 0; c < 2; c++)
                        acc[jj * 2 + c] = _mm256_loadu_ps(ob + (j0 + jj) * hd + 8 * (c0 + c));
                }
                const float *w0 = sc + j0 * L + l0;
                for (int64_t i = 0; i < n; i++) {
                    const __m256 v0 = _mm256_loadu_ps(rows[i] + 8 * c0),
                                 v1 = _mm256_loadu_ps(rows[i] + 8 * c0 + 8);
                    for (int jj = 0; jj < 6; jj++) {
                        if (jj >= jn) break;
                        const __m256 w = _mm256_set1_ps(w0[jj * L + i]);
                        acc[jj * 2] = _mm256_fmadd_ps(w, v0, acc[jj * 2]);
                        acc[jj * 2 + 1] = _mm256_fmadd_ps(w, v1, acc[jj * 2 + 1]);
                    }
                }
                for (int jj = 0; jj < jn; jj++)
                    for (int c = 0; c < 2; c++)
                        _mm256_storeu_ps(ob + (j0 + jj) * hd + 8 * (c0 + c), acc[jj * 2 + c]);
            }
        }
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static __thread void *qdigit_buf;
static __thread int64_t qdigit_cap;

static int query_digits(const float *q, int64_t g, int64_t hd, QDigits *r) {
    const int64_t n = g * hd, nb = n / 32;
    const int64_t need = 2 * n + nb * 12 + 64;
    if (need > qdigit_cap) {
        void *nbuf = NULL;
        if (posix_memalign(&nbuf, 64, (size_t)need)) return 0;
        free(qdigit_buf);
        qdigit_buf = nbuf;
        qdigit_cap = need;
    }
    r->qi = qdigit_buf;
    r->qi2 = r->qi + n;
    r->dq = (float *)(r->qi2 + n);
    r->qs = (int32_t *)(r->dq + nb);
    r->qs2 = r->qs + nb;
    for (int64_t b = 0; b < nb; b++) {
        const float *x = q + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t s1 = 0, s2 = 0;
        for (int i = 0; i < 32; i++) {
            const float y = x[i] * id, q1 = fminf(fmaxf(rintf(y), -127.0f), 127.0f);
            const float q2 = fminf(fmaxf(rintf((y - q1) * 254.0f), -127.0f), 127.0f);
            r->qi[32 * b + i] = (int8_t)q1;
            r->qi2[32 * b + i] = (int8_t)q2;
            s1 += (int32_t)q1;
            s2 += (int32_t)q2;
        }
        r->dq[b] = d;
        r->qs[b] = s1;
        r->qs2[b] = s2;
    }
    return 1;
}
#endif

static void attn_item(const void *p, int64_t it) {
    const AttnArgs *a = p;
    const int64_t b = it / a->Hkv, h = it % a->Hkv, g = a->Hq / a->Hkv, hd = a->hd;
    const int64_t lo = a->first[b], L = a->last[b] + 1 - lo;
    const int64_t base = (a->slots[b] * a->Hkv + h) * a->ctx + lo;
    const int kt = a->kv & 3, vt = a->kv >> 2;
    const int64_t krb = kv_row_bytes(kt, hd), vrb = kv_row_bytes(vt, hd);
    const char *Kh = (const char *)a->K + base * krb, *Vh = (const char *)a->V + base * vrb;
    const float *qb = a->q + b * a->q_stride + h * g * hd;
    float *ob = a->out + b * a->out_stride + h * g * hd;
    if (L * g > attn_cap) {
        float *nb = realloc(attn_buf, sizeof(float) * L * g);
        if (!nb) return;            /* cannot happen for a context that was allocated */
        attn_buf = nb;
        attn_cap = L * g;
    }
    float *sc = attn_buf;           /* [g][L] */
#if defined(__AVX512F__)
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    QDigits qr = {0};
    if (kt >= 2 && !attn_generic && (hd == 64 || hd == 128 || hd == 256)
        && !query_digits(qb, g, hd, &qr)) return;
#define KSCORES(KT, NC) (KT >= 2 ? (attn_kscores_i8(&qr, Kh, L, g, sc, NC, KT), 1) : 0)
#else
#define KSCORES(KT, NC) 0
#endif
#define ATTN_FAST(KT, VT) switch (attn_generic ? 0 : hd) { \
    case 64: attn_fast(qb, Kh, Vh, L, g, sc, ob, 4, KT, VT, KSCORES(KT, 4)); return; \
    case 128: attn_fast(qb, Kh, Vh, L, g, sc, ob, 8, KT, VT, KSCORES(KT, 8)); return; \
    case 256: attn_fast(qb, Kh, Vh, L, g, sc, ob, 16, KT, VT, KSCORES(KT, 16)); return; \
    default: break; }
    /* the cache types taken here (others: the row loops below) */
    switch (a->kv) {
    case 0: ATTN_FAST(0, 0) break;
    case 1 | 1 << 2: ATTN_FAST(1, 1) break;
    case 2 | 2 << 2: ATTN_FAST(2, 2) break;
    case 3 | 3 << 2: ATTN_FAST(3, 3) break;
    case 2 | 3 << 2: ATTN_FAST(2, 3) break;
    case 1 | 3 << 2: ATTN_FAST(1, 3) break;
    case 2 | 1 << 2: ATTN_FAST(2, 1) break;
    case 1 | 2 << 2: ATTN_FAST(1, 2) break;
    default: break;
    }
#undef ATTN_FAST
#undef KSCORES
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (!attn_generic && (hd == 64 || hd == 128 || hd == 256)) {
#define ATTN_FAST8(KT, VT) switch (hd) { \
    case 64: attn_fast8(qb, Kh, Vh, L, g, sc, ob, 8, KT, VT); return; \
    case 128: attn_fast8(qb, Kh, Vh, L, g, sc, ob, 16, KT, VT); return; \
    default: attn_fast8(qb, Kh, Vh, L, g, sc, ob, 32, KT, VT); return; }
        switch (a->kv) {
        case 0: ATTN_FAST8(0, 0) break;
        case 1 | 1 << 2: ATTN_FAST8(1, 1) break;
        case 2 | 2 << 2: ATTN_FAST8(2, 2) break;
        case 3 | 3 << 2: ATTN_FAST8(3, 3) break;
        case 2 | 3 << 2: ATTN_FAST8(2, 3) break;
        case 1 | 3 << 2: ATTN_FAST8(1, 3) break;
        case 2 | 1 << 2: ATTN_FAST8(2, 1) break;
        case 1 | 2 << 2: ATTN_FAST8(1, 2) break;
        default: break;
        }
#undef ATTN_FAST8
    }
#endif
    /* the portable loops read float rows: one key or value row at a time is widened
     * (fp16) or dequantized (q8_0, q4_0) into a row of scratch; f32 rows are read as
     * they are */
    if (hd > attn_wide_cap) {
        float *nb = realloc(attn_wide, sizeof(float) * hd);
        if (!nb) return;
        attn_wide = nb;
        attn_wide_cap = hd;
    }
    for (int64_t l = 0; l < L; l++) {
        const float *kr = (const float *)(Kh + l * krb);
        if (kt) kv_load_row(kt, Kh + l * krb, attn_wide, hd), kr = attn_wide;
        for (int64_t j = 0; j < g; j++) sc[j * L + l] = dotf(qb + j * hd, kr, hd);
    }
    for (int64_t j = 0; j < g; j++) {
        float *s = sc + j * L, m = s[0], sum = 0.0f;
        for (int64_t l = 1; l < L; l++) m = s[l] > m ? s[l] : m;
        int64_t l = 0;
#if defined(__AVX512F__)
        __m512 vs = _mm512_setzero_ps(), vm = _mm512_set1_ps(m);
        for (; l + 16 <= L; l += 16) {
            __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + l), vm));
            _mm512_storeu_ps(s + l, e);
            vs = _mm512_add_ps(vs, e);
        }
        sum = _mm512_reduce_add_ps(vs);
#endif
        for (; l < L; l++) { s[l] = expf(s[l] - m); sum += s[l]; }
        const float inv = 1.0f / sum;
        for (l = 0; l < L; l++) s[l] *= inv;
    }
    for (int64_t j = 0; j < g; j++) memset(ob + j * hd, 0, sizeof(float) * hd);
    for (int64_t l = 0; l < L; l++) {
        const float *vr = (const float *)(Vh + l * vrb);
        if (vt) kv_load_row(vt, Vh + l * vrb, attn_wide, hd), vr = attn_wide;
        for (int64_t j = 0; j < g; j++) {
            const float w = sc[j * L + l];
            float *o = ob + j * hd;
            int64_t d = 0;
#if defined(__AVX512F__)
            const __m512 vw = _mm512_set1_ps(w);
            for (; d + 16 <= hd; d += 16)
                _mm512_storeu_ps(o + d, _mm512_fmadd_ps(vw, _mm512_loadu_ps(vr + d), _mm512_loadu_ps(o + d)));
#endif
            for (; d < hd; d++) o[d] += w * vr[d];
        }
    }
}

/* The step's new keys and values (rows of Hkv * hd, strides apart) are stored at
 * (slots[b], last[b]) of K, V [slots, Hkv, ctx, hd]; then out (rows out_stride apart)
 * = attention of q [B, Hq, hd] (scaled; rows q_stride apart) over K, V: query b reads
 * slot slots[b], positions first[b] .. last[b]. */
void pn_attend_decodes(const float *q, int64_t q_stride, int64_t B, int64_t Hq, int64_t Hkv,
                       int64_t hd, void *K, void *V, int64_t ctx, const int64_t *slots,
                       const int64_t *first, const int64_t *last, const float *knew,
                       int64_t k_stride, const float *vnew, int64_t v_stride, float *out,
                       int64_t out_stride, int kv) {
    const int kt = kv & 3, vt = kv >> 2;
    const int64_t krb = kv_row_bytes(kt, hd), vrb = kv_row_bytes(vt, hd);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t at = (slots[b] * Hkv + h) * ctx + last[b];
            kv_store_row(kt, (char *)K + at * krb, knew + b * k_stride + h * hd, hd);
            kv_store_row(vt, (char *)V + at * vrb, vnew + b * v_stride + h * hd, hd);
        }
    AttnArgs a = {q, q_stride, Hq, Hkv, hd, K, V, ctx, slots, first, last, out, out_stride, kv};
    pool_run(attn_item, &a, B * Hkv);
}
