/* formats.c: each format's layout and its portable decoding to floats — a block of 32
 * (dequant_block), a K-quant or IQ4_XS super-block of 256 (dequant_superblock), a row —
 * and the fp32 row loops of pn_gemv (gemv_rows). Every faster path agrees with these to
 * the activations' rounding; they serve the kinds and shapes no integer product takes,
 * the tiles of dequantized floats (floats.c) and the embedding gather. */
/* The `bs` weights of block `blk` of row `n`, as floats. */
static inline void dequant_block(int code, const uint8_t *restrict qs,
                                 const uint16_t *restrict sc, const uint16_t *restrict mn,
                                 int64_t K, int64_t bs, int64_t n, int64_t blk,
                                 float *restrict w) {
    int64_t nb = K / bs;
#if defined(__AVX2__)
    if (code == Q4) {                   /* 8 weights per step: widen, convert, scale */
        const uint8_t *q = qs + n * (K / 2) + blk * 16;
        __m256 s = _mm256_set1_ps(half_to_float(sc[n * nb + blk]));
        __m256 m = _mm256_set1_ps(half_to_float(mn[n * nb + blk]));
        __m128i raw = _mm_loadu_si128((const __m128i *)q), low4 = _mm_set1_epi8(15);
        __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
        __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int j = 0; j < 4; j++) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
            _mm256_storeu_ps(w + 8 * j, _mm256_fmadd_ps(v, s, m));
        }
        return;
    }
    if (code == IQ4NL) {                /* the levels looked up 16 at a time */
        const uint8_t *q = qs + n * (K / 2) + blk * 16;
        __m256 s = _mm256_set1_ps(half_to_float(sc[n * nb + blk]));
        __m128i raw = _mm_loadu_si128((const __m128i *)q), low4 = _mm_set1_epi8(15);
        __m128i lut = _mm_loadu_si128((const __m128i *)IQ4_LEVELS);
        __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(raw, low4));
        __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(w + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[j])), s));
        return;
    }
    if (code == Q8 || code == Q8M) {
        const int8_t *q = (const int8_t *)qs + n * K + blk * bs;
        __m256 s = _mm256_set1_ps(half_to_float(sc[n * nb + blk]));
        __m256 m = _mm256_set1_ps(code == Q8M ? half_to_float(mn[n * nb + blk]) : 0.0f);
        for (int j = 0; j < bs; j += 8) {
            __m128i b8 = _mm_loadl_epi64((const __m128i *)(q + j));
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8));
            _mm256_storeu_ps(w + j, _mm256_fmadd_ps(v, s, m));
        }
        return;
    }
#endif
    if (code == Q4) {
        const uint8_t *q = qs + n * (K / 2) + blk * 16;
        float s = half_to_float(sc[n * nb + blk]), m = half_to_float(mn[n * nb + blk]);
        for (int i = 0; i < 16; i++) {
            w[i] = (float)(q[i] & 15) * s + m;
            w[i + 16] = (float)(q[i] >> 4) * s + m;
        }
    } else if (code == IQ4NL) {
        const uint8_t *q = qs + n * (K / 2) + blk * 16;
        float s = half_to_float(sc[n * nb + blk]);
        for (int i = 0; i < 16; i++) {
            w[i] = s * (float)IQ4_LEVELS[q[i] & 15];
            w[i + 16] = s * (float)IQ4_LEVELS[q[i] >> 4];
        }
    } else if (code == Q8 || code == Q8M) {
        const int8_t *q = (const int8_t *)qs + n * K + blk * bs;
        float s = half_to_float(sc[n * nb + blk]);
        float m = code == Q8M ? half_to_float(mn[n * nb + blk]) : 0.0f;
        for (int i = 0; i < bs; i++) w[i] = (float)q[i] * s + m;
    } else if (code == F16) {
        const uint16_t *q = (const uint16_t *)qs + n * K + blk * bs;
        for (int i = 0; i < bs; i++) w[i] = half_to_float(q[i]);
    } else {
        const uint16_t *q = (const uint16_t *)qs + n * K + blk * bs;
        for (int i = 0; i < bs; i++) {
            uint32_t bits = (uint32_t)q[i] << 16;
            memcpy(&w[i], &bits, 4);
        }
    }
}

/* -- K-quant super-blocks kept as the file stores them (kinds q2k .. q6k) -------------
 * A row is K / 256 blocks of 84 (Q2_K), 110 (Q3_K), 144 (Q4_K), 176 (Q5_K) or 210 (Q6_K)
 * bytes, ggml's layout:
 *   Q4_K: d, dmin (fp16), 12 bytes of 6-bit sub-scales and mins (8 each), 128 bytes of
 *         nibbles: byte 32g + i holds element 64g + i (low) and 64g + 32 + i (high).
 *         w = d * sc[j] * q - dmin * m[j], j = element / 32.
 *   Q5_K: Q4_K's 16 bytes of d, dmin, sub-scales and mins, then 32 bytes of high bits qh,
 *         then Q4_K's 128 bytes of nibbles: element 64g + i (low nibble) takes bit 2g of
 *         qh[i] as its 16, 64g + 32 + i (high nibble) bit 2g + 1; q in 0 .. 31, w as Q4_K.
 *   Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (fp16):
 *         per half h of 128, l < 32: element 128h + l is lo4(ql[64h + l]) | bits 0-1 of
 *         qh[32h + l] << 4, + 32: lo4(ql[64h + 32 + l]) | bits 2-3, + 64: hi4(ql[64h + l])
 *         | bits 4-5, + 96: hi4(ql[64h + 32 + l]) | bits 6-7. w = d * sc[e / 16] * (q - 32).
 *   Q3_K: 32 bytes hmask, 64 of 2-bit values, 12 of 6-bit scales (q3k_scales), d (fp16):
 *         element 128h + 32j + l (j < 4, l < 32) is bits 2j, 2j + 1 of qs[32h + l] with
 *         bit 4h + j of hmask[l] as its 4; w = d * (sc[e / 16] - 32) * (q - 4).
 *   Q2_K: 16 bytes of 4-bit scale (low) and min (high) per 16 values, 64 of 2-bit values
 *         (Q3_K's order), d, dmin (fp16): w = d * sc[e / 16] * q - dmin * m[e / 16].
 *   IQ4_XS: d (fp16), 2 bytes of high scale bits, 4 of low ones (iq4xs_scales), then 8
 *         runs of 16 bytes: byte 16j + i holds element 32j + i (low nibble) and
 *         32j + 16 + i (high); w = d * (sc[j] - 32) * IQ4_LEVELS[nibble]. */
#define Q2K_BYTES 84
#define IQ4XS_BYTES 136
#define Q3K_BYTES 110
#define Q4K_BYTES 144
#define Q5K_BYTES 176
#define Q6K_BYTES 210
#define Q5K_QS 48           /* Q5_K: offset of the nibbles (after d, dmin, scales, qh) */

static inline void k_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* IQ4_XS's 8 sub-block scales, 6 bits each (the -32 not taken off): sub-block j's low 4
 * bits are nibble j % 2 of byte 4 + j / 2, its top 2 bits bits 2j, 2j + 1 of the uint16
 * at byte 2. */
static inline void iq4xs_scales(const uint8_t *b, uint8_t out[8]) {
    const uint16_t h = load_u16(b + 2);
    for (int j = 0; j < 8; j++)
        out[j] = (uint8_t)(((b[4 + j / 2] >> (4 * (j & 1))) & 15) | (((h >> (2 * j)) & 3) << 4));
}

/* Q3_K's 12 bytes → its 16 6-bit scales (before the -32): scales i, 4 + i are the low
 * nibbles of bytes i, 4 + i, scales 8 + i, 12 + i their high nibbles; bits 0-1, 2-3,
 * 4-5, 6-7 of byte 8 + i are the top two bits of each. */
static inline void q3k_scales(const uint8_t *s, uint8_t out[16]) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    const uint32_t four = 0x0F0F0F0Fu, two = 0x03030303u;
    const uint32_t v[4] = {(u0 & four) | ((u2 & two) << 4), (u1 & four) | (((u2 >> 2) & two) << 4),
                           ((u0 >> 4) & four) | (((u2 >> 4) & two) << 4),
                           ((u1 >> 4) & four) | (((u2 >> 6) & two) << 4)};
    memcpy(out, v, 16);
}

#if !defined(__AVX2__)
/* 256 weights of one super-block as floats (the portable decoding). */
static void dequant_superblock(int code, const uint8_t *restrict b, float *restrict w) {
    if (code == IQ4XS) {
        const float d = half_to_float(load_u16(b));
        uint8_t ls[8];
        iq4xs_scales(b, ls);
        for (int j = 0; j < 8; j++) {
            const float s = d * (float)((int)ls[j] - 32);
            const uint8_t *q = b + 8 + 16 * j;
            for (int i = 0; i < 16; i++) {
                w[32 * j + i] = s * (float)IQ4_LEVELS[q[i] & 15];
                w[32 * j + 16 + i] = s * (float)IQ4_LEVELS[q[i] >> 4];
            }
        }
        return;
    }
    if (code == Q4K || code == Q5K) {
        float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
        uint8_t sc[8], mn[8];
        k_scales(b + 4, sc, mn);
        const uint8_t *q = b + (code == Q5K ? Q5K_QS : 16), *qh = b + 16;
        const int five = code == Q5K;
        for (int g = 0; g < 4; g++) {
            float s0 = d * sc[2 * g], m0 = dmin * mn[2 * g];
            float s1 = d * sc[2 * g + 1], m1 = dmin * mn[2 * g + 1];
            for (int i = 0; i < 32; i++) {
                const int h0 = five ? ((qh[i] >> (2 * g)) & 1) << 4 : 0;
                const int h1 = five ? ((qh[i] >> (2 * g + 1)) & 1) << 4 : 0;
                w[64 * g + i] = s0 * (float)((q[32 * g + i] & 15) | h0) - m0;
                w[64 * g + 32 + i] = s1 * (float)((q[32 * g + i] >> 4) | h1) - m1;
            }
        }
        return;
    }
    if (code == Q3K || code == Q2K) {
        const int three = code == Q3K;
        const uint8_t *qs = b + (three ? 32 : 16);
        uint8_t sc[16];
        if (three) q3k_scales(b + 96, sc);
        else memcpy(sc, b, 16);
        const float d = half_to_float(load_u16(b + (three ? 108 : 80)));
        const float dmin = three ? 0.0f : half_to_float(load_u16(b + 82));
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    const int e = 128 * h + 32 * j + l, u = (qs[32 * h + l] >> (2 * j)) & 3;
                    w[e] = three ? d * (float)((int)sc[e / 16] - 32)
                                     * (float)((u | (((b[l] >> (4 * h + j)) & 1) << 2)) - 4)
                                 : d * (float)(sc[e / 16] & 15) * (float)u - dmin * (float)(sc[e / 16] >> 4);
                }
        return;
    }
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = half_to_float(load_u16(b + 208));
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t lo = ql[64 * h + l], hi = ql[64 * h + 32 + l], bits = qh[32 * h + l];
            const int e = 128 * h + l;
            w[e] = d * sc[e / 16] * (float)(((lo & 15) | ((bits & 3) << 4)) - 32);
            w[e + 32] = d * sc[(e + 32) / 16] * (float)(((hi & 15) | (((bits >> 2) & 3) << 4)) - 32);
            w[e + 64] = d * sc[(e + 64) / 16] * (float)(((lo >> 4) | (((bits >> 4) & 3) << 4)) - 32);
            w[e + 96] = d * sc[(e + 96) / 16] * (float)(((hi >> 4) | (((bits >> 6) & 3) << 4)) - 32);
        }
}
#endif

/* super-blocks of 256 read as the file has them */
static inline int is_k(int code) { return (code >= Q4K && code <= Q2K) || code == IQ4XS; }
static inline int64_t k_bytes(int code) {
    return code == Q4K ? Q4K_BYTES : code == Q5K ? Q5K_BYTES : code == Q6K ? Q6K_BYTES
         : code == Q3K ? Q3K_BYTES : code == IQ4XS ? IQ4XS_BYTES : Q2K_BYTES;
}
/* x's sums per super-block that the mins meet: per 32 (8), Q2_K's per 16 (16) */
static inline int64_t xs_per(int code) { return code == Q2K ? 16 : 8; }

#if defined(__AVX2__)
static void dequant_superblock_avx2(int code, const uint8_t *restrict b, float *restrict w);
#endif

/* Row r of a K-quant matrix as K floats. */
static void dequant_k_row(int code, const uint8_t *qs, int64_t K, int64_t r, float *out) {
    const int64_t nb = K / 256, bytes = k_bytes(code);
    for (int64_t blk = 0; blk < nb; blk++)
#if defined(__AVX2__)
        dequant_superblock_avx2(code, qs + (r * nb + blk) * bytes, out + blk * 256);
#else
        dequant_superblock(code, qs + (r * nb + blk) * bytes, out + blk * 256);
#endif
}

/* Float kinds have no blocks of their own: they are walked in runs of 32. */
static inline int64_t block_of(int code, int64_t bs) {
    return (code == F16 || code == BF16) ? 32 : bs;
}

/* One batch of up to MAXB rows of x against rows [n0, n1) of W. */
static void gemv_rows(int code, const uint8_t *restrict qs, const uint16_t *restrict sc,
                      const uint16_t *restrict mn, int64_t K, int64_t bs, int64_t N,
                      const float *restrict x, int64_t B, float *restrict out,
                      int64_t n0, int64_t n1) {
    int64_t run = block_of(code, bs), nb = K / run;
    float w[32];
    float acc[MAXB][32];
    for (int64_t n = n0; n < n1; n++) {
        memset(acc, 0, sizeof(float) * 32 * B);
        for (int64_t blk = 0; blk < nb; blk++) {
            dequant_block(code, qs, sc, mn, K, run, n, blk, w);
            if (run == 32) {
                for (int64_t b = 0; b < B; b++) {
                    const float *xb = x + b * K + blk * 32;
                    for (int i = 0; i < 32; i++) acc[b][i] += w[i] * xb[i];
                }
            } else {
                for (int64_t b = 0; b < B; b++) {
                    const float *xb = x + b * K + blk * 16;
                    for (int i = 0; i < 16; i++) acc[b][i] += w[i] * xb[i];
                }
            }
        }
        for (int64_t b = 0; b < B; b++) {
            float t = 0.0f;
            for (int i = 0; i < 32; i++) t += acc[b][i];
            out[b * N + n] = t;
        }
    }
}

/* A specialised B = 1 pass: the accumulators stay in registers. */
static void gemv1_rows(int code, const uint8_t *restrict qs, const uint16_t *restrict sc,
                       const uint16_t *restrict mn, int64_t K, int64_t bs, int64_t N,
                       const float *restrict x, float *restrict out, int64_t n0, int64_t n1) {
    int64_t run = block_of(code, bs), nb = K / run;
    float w[32];
    for (int64_t n = n0; n < n1; n++) {
        float acc[32] = {0};
        for (int64_t blk = 0; blk < nb; blk++) {
            dequant_block(code, qs, sc, mn, K, run, n, blk, w);
            const float *xb = x + blk * run;
            if (run == 32) {
                for (int i = 0; i < 32; i++) acc[i] += w[i] * xb[i];
            } else {
                for (int i = 0; i < 16; i++) acc[i] += w[i] * xb[i];
            }
        }
        float t = 0.0f;
        for (int i = 0; i < 32; i++) t += acc[i];
        out[n] = t;
    }
}
