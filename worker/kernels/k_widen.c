/* k_widen.c: the K-quants' (and IQ4_XS's) primitives for the integer products: x per
 * super-block of 256 as int16 (pn_quantize_xk), and a super-block widened to int16 with
 * its sub-scales multiplied in (load_super on 256-bit vectors; load_super512 with AVX-512:
 * Q4_K 8.6 ns per super-block against 11.2, Q6_K 11.1 against 15.0). */
#if defined(__AVX2__)
/* -- K-quant products: x per super-block of 256 as int16 with one float scale (a step of
 * 1/16000 of the block's largest |x|) and exact sums per 32 (xs, for Q4_K's mins). A
 * super-block's weights are widened to int16 once, with their integer sub-scale already
 * multiplied in (q * sc: |.| <= 945 for Q4_K, (q - 32) * sc: <= 4096 for Q6_K), so every
 * row of x meets them in 16 int16 pair products (madd, or VNNI's dpwssd) summed in
 * int32, and one float multiply per 256 weights and row. (int8 activations, llama.cpp's
 * q8_K, would take half the work but measured here a mean KL of 0.004-0.017 nats and
 * top-1 agreement of 92-95 % on tiny models against their fp32 forward; int16: 0.0000
 * and 100 %.) The same products serve a prefill chunk: sub-pieces of W's rows stay in
 * cache while every group of 8 rows of x passes (measured on Zen 4, one core: 5.5 ns per
 * super-block and row at 128 rows, where dequantized tiles and OpenBLAS took ~9). */

#define XK_MAX 16000.0f   /* |x| in steps: keeps every int32 sum of a super-block in range */

/* 32 values times inv, rounded half away from zero and kept within +-lim, as int32 in
 * q[4] (the int16 and the int8 activations' one rounding) */
static inline void round32(const float *v, float inv, float lim, __m256i q[4]) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 half = _mm256_set1_ps(0.5f), vinv = _mm256_set1_ps(inv);
    const __m256 hi = _mm256_set1_ps(lim), lo = _mm256_set1_ps(-lim);
    for (int h = 0; h < 4; h++) {
        __m256 r = _mm256_mul_ps(_mm256_loadu_ps(v + 8 * h), vinv);
        r = _mm256_add_ps(r, _mm256_or_ps(_mm256_and_ps(r, sign), half));
        q[h] = _mm256_cvttps_epi32(_mm256_max_ps(_mm256_min_ps(r, hi), lo));
    }
}

/* x [B, K] → int16 (xq), a scale per 256 (xd), the sums of xq per 32 times that scale
 * (xs: what the Q4_K mins meet). */
void pn_quantize_xk(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd,
                    float *xs) {
    const int64_t nb = K / 256;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int64_t b = 0; b < B; b++)
        for (int64_t blk = 0; blk < nb; blk++) {
            const float *v = x + b * K + blk * 256;
            int16_t *q = xq + b * K + blk * 256;
            __m512 m = _mm512_setzero_ps();
            for (int i = 0; i < 256; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
            const float d = _mm512_reduce_max_ps(m) / XK_MAX, inv = d > 0 ? 1.0f / d : 0.0f;
            const __m512 vinv = _mm512_set1_ps(inv), half = _mm512_set1_ps(0.5f);
            const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
            for (int j = 0; j < 8; j++) {
                __m512i tot = _mm512_setzero_si512();
                for (int h = 0; h < 2; h++) {
                    __m512 r = _mm512_mul_ps(_mm512_loadu_ps(v + 32 * j + 16 * h), vinv);
                    r = _mm512_add_ps(r, _mm512_castsi512_ps(_mm512_or_si512(
                        _mm512_and_si512(_mm512_castps_si512(r), sign), _mm512_castps_si512(half))));
                    const __m512i iv = _mm512_cvttps_epi32(r);
                    tot = _mm512_add_epi32(tot, iv);
                    _mm256_storeu_si256((__m256i *)(q + 32 * j + 16 * h), _mm512_cvtsepi32_epi16(iv));
                }
                xs[(b * nb + blk) * 8 + j] = (float)_mm512_reduce_add_epi32(tot) * d;
            }
            xd[b * nb + blk] = d;
        }
#else           /* AVX2 */
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t b = 0; b < B; b++)
        for (int64_t blk = 0; blk < nb; blk++) {
            const float *v = x + b * K + blk * 256;
            int16_t *q = xq + b * K + blk * 256;
            __m256 m = _mm256_setzero_ps();
            for (int i = 0; i < 256; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(v + i), absmask));
            const float d = hmax8(m) / XK_MAX, inv = d > 0 ? 1.0f / d : 0.0f;
            for (int j = 0; j < 8; j++) {
                __m256i iv[4];
                round32(v + 32 * j, inv, XK_MAX, iv);
                _mm256_storeu_si256((__m256i *)(q + 32 * j), _mm256_permute4x64_epi64(
                    _mm256_packs_epi32(iv[0], iv[1]), 0xD8));
                _mm256_storeu_si256((__m256i *)(q + 32 * j + 16), _mm256_permute4x64_epi64(
                    _mm256_packs_epi32(iv[2], iv[3]), 0xD8));
                xs[(b * nb + blk) * 8 + j] = (float)hsum_epi32(_mm256_add_epi32(
                    _mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]))) * d;
            }
            xd[b * nb + blk] = d;
        }
#endif
}

/* One super-block's weights as 16 vectors of 16 int16 (elements 16k..16k+15), each
 * times its integer sub-scale; Q4_K's mins per 32 as floats (mf) and the factors
 * d and -dmin (Q6_K: no offset term, the 32 is taken off the values). The tiles'
 * decoding (dequant_superblock_avx2) reads it; the products take 64 values at a time
 * (k_quad below). */
typedef struct {
    __m256i w[16];
    __m256 mf;
    float d, off_d;
    float m16[16];          /* Q2_K: its mins per 16 times -dmin */
} Super;

/* Q4_K's 12 bytes of 6-bit sub-scales and mins → sc[0..7], m[0..7] (bytes), in 32-bit
 * lanes: sc[j], m[j] for j < 4 are the low 6 bits of bytes j, j + 4; for j >= 4 the
 * low (sc) or high (m) nibble of byte j + 4 carries the low bits and the top 2 bits of
 * bytes j - 4 (sc) or j (m) the high ones. */
static inline void k_scales_fast(const uint8_t *s, uint8_t out[16]) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    const uint32_t six = 0x3F3F3F3Fu, four = 0x0F0F0F0Fu, two = 0x03030303u;
    uint32_t sc_lo = u0 & six, m_lo = u1 & six;
    uint32_t sc_hi = (u2 & four) | (((u0 >> 6) & two) << 4);
    uint32_t m_hi = ((u2 >> 4) & four) | (((u1 >> 6) & two) << 4);
    memcpy(out, &sc_lo, 4);
    memcpy(out + 4, &sc_hi, 4);
    memcpy(out + 8, &m_lo, 4);
    memcpy(out + 12, &m_hi, 4);
}

/* 32 bytes (one run of 32 values, u8) → two vectors of 16 int16, times scales s0, s1. */
static inline void widen_run(__m256i run, __m256i s0, __m256i s1, __m256i off,
                             __m256i *w0, __m256i *w1) {
    __m256i a = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(run)), off);
    __m256i b = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(run, 1)), off);
    *w0 = _mm256_mullo_epi16(a, s0);
    *w1 = _mm256_mullo_epi16(b, s1);
}

static inline void load_super(int code, const uint8_t *restrict b, Super *S) {
    const __m256i low4 = _mm256_set1_epi8(15), zero = _mm256_setzero_si256();
    if (code == Q4K || code == Q5K) {
        uint8_t sm[16];
        S->d = half_to_float(load_u16(b));
        S->off_d = -half_to_float(load_u16(b + 2));
        k_scales_fast(b + 4, sm);
        const int five = code == Q5K;
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), one = _mm256_set1_epi8(1);
        for (int g = 0; g < 4; g++) {         /* group g: runs 2g (low nibbles), 2g + 1 */
            __m256i raw = _mm256_loadu_si256((const __m256i *)(b + (five ? Q5K_QS : 16) + 32 * g));
            __m256i s0 = _mm256_set1_epi16(sm[2 * g]), s1 = _mm256_set1_epi16(sm[2 * g + 1]);
            __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            if (five) {                       /* Q5_K: bits 2g, 2g + 1 of qh[i] are the 16s */
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(
                    _mm256_srli_epi16(qh, 2 * g), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(
                    _mm256_srli_epi16(qh, 2 * g + 1), one), 4));
            }
            widen_run(lo, s0, s0, zero, &S->w[4 * g], &S->w[4 * g + 1]);
            widen_run(hi, s1, s1, zero, &S->w[4 * g + 2], &S->w[4 * g + 3]);
        }
        S->mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8))));
        return;
    }
    S->mf = _mm256_setzero_ps();
    if (code == IQ4XS) {                /* run j: bytes 16j.., low nibbles then high */
        uint8_t ls[8];
        iq4xs_scales(b, ls);
        S->d = half_to_float(load_u16(b));
        S->off_d = 0.0f;
        const __m128i low4 = _mm_set1_epi8(15), lut = _mm_loadu_si128((const __m128i *)IQ4_LEVELS);
        for (int j = 0; j < 8; j++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 8 + 16 * j));
            const __m256i s = _mm256_set1_epi16((int16_t)(ls[j] - 32));
            S->w[2 * j] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(
                _mm_shuffle_epi8(lut, _mm_and_si128(raw, low4))), s);
            S->w[2 * j + 1] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(
                _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), low4))), s);
        }
        return;
    }
    if (code == Q3K || code == Q2K) {   /* run 4h + j of 32 values, a scale per 16 */
        const int three = code == Q3K;
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b), three2 = _mm256_set1_epi8(3);
        const __m256i one = _mm256_set1_epi8(1);
        uint8_t sc[16];
        if (three) q3k_scales(b + 96, sc);
        else memcpy(sc, b, 16);
        S->d = half_to_float(load_u16(b + (three ? 108 : 80)));
        S->off_d = three ? 0.0f : -half_to_float(load_u16(b + 82));
        for (int i = 0; i < 16; i++) S->m16[i] = three ? 0.0f : S->off_d * (float)(sc[i] >> 4);
        for (int h = 0; h < 2; h++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(b + (three ? 32 : 16) + 32 * h));
            for (int j = 0; j < 4; j++) {
                const int r = 4 * h + j;
                __m256i u = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * j), three2);
                if (three)
                    u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(
                        _mm256_srli_epi16(hm, 4 * h + j), one), 2));
                widen_run(u, _mm256_set1_epi16(three ? sc[2 * r] - 32 : sc[2 * r] & 15),
                          _mm256_set1_epi16(three ? sc[2 * r + 1] - 32 : sc[2 * r + 1] & 15),
                          _mm256_set1_epi16(three ? 4 : 0), &S->w[2 * r], &S->w[2 * r + 1]);
            }
        }
        return;
    }
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    S->d = half_to_float(load_u16(b + 208));
    S->off_d = 0.0f;
    const __m256i two = _mm256_set1_epi8(3), off = _mm256_set1_epi16(32);
    for (int h = 0; h < 2; h++) {
        __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
        __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        __m256i bits = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        __m256i runs[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, low4),
                            _mm256_slli_epi16(_mm256_and_si256(bits, two), 4)),
            _mm256_or_si256(_mm256_and_si256(l1, low4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 2), two), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 4), two), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 6), two), 4))};
        for (int k = 0; k < 4; k++) {         /* run 4h + k: scales 8h + 2k, 8h + 2k + 1 */
            const int j = 4 * h + k;
            widen_run(runs[k], _mm256_set1_epi16(sc[2 * j]), _mm256_set1_epi16(sc[2 * j + 1]),
                      off, &S->w[2 * j], &S->w[2 * j + 1]);
        }
    }
}

/* The tile path's decoding: the kernel's widened weights (q * sc) as floats, d * that
 * (- dmin * m for Q4_K): the same values as dequant_superblock. */
static void dequant_superblock_avx2(int code, const uint8_t *restrict b, float *restrict w) {
    Super S;
    load_super(code, b, &S);
    float mins[8];
    _mm256_storeu_ps(mins, _mm256_mul_ps(S.mf, _mm256_set1_ps(S.off_d)));
    const __m256 d = _mm256_set1_ps(S.d);
    for (int k = 0; k < 16; k++) {
        const __m256 m = _mm256_set1_ps(code == Q2K ? S.m16[k] : mins[k / 2]);
        __m256i v = S.w[k];
        __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)));
        __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)));
        _mm256_storeu_ps(w + 16 * k, _mm256_fmadd_ps(lo, d, m));
        _mm256_storeu_ps(w + 16 * k + 8, _mm256_fmadd_ps(hi, d, m));
    }
}


#if defined(PN_ZMM)
/* AVX-512 (VNNI, BW): a super-block's 256 weights widen to 8 vectors of 32 int16 (one
 * sub-block of 32 each), zero-extended straight from memory; each meets 32 int16 of x
 * in one dpwssd. Measured on Zen 4 (one core, a [8960, 1536] matrix in cache, batch 1):
 * Q4_K 8.6 ns per super-block against 11.2 with 256-bit vectors, Q6_K 11.1 against
 * 15.0; the multiply port is the limit (16 ymm-equivalent multiplies per super-block
 * and row of x: the sub-scale and the products). */
typedef struct {
    __m512i w[8];           /* sub-block j: elements 32j .. 32j + 31, times sc[j] */
    __m256 mf;              /* Q4_K: its 8 mins times -dmin, as floats (Q6_K: 0) */
    __m512 mf16;            /* Q2_K: its 16 mins (per 16) times -dmin */
    float d, off_d;
} Super512;

static inline void load_super512(int code, const uint8_t *restrict b, Super512 *S) {
    const __m512i low4 = _mm512_set1_epi16(15);
    if (code == Q4K || code == Q5K) {
        uint8_t sm[16];
        S->d = half_to_float(load_u16(b));
        S->off_d = -half_to_float(load_u16(b + 2));
        k_scales_fast(b + 4, sm);
        const int five = code == Q5K;
        const __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)));
        const __m512i one = _mm512_set1_epi16(1);
        for (int g = 0; g < 4; g++) {   /* bytes 32g..: low nibbles 64g + i, high 64g + 32 + i */
            __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                (const __m256i *)(b + (five ? Q5K_QS : 16) + 32 * g)));
            __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_srli_epi16(raw, 4);
            if (five) {                 /* Q5_K: bits 2g, 2g + 1 of qh[i] are the 16s */
                lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * g), one), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * g + 1), one), 4));
            }
            S->w[2 * g] = _mm512_mullo_epi16(lo, _mm512_set1_epi16(sm[2 * g]));
            S->w[2 * g + 1] = _mm512_mullo_epi16(hi, _mm512_set1_epi16(sm[2 * g + 1]));
        }
        S->mf = _mm256_mul_ps(_mm256_set1_ps(S->off_d), _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8)))));
        return;
    }
    const __m512i half = _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                          0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    S->mf = _mm256_setzero_ps();
    S->mf16 = _mm512_setzero_ps();
    if (code == IQ4XS) {    /* sub-block j: 16 bytes, low nibbles (elements 0..15), high */
        uint8_t ls[8];
        iq4xs_scales(b, ls);
        S->d = half_to_float(load_u16(b));
        S->off_d = 0.0f;
        const __m512i lut = _mm512_cvtepi8_epi16(_mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)IQ4_LEVELS)));
        const __m256i low4w = _mm256_set1_epi16(15);
        for (int j = 0; j < 8; j++) {
            const __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 8 + 16 * j)));
            const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, low4w)),
                                                   _mm256_srli_epi16(raw, 4), 1);
            S->w[j] = _mm512_mullo_epi16(_mm512_permutexvar_epi16(idx, lut),
                                         _mm512_set1_epi16((int16_t)(ls[j] - 32)));
        }
        return;
    }
    if (code == Q3K || code == Q2K) {   /* vector 4h + j: run j of half h, a scale per 16 */
        const int three = code == Q3K;
        uint8_t sc[16];
        if (three) q3k_scales(b + 96, sc);
        else memcpy(sc, b, 16);
        __m512i scw = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)sc)));
        S->d = half_to_float(load_u16(b + (three ? 108 : 80)));
        S->off_d = three ? 0.0f : -half_to_float(load_u16(b + 82));
        if (three) scw = _mm512_sub_epi16(scw, _mm512_set1_epi16(32));
        else {
            S->mf16 = _mm512_mul_ps(_mm512_set1_ps(S->off_d), _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_srli_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)sc),
                                                                  _mm_set1_epi8((char)0xF0)), 4))));
            scw = _mm512_and_si512(scw, _mm512_set1_epi16(15));
        }
        const __m512i hm = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)b));
        const __m512i three2 = _mm512_set1_epi16(3), one = _mm512_set1_epi16(1);
        for (int h = 0; h < 2; h++) {
            const __m512i qv = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                (const __m256i *)(b + (three ? 32 : 16) + 32 * h)));
            for (int j = 0; j < 4; j++) {
                const int r = 4 * h + j;
                __m512i u = _mm512_and_si512(_mm512_srli_epi16(qv, 2 * j), three2);
                if (three)
                    u = _mm512_sub_epi16(_mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(
                        _mm512_srli_epi16(hm, 4 * h + j), one), 2)), _mm512_set1_epi16(4));
                S->w[r] = _mm512_mullo_epi16(u, _mm512_permutexvar_epi16(
                    _mm512_add_epi16(half, _mm512_set1_epi16(2 * r)), scw));
            }
        }
        return;
    }
    const uint8_t *ql = b, *qh = b + 128;
    S->d = half_to_float(load_u16(b + 208));
    S->off_d = 0.0f;
    /* 16 int8 scales as int16; vector j takes sc[2j] (its first 16) and sc[2j + 1] */
    const __m512i scw = _mm512_cvtepi8_epi16(_mm256_castsi128_si256(
        _mm_loadu_si128((const __m128i *)(b + 192))));
    const __m512i two = _mm512_set1_epi16(0x30), off = _mm512_set1_epi16(32);
    for (int h = 0; h < 2; h++) {
        __m512i l0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 64 * h)));
        __m512i l1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32)));
        __m512i bits = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)));
        __m512i r[4] = {        /* elements 128h + 32k + l, l < 32 */
            _mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_and_si512(_mm512_slli_epi16(bits, 4), two)),
            _mm512_or_si512(_mm512_and_si512(l1, low4), _mm512_and_si512(_mm512_slli_epi16(bits, 2), two)),
            _mm512_or_si512(_mm512_srli_epi16(l0, 4), _mm512_and_si512(bits, two)),
            _mm512_or_si512(_mm512_srli_epi16(l1, 4), _mm512_and_si512(_mm512_srli_epi16(bits, 2), two))};
        for (int k = 0; k < 4; k++) {
            const int j = 4 * h + k;
            __m512i s = _mm512_permutexvar_epi16(_mm512_add_epi16(half, _mm512_set1_epi16(2 * j)), scw);
            S->w[j] = _mm512_mullo_epi16(_mm512_sub_epi16(r[k], off), s);
        }
    }
}

#endif
#else
void pn_quantize_xk(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd,
                    float *xs) {}
#endif
