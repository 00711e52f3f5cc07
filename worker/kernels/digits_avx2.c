/* digits_avx2.c: batch-1 Q4_K / Q5_K / Q6_K on 256-bit vectors (AVX2 builds without
 * AVX-512): x's int16 steps as two int8 digits meeting the weights' bytes in vpmaddubsw,
 * the same integer sums as the int16 row kernels with no widening (Qwen2.5-1.5B Q4_K_M
 * batch-1 decode 1.27x, alternated). */
#if defined(__AVX2__) && !defined(PN_ZMM)
/* -- Q4_K and Q5_K at batch 1 on 256-bit vectors (AVX2 hosts): x's int16 steps q (|q| <=
 * 16000, pn_quantize_xk) as two int8 digits, q = 128 h + l (h in -125 .. 124, l in
 * 0 .. 127), which meet the weights' bytes (0 .. 15, Q5_K 0 .. 31) in `vpmaddubsw`; the
 * two digits' pair sums (at most 2 x 31 x 127) take the sub-scale (times 128 for h) in
 * `vpmaddwd`. The same integer sums as the int16 row kernel (k_row_avx2) without its
 * widening: no byte is unpacked to int16, no sub-scale multiplied into the weights, so
 * a super-block costs 16 multiplies, 8 loads of x and no lane shuffles. Each int32 lane
 * sums 32 values per super-block (32 x 31 x 63 x 16000 < 2^31). */
static __thread int8_t *dg2_buf;
static __thread int64_t dg2_cap;

/* int16 steps → digits: hi[i] = q >> 7, lo[i] = q & 127 (K a multiple of 16) */
static void split_digits(const int16_t *q, int64_t K, int8_t *hi, int8_t *lo) {
    const __m256i low7 = _mm256_set1_epi16(127);
    for (int64_t i = 0; i < K; i += 16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + i));
        const __m256i h = _mm256_srai_epi16(v, 7), l = _mm256_and_si256(v, low7);
        _mm_storeu_si128((__m128i *)(hi + i), _mm_packs_epi16(_mm256_castsi256_si128(h),
                                                             _mm256_extracti128_si256(h, 1)));
        _mm_storeu_si128((__m128i *)(lo + i), _mm_packs_epi16(_mm256_castsi256_si128(l),
                                                             _mm256_extracti128_si256(l, 1)));
    }
}

typedef struct {
    int code; const uint8_t *qs; int64_t N, K; const int8_t *xh, *xl; const float *xd, *xs;
    float *out; int64_t rows;
} Dg2Args;

/* w's 32 values (u8) against 32 digits of x, all under one int16 scale (in every lane of sl) */
static inline __m256i digit_pair(__m256i w, const int8_t *xh, const int8_t *xl, __m256i sl) {
    const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)xh)),
                                        _mm256_slli_epi16(sl, 7));
    const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)xl)), sl);
    return _mm256_add_epi32(a, b);
}

/* scale j of S (8 int16 scales in each lane) in every lane: one byte shuffle */
static inline __m256i one_scale(__m256i S, int j) {
    return _mm256_shuffle_epi8(S, _mm256_set1_epi16((int16_t)((2 * j) | ((2 * j + 1) << 8))));
}

/* A Q4_K (Q5_K) super-block's values 64t .. 64t + 31 (lo) and 64t + 32 .. + 63 (hi) as
 * bytes 0 .. 15 (0 .. 31): low and high nibbles of bytes 32t.., Q5_K's 16s from bits
 * 2t, 2t + 1 of qh */
static inline void k45_values(const uint8_t *b, int five, __m256i qh, int t, __m256i *lo,
                              __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + (five ? Q5K_QS : 16) + 32 * t));
    *lo = _mm256_and_si256(raw, low4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
    if (five) {
        *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), one), 4));
        *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t + 1), one), 4));
    }
}

/* A Q6_K super-block's values 64t .. 64t + 31 (r0) and 64t + 32 .. + 63 (r1) as bytes
 * 0 .. 63 (the file's -32 not taken off): quad t = 2h + up of the half h (low nibbles of
 * ql for up 0, high for 1, two bits each of qh) */
static inline void q6k_values(const uint8_t *b, int t, __m256i *r0, __m256i *r1) {
    const __m256i low4 = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
    const int h = t / 2, up = t % 2;
    const __m256i q0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
    const __m256i q1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
    const __m256i qb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    const __m256i l0 = up ? _mm256_srli_epi16(q0, 4) : q0;
    const __m256i l1 = up ? _mm256_srli_epi16(q1, 4) : q1;
    const __m256i bits = up ? _mm256_srli_epi16(qb, 4) : qb;
    *r0 = _mm256_or_si256(_mm256_and_si256(l0, low4),
                          _mm256_slli_epi16(_mm256_and_si256(bits, two), 4));
    *r1 = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_slli_epi16(
        _mm256_and_si256(_mm256_srli_epi16(bits, 2), two), 4));
}

static void k45_digits2_chunk(const void *p, int64_t c) {
    const Dg2Args *a = p;
    const int64_t nb = a->K / 256, bytes = k_bytes(a->code);
    const int64_t n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    const int five = a->code == Q5K;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->qs + n * nb * bytes;
        __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * bytes;
            for (int64_t l = 0; l < bytes; l += 64)
                _mm_prefetch((const char *)b + PF_AHEAD + l, _MM_HINT_T0);
            uint8_t sm[16];
            k_scales_fast(b + 4, sm);
            const __m256 mf = _mm256_mul_ps(_mm256_set1_ps(-half_to_float(load_u16(b + 2))),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8)))));
            const int8_t *xh = a->xh + blk * 256, *xl = a->xl + blk * 256;
            const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
            const __m256i S = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sm)));
            __m256i ci = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {   /* bytes 32t..: low nibbles 64t + i, high 64t + 32 + i */
                __m256i lo, hi;
                k45_values(b, five, qh, t, &lo, &hi);
                ci = _mm256_add_epi32(ci, _mm256_add_epi32(
                    digit_pair(lo, xh + 64 * t, xl + 64 * t, one_scale(S, 2 * t)),
                    digit_pair(hi, xh + 64 * t + 32, xl + 64 * t + 32, one_scale(S, 2 * t + 1))));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ci), _mm256_set1_ps(half_to_float(load_u16(b)) * a->xd[blk]), acc);
            accm = _mm256_fmadd_ps(mf, _mm256_loadu_ps(a->xs + blk * 8), accm);
        }
        a->out[n] = hsum(_mm256_add_ps(acc, accm));
    }
}

/* Q6_K at batch 1 the same way: its 6-bit values (0 .. 63, the -32 not taken off) meet
 * the digits in `vpmaddubsw` (pairs at most 2 x 63 x 125), each run of 16 its int8
 * scale (times 128 for h) in `vpmaddwd`; the file's -32 comes off once per run through
 * x's sums per 16 (xs16: -32 times the run's sum, as a float). Each half of the
 * super-block's int32 sums is flushed to floats on its own: a lane then sums 16 values
 * (16 x 63 x 128 x 16000 < 2^31). */
static __thread float *xs16_dg;
static __thread int64_t xs16_dg_cap;

typedef struct {
    const uint8_t *qs; int64_t N, K; const int8_t *xh, *xl; const float *xd, *xs16;
    float *out; int64_t rows;
} Dg6Args;

/* vector v (values 32v ..) of a Q6_K super-block wants scales 2v (its first 16) and 2v + 1:
 * from S (the 16 scales as int16, both lanes holding scales 8 (v / 4) .. + 7), one byte
 * shuffle picks element 2v % 8 for the low lane and 2v % 8 + 1 for the high one */
static inline __m256i run_scales(__m256i S, int v) {
    const int e0 = (2 * v) & 7, e1 = e0 + 1;
    const __m256i ctrl = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_set1_epi16((int16_t)((2 * e0) | ((2 * e0 + 1) << 8)))),
        _mm_set1_epi16((int16_t)((2 * e1) | ((2 * e1 + 1) << 8))), 1);
    return _mm256_shuffle_epi8(S, ctrl);
}

static void q6k_digits2_chunk(const void *p, int64_t c) {
    const Dg6Args *a = p;
    const int64_t nb = a->K / 256;
    const int64_t n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->qs + n * nb * Q6K_BYTES;
        __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * Q6K_BYTES;
            for (int64_t l = 0; l < Q6K_BYTES; l += 64)
                _mm_prefetch((const char *)b + PF_AHEAD + l, _MM_HINT_T0);
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = half_to_float(load_u16(b + 208));
            const int8_t *xh = a->xh + blk * 256, *xl = a->xl + blk * 256;
            const __m128i s8 = _mm_loadu_si128((const __m128i *)sc);
            const __m256i S16 = _mm256_cvtepi8_epi16(s8);
            const __m256i Sh[2] = {_mm256_permute2x128_si256(S16, S16, 0x00),
                                   _mm256_permute2x128_si256(S16, S16, 0x11)};
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {   /* values 128h..: quads t = 2h (low nibbles), 2h + 1 */
                __m256i ci = _mm256_setzero_si256();
#pragma GCC unroll 2
                for (int up = 0; up < 2; up++) {
                    const int t = 2 * h + up;
                    __m256i r0, r1;
                    q6k_values(b, t, &r0, &r1);
                    ci = _mm256_add_epi32(ci, _mm256_add_epi32(
                        digit_pair(r0, xh + 64 * t, xl + 64 * t, run_scales(Sh[h], 2 * t)),
                        digit_pair(r1, xh + 64 * t + 32, xl + 64 * t + 32, run_scales(Sh[h], 2 * t + 1))));
                }
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ci), _mm256_set1_ps(d * a->xd[blk]), acc);
            }
            const __m256 dv = _mm256_set1_ps(d);
            accm = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), dv),
                                   _mm256_loadu_ps(a->xs16 + blk * 16), accm);
            accm = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), dv),
                                   _mm256_loadu_ps(a->xs16 + blk * 16 + 8), accm);
        }
        a->out[n] = hsum(_mm256_add_ps(acc, accm));
    }
}

static int q6k_digits2(const PnMat *m, const float *x, const PnScratch *s, float *out) {
    const int64_t K = m->K;
    if (2 * K > dg2_cap) {
        int8_t *nbuf = aligned_alloc(64, (size_t)(2 * K + 63) / 64 * 64);
        if (!nbuf) return 0;
        free(dg2_buf), dg2_buf = nbuf, dg2_cap = 2 * K;
    }
    if (K / 16 > xs16_dg_cap) {
        float *nbuf = aligned_alloc(64, (size_t)(K / 16 + 15) / 16 * 16 * sizeof(float));
        if (!nbuf) return 0;
        free(xs16_dg), xs16_dg = nbuf, xs16_dg_cap = K / 16;
    }
    pn_quantize_xk(x, 1, K, s->xq, s->xd, s->xs);
    split_digits(s->xq, K, dg2_buf, dg2_buf + K);
    for (int64_t r = 0; r < K / 16; r++) {          /* -32 x each run's sum, in x's steps */
        int32_t t = 0;
        for (int i = 0; i < 16; i++) t += s->xq[16 * r + i];
        xs16_dg[r] = -32.0f * (float)t * s->xd[r / 16];
    }
    Dg6Args a = {m->qs, m->N, K, dg2_buf, dg2_buf + K, s->xd, xs16_dg, out, piece_rows(m->N)};
    pool_run(q6k_digits2_chunk, &a, (m->N + a.rows - 1) / a.rows);
    return 1;
}

/* Q4_K / Q5_K at batch 1 through the digits; 0 where the buffer cannot be had */
static int k45_digits2(const PnMat *m, const float *x, const PnScratch *s, float *out) {
    if (2 * m->K > dg2_cap) {
        int8_t *nbuf = aligned_alloc(64, (size_t)(2 * m->K + 63) / 64 * 64);
        if (!nbuf) return 0;
        free(dg2_buf), dg2_buf = nbuf, dg2_cap = 2 * m->K;
    }
    pn_quantize_xk(x, 1, m->K, s->xq, s->xd, s->xs);
    split_digits(s->xq, m->K, dg2_buf, dg2_buf + m->K);
    Dg2Args a = {m->code, m->qs, m->N, m->K, dg2_buf, dg2_buf + m->K, s->xd, s->xs, out,
                 piece_rows(m->N)};
    pool_run(k45_digits2_chunk, &a, (m->N + a.rows - 1) / a.rows);
    return 1;
}
#endif
