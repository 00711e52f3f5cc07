/* digits.c: batch-1 K-quants with AVX-512 VNNI (PN_ZMM): each int16 activation as two
 * int8 digits meeting the weights' bytes in vpdpbusd — the int16 path's integer sums in
 * fewer multiplies (Qwen2.5-1.5B batch-1 decode +6-7 %, Q6_K a further +3 %). */
#if defined(PN_ZMM)
/* -- Q4_K at batch 1 with int8 products: each int16 activation q is two int8 digits,
 * q = 256 h + l (l in [-128, 127], h in [-63, 63]), so `vpdpbusd` (unsigned nibbles times
 * signed digits, 64 products an instruction) gives the same integer sums as the int16
 * path in half the widening work: per super-block 8 dpbusd and 4 int32 sub-scale
 * multiplies against 8 mullw and 8 dpwssd. The nibbles stay bytes: a 64-byte load holds
 * two groups, whose low nibbles are sub-blocks 2g and 2g + 2 in the vector's two halves,
 * so the digits are stored per super-block in the order 0-31, 64-95, 32-63, 96-127,
 * 128-159, 192-223, 160-191, 224-255 (high digits first, then low: 2 x 256 bytes). */
static const int DIGIT_ORDER[8] = {0, 2, 1, 3, 4, 6, 5, 7};   /* 32-chunks of a super-block */

static const int NATURAL_ORDER[8] = {0, 1, 2, 3, 4, 5, 6, 7};    /* Q6_K's */

/* x [1, K] → digits (per super-block: 256 high, then 256 low, 32-chunks in `order`), xd,
 * xs as pn_quantize_xk; sums16 (if not NULL): each 16 values' int16 sum (Q6_K's -32). */
static void quantize_digits(const float *x, int64_t K, int8_t *dg, float *xd, float *xs,
                            const int *order, int32_t *sums16) {
    const int64_t nb = K / 256;
    int16_t q[256];
    for (int64_t blk = 0; blk < nb; blk++) {
        pn_quantize_xk(x + blk * 256, 1, 256, q, xd + blk, xs + blk * 8);
        if (sums16)
            for (int j = 0; j < 16; j++)
                sums16[blk * 16 + j] = _mm512_reduce_add_epi32(
                    _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(q + 16 * j))));
        int8_t *hi = dg + blk * 512, *lo = hi + 256;
        for (int c = 0; c < 8; c++) {
            const __m512i v = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(q + 32 * order[c])));
            const __m512i v2 = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(q + 32 * order[c] + 16)));
            for (int h = 0; h < 2; h++) {
                const __m512i w = h ? v2 : v;
                /* l = ((q + 128) & 255) - 128, h = (q - l) >> 8 */
                const __m512i l = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(w, _mm512_set1_epi32(128)),
                                                                    _mm512_set1_epi32(255)), _mm512_set1_epi32(128));
                const __m512i hh = _mm512_srai_epi32(_mm512_sub_epi32(w, l), 8);
                _mm_storeu_si128((__m128i *)(lo + 32 * c + 16 * h), _mm512_cvtepi32_epi8(l));
                _mm_storeu_si128((__m128i *)(hi + 32 * c + 16 * h), _mm512_cvtepi32_epi8(hh));
            }
        }
    }
}

typedef struct {
    const uint8_t *qs; int64_t N, K; const int8_t *dg; const float *xd, *xs; float *out;
    int64_t rows; const int32_t *s16;
} DgArgs;

/* The int sums of 64 byte values v (4 a lane) against one group's digits, times each
 * lane's sub-scale: (256 v.hi + v.lo) * scale (the batch-1 digit kernels' one step) */
static inline __m512i digits_dot(__m512i v, const int8_t *hi, const int8_t *lo, __m512i scale) {
    const __m512i t = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), v,
        _mm512_loadu_si512((const void *)hi)), 8);
    return _mm512_mullo_epi32(_mm512_dpbusd_epi32(t, v, _mm512_loadu_si512((const void *)lo)), scale);
}

/* Q4_K (five = 0) or Q5_K (five = 1: each nibble takes its bit of qh as its 16, so the
 * values are 0 .. 31, still bytes, and the same digits meet them) */
static inline __attribute__((always_inline)) void k45_digits_rows(const DgArgs *a, int64_t c,
                                                                 const int five) {
    const int64_t bytes = five ? Q5K_BYTES : Q4K_BYTES, qs_at = five ? Q5K_QS : 16;
    const int64_t nb = a->K / 256, n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    const __m512i low4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    /* Q5_K: the 64 bytes at 64 g hold groups 2g, 2g + 1 in their halves, whose low
     * nibbles take bits 4g, 4g + 2 of qh (a shift per 16-bit lane), the high ones + 1 */
    const __m512i halves = _mm512_set_epi64(0x0002000200020002LL, 0x0002000200020002LL,
                                            0x0002000200020002LL, 0x0002000200020002LL, 0, 0, 0, 0);
    /* lanes 0-7 take sub-scale j0, lanes 8-15 j1, for the vectors of sub-blocks (0,2) (1,3) (4,6) (5,7) */
    const __m512i pick[4] = {
        _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4),
        _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5)};
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->qs + n * nb * bytes;
        __m512 acc = _mm512_setzero_ps();
        __m256 accm = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * bytes;
            for (int64_t l = 0; l < bytes; l += 64)
                _mm_prefetch((const char *)b + PF_AHEAD + l, _MM_HINT_T0);
            uint8_t sm[16];
            k_scales_fast(b + 4, sm);
            const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sm)));
            const int8_t *hi = a->dg + blk * 512, *lo = hi + 256;
            __m512i tot = _mm512_setzero_si512();
            const __m512i qh = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)))
                                    : _mm512_setzero_si512();
            for (int g = 0; g < 2; g++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(b + qs_at + 64 * g));
                __m512i v[2] = {_mm512_and_si512(raw, low4),
                                _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4)};
                if (five)
                    for (int k = 0; k < 2; k++)
                        v[k] = _mm512_or_si512(v[k], _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(
                            qh, _mm512_add_epi16(halves, _mm512_set1_epi16(4 * g + k))), one), 4));
                for (int k = 0; k < 2; k++) {
                    const int c = 2 * g + k;          /* 64 digits at 64 c */
                    tot = _mm512_add_epi32(tot, digits_dot(v[k], hi + 64 * c, lo + 64 * c,
                                                           _mm512_permutexvar_epi32(pick[c], sc)));
                }
            }
            const float d = half_to_float(load_u16(b)) * a->xd[blk];
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_set1_ps(d), acc);
            const __m256 mf = _mm256_mul_ps(_mm256_set1_ps(-half_to_float(load_u16(b + 2))), _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8)))));
            accm = _mm256_fmadd_ps(mf, _mm256_loadu_ps(a->xs + blk * 8), accm);
        }
        a->out[n] = _mm512_reduce_add_ps(acc) + hsum(accm);
    }
}

static void q4k_digits_chunk(const void *p, int64_t c) { k45_digits_rows(p, c, 0); }
static void q5k_digits_chunk(const void *p, int64_t c) { k45_digits_rows(p, c, 1); }

/* Scales per 16 values against the int32 lanes of a vpdpbusd over 64 values (4 a lane):
 * lane i of the 64 values at 64 c takes sub-scale 4 c + i / 4. */
static inline void per16_picks(__m512i pick[4]) {
    for (int k = 0; k < 4; k++)
        pick[k] = _mm512_add_epi32(_mm512_set1_epi32(4 * k), _mm512_srli_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2));
}

/* Q6_K at batch 1 with int8 products: the 6-bit values (0 .. 63, still bytes) meet the
 * digits in `vpdpbusd`; the file's -32 offset is taken off once per 16 values through
 * the activations' sums (sum (q - 32) x = sum q x - 32 sum x). The two halves of a
 * super-block accumulate apart (their int32 sums stay below 2^30). */
static void q6k_digits_chunk(const void *p, int64_t c) {
    const DgArgs *a = p;
    const int64_t nb = a->K / 256, n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    const __m512i low4 = _mm512_set1_epi8(15), low2 = _mm512_set1_epi8(3);
    const __m512i shiftA = _mm512_set_epi64(0x0002000200020002LL, 0x0002000200020002LL, 0x0002000200020002LL,
                                            0x0002000200020002LL, 0, 0, 0, 0);
    const __m512i shiftB = _mm512_add_epi16(shiftA, _mm512_set1_epi16(4));
    __m512i pick[4];
    per16_picks(pick);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->qs + n * nb * Q6K_BYTES;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * Q6K_BYTES;
            for (int64_t l = 0; l < Q6K_BYTES; l += 64)
                _mm_prefetch((const char *)b + PF_AHEAD + l, _MM_HINT_T0);
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)));
            const int8_t *hi = a->dg + blk * 512, *lo = hi + 256;
            __m512i tot[2];
            for (int h = 0; h < 2; h++) {
                const __m512i L = _mm512_loadu_si512((const void *)(b + 64 * h));
                const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
                const __m512i q[2] = {
                    _mm512_or_si512(_mm512_and_si512(L, low4), _mm512_slli_epi16(
                        _mm512_and_si512(_mm512_srlv_epi16(H, shiftA), low2), 4)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), low4), _mm512_slli_epi16(
                        _mm512_and_si512(_mm512_srlv_epi16(H, shiftB), low2), 4))};
                tot[h] = _mm512_setzero_si512();
                for (int k = 0; k < 2; k++) {
                    const int cc = 2 * h + k;      /* values 64 cc .. 64 cc + 63 */
                    tot[h] = _mm512_add_epi32(tot[h], digits_dot(q[k], hi + 64 * cc, lo + 64 * cc,
                                                                 _mm512_permutexvar_epi32(pick[cc], sc)));
                }
            }
            const __m512i off = _mm512_mullo_epi32(sc, _mm512_loadu_si512((const void *)(a->s16 + blk * 16)));
            const __m512 t = _mm512_sub_ps(_mm512_add_ps(_mm512_cvtepi32_ps(tot[0]), _mm512_cvtepi32_ps(tot[1])),
                                           _mm512_mul_ps(_mm512_cvtepi32_ps(off), _mm512_set1_ps(32.0f)));
            acc = _mm512_fmadd_ps(t, _mm512_set1_ps(half_to_float(load_u16(b + 208)) * a->xd[blk]), acc);
        }
        a->out[n] = _mm512_reduce_add_ps(acc);
    }
}

/* Q3_K (three = 1) and Q2_K at batch 1 with int8 products, as Q6_K: their 2-bit values
 * (Q3_K: with its hmask bit as the 4, 0 .. 7) stay bytes and meet the digits in
 * `vpdpbusd`; Q3_K's -4 offset comes off through the activations' sums per 16, and so
 * do Q2_K's mins (integers times the same sums). The 64 values at 64 cc are runs 2k,
 * 2k + 1 of half h (cc = 2h + k): bits 4k, 4k + 2 of qs[32h + l] in the vector's two
 * halves (a shift per 16-bit lane), bits 4h + 2k, + 1 of hmask[l]. */
static inline __attribute__((always_inline)) void k23_digits_rows(const DgArgs *a, int64_t c,
                                                                 const int three) {
    const int64_t bytes = three ? Q3K_BYTES : Q2K_BYTES;
    const int64_t nb = a->K / 256, n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    const __m512i low2 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    const __m512i up2 = _mm512_set_epi64(0x0002000200020002LL, 0x0002000200020002LL, 0x0002000200020002LL,
                                         0x0002000200020002LL, 0, 0, 0, 0);
    const __m512i up1 = _mm512_srli_epi16(up2, 1);
    __m512i pick[4];
    per16_picks(pick);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->qs + n * nb * bytes;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * bytes;
            for (int64_t l = 0; l < bytes; l += 64)
                _mm_prefetch((const char *)b + PF_AHEAD + l, _MM_HINT_T0);
            uint8_t sm[16];
            if (three) q3k_scales(b + 96, sm);
            const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(three ? sm : b)));
            const __m512i sc = three ? _mm512_sub_epi32(raw, _mm512_set1_epi32(32))
                                     : _mm512_and_si512(raw, _mm512_set1_epi32(15));
            const __m512i hm = three ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)b))
                                     : _mm512_setzero_si512();
            const int8_t *hi = a->dg + blk * 512, *lo = hi + 256;
            __m512i tot = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    (const __m256i *)(b + (three ? 32 : 16) + 32 * h)));
                for (int k = 0; k < 2; k++) {
                    const int cc = 2 * h + k;
                    __m512i v = _mm512_and_si512(_mm512_srlv_epi16(q, _mm512_add_epi16(up2, _mm512_set1_epi16(4 * k))), low2);
                    if (three)
                        v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(
                            hm, _mm512_add_epi16(up1, _mm512_set1_epi16(4 * h + 2 * k))), one), 2));
                    tot = _mm512_add_epi32(tot, digits_dot(v, hi + 64 * cc, lo + 64 * cc,
                                                           _mm512_permutexvar_epi32(pick[cc], sc)));
                }
            }
            const __m512i s16 = _mm512_loadu_si512((const void *)(a->s16 + blk * 16));
            const float dx = a->xd[blk];
            if (three) {
                const __m512i off = _mm512_mullo_epi32(sc, s16);
                acc = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(
                    _mm512_cvtepi32_ps(off), _mm512_set1_ps(4.0f))),
                    _mm512_set1_ps(half_to_float(load_u16(b + 108)) * dx), acc);
            } else {
                const __m512i mins = _mm512_mullo_epi32(_mm512_srli_epi32(raw, 4), s16);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_set1_ps(half_to_float(load_u16(b + 80)) * dx), acc);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins),
                                      _mm512_set1_ps(-half_to_float(load_u16(b + 82)) * dx), acc);
            }
        }
        a->out[n] = _mm512_reduce_add_ps(acc);
    }
}

static void q3k_digits_chunk(const void *p, int64_t c) { k23_digits_rows(p, c, 1); }
static void q2k_digits_chunk(const void *p, int64_t c) { k23_digits_rows(p, c, 0); }

static __thread int32_t *dg_sums;   /* a Q6_K / Q3_K / Q2_K product's per-16 activation sums */
static __thread int64_t dg_sums_cap;
#endif
