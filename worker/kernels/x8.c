/* x8.c: K-quants (Q4_K, Q5_K, Q6_K, IQ4_XS) through int8 activations (`--activations int8`, a
 * matrix's act8; AVX2 builds without AVX-512): how x is held (quantize_x8_rows, every
 * batch size) and the batch-1 products; x8_rows.c multiplies many rows.
 *
 * x is held per super-block of 256 with one step, D = max |x| / 127 (llama.cpp's q8_K),
 * so the weights' bytes meet x in vpmaddubsw and the weights' own sub-scale joins in
 * vpmaddwd: per 64 values 2 + 2 multiplies, where the int16 activations' two digits take
 * 4 + 4 (digits_avx2.c). One step per 256 alone loses the small values of a block beside
 * an outlier channel (Qwen2.5-Coder-1.5B teacher-forced over 384 tokens, x fake-quantized
 * in NumPy: mean KL 0.016 against int16), so a row's block whose smallest nonzero run of
 * 32 has its largest |x| under 1/16 of the block's is held as int16 steps (16000 per
 * max |x|) in two int8 digits, q = 128 h + l, as the digits kernels hold every block
 * (the same measurement: KL 0.0006; a step of its own per run of 32, the earlier batch-1
 * way: 0.0009). Each row decides for itself (over Qwen2.5-1.5B's 32-token prefill chunks
 * 3.3 % of the FFN down projection's row-blocks are held, 0.1-0.2 % of the others'; the
 * union over a chunk's rows would be 48 %: each token has its own outlier channels); a
 * row with a third or more of its blocks held takes the int16 kernels (x8_dense_row).
 * Every batch size holds a row the same way, so a sequence's products do not depend on
 * what it is batched with. */
#if defined(__AVX2__) && !defined(PN_ZMM)

#define X8_HARD_RATIO 16.0f     /* a run under 1/16 of its block's largest |x|: two digits */

static __thread uint8_t *x8r_hard;      /* [K / 256, B]: the row's block is held as two digits */
static __thread int32_t *x8r_held;      /* the held ones' places, blk B + b */
static __thread int64_t x8r_hard_cap;
static __thread float *x8r_xs16;        /* Q6_K: -32 x each run of 16's sum, [B, K / 16] */
static __thread int64_t x8r_xs16_cap;

/* Whether a row (its flags at hard, one every `stride`, nb blocks) has a third or more
 * of its blocks held: such a row takes the int16 kernels instead at every batch size
 * (held blocks cost a second pass; past a third of them int16 is the faster) */
static inline int x8_dense_row(const uint8_t *hard, int64_t stride, int64_t nb) {
    int64_t n = 0;
    for (int64_t blk = 0; blk < nb; blk++) n += hard[blk * stride];
    return 3 * n >= nb && n > 0;
}

/* This thread's buffers for B rows of K (the held flags and places, then B flags of
 * dense rows after the held ones; Q6_K's sums per 16), grown as needed; 0 where they
 * cannot be had */
static int x8_buffers(int code, int64_t B, int64_t K) {
    const int64_t n = K / 256 * B;
    if (n > x8r_hard_cap) {         /* (B <= n: the dense flags fit in as many again) */
        uint8_t *nbuf = aligned_alloc(64, (size_t)(2 * n + 63) / 64 * 64);
        int32_t *nheld = aligned_alloc(64, (size_t)(n * 4 + 63) / 64 * 64);
        if (!nbuf || !nheld) return free(nbuf), free(nheld), 0;
        free(x8r_hard), free(x8r_held), x8r_hard = nbuf, x8r_held = nheld, x8r_hard_cap = n;
    }
    if (code == Q6K && 16 * n > x8r_xs16_cap) {
        float *nbuf = aligned_alloc(64, (size_t)(16 * n + 15) / 16 * 16 * sizeof(float));
        if (!nbuf) return 0;
        free(x8r_xs16), x8r_xs16 = nbuf, x8r_xs16_cap = 16 * n;
    }
    return 1;
}

/* 32 int32 (each in int8's range) to bytes, in order */
static inline void x8r_store8(int8_t *dst, const __m256i q[4]) {
    const __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                          _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(
        b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* x [B, K] → per super-block and row (block-major: block blk of row b at blk B + b, so
 * that a kernel reaches a group's rows at constant offsets from one pointer): hard, 1
 * where the block is held as two digits; xh (int8 values, or the high digits) and xl
 * (the low digits, of held blocks only), 256 each; xd, the unit of xh (the block's step
 * max |x| / 127; held: 128 x max |x| / 16000, the high digit's weight); and the sums
 * the mins meet: xs per 32 (Q4_K, Q5_K: each run's sum in x's units) or per 16 (Q6_K:
 * -32 x each run of 16's sum, the offset of its 6-bit values). */
static void quantize_x8_rows(const float *x, int64_t B, int64_t K, int code, int8_t *xh,
                             int8_t *xl, uint8_t *hard, float *xd, float *xs) {
    const int64_t nb = K / 256;
    const int six = code == Q6K;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t b = 0; b < B; b++)
        for (int64_t blk = 0; blk < nb; blk++) {
            const float *v = x + b * K + blk * 256;
            const int64_t at = blk * B + b;
            int8_t *h8 = xh + at * 256, *l8 = xl + at * 256;
            float run[8], top = 0.0f, least = 0.0f;
            for (int j = 0; j < 8; j++) {
                __m256 m = _mm256_setzero_ps();
                for (int i = 0; i < 32; i += 8)
                    m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(v + 32 * j + i), absmask));
                run[j] = hmax8(m);
                top = run[j] > top ? run[j] : top;
                if (run[j] > 0.0f && (least == 0.0f || run[j] < least)) least = run[j];
            }
            /* (a run of zeros is exact at any step) */
            const int held = least > 0.0f && least * X8_HARD_RATIO < top;
            const float lim = held ? XK_MAX : 127.0f;
            const float d = top / lim, inv = d > 0 ? 1.0f / d : 0.0f;
            for (int j = 0; j < 8; j++) {
                __m256i q[4];
                round32(v + 32 * j, inv, lim, q);
                if (held) {             /* q = 128 h + l: h = q >> 7, l = q & 127 */
                    __m256i h[4], l[4];
                    for (int i = 0; i < 4; i++) {
                        h[i] = _mm256_srai_epi32(q[i], 7);
                        l[i] = _mm256_and_si256(q[i], _mm256_set1_epi32(127));
                    }
                    x8r_store8(h8 + 32 * j, h);
                    x8r_store8(l8 + 32 * j, l);
                } else {
                    x8r_store8(h8 + 32 * j, q);
                }
                if (six) {              /* two runs of 16 */
                    xs[at * 16 + 2 * j] = -32.0f * d *
                        (float)hsum_epi32(_mm256_add_epi32(q[0], q[1]));
                    xs[at * 16 + 2 * j + 1] = -32.0f * d *
                        (float)hsum_epi32(_mm256_add_epi32(q[2], q[3]));
                } else {
                    xs[at * 8 + j] = d * (float)hsum_epi32(_mm256_add_epi32(
                        _mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
                }
            }
            hard[at] = (uint8_t)held;
            xd[at] = held ? 128.0f * d : d;
        }
}

/* w's 32 bytes against 32 int8 values of x under one int16 scale (in every lane of sl) */
static inline __m256i x8_pair(__m256i w, const int8_t *x, __m256i sl) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)x)), sl);
}

/* signed weights (IQ4_XS's levels, -127 .. 113) against 32 int8 values of x: vpmaddubsw
 * takes |w| and x with w's sign (pairs at most 2 x 127 x 127) */
static inline __m256i x8_spair(__m256i w, const int8_t *x, __m256i sl) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)), sl);
}

/* An IQ4_XS super-block's runs 2t (r0: values 64t .. 64t + 31) and 2t + 1 (r1) as its
 * signed levels: bytes 32t .. hold run 2t's values i and 16 + i in byte i's nibbles, run
 * 2t + 1's in bytes 32t + 16 .. */
static inline void iq4xs_values(const uint8_t *b, int t, __m256i *r0, __m256i *r1) {
    const __m256i low4 = _mm256_set1_epi8(15);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_LEVELS));
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 8 + 32 * t));
    const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(raw, low4));
    const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4));
    *r0 = _mm256_permute2x128_si256(lo, hi, 0x20);
    *r1 = _mm256_permute2x128_si256(lo, hi, 0x31);
}

/* IQ4_XS's 8 sub-scales (less 32) as int16, in both lanes */
static inline __m256i iq4xs_subscales(const uint8_t *b) {
    uint8_t ls[8];
    iq4xs_scales(b, ls);
    return _mm256_broadcastsi128_si256(_mm_sub_epi16(
        _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)ls)), _mm_set1_epi16(32)));
}

typedef struct {
    int code; const uint8_t *qs; int64_t N, K; const int8_t *xh, *xl; const uint8_t *hard;
    const float *xd, *xs;           /* Q6_K: xs per 16, the -32 offset's term */
    float *out; int64_t rows;
} X8Args;

/* Q4_K / Q5_K at batch 1: a block held as two digits goes as k45_digits2_chunk's (a lane
 * sums 32 values of at most 31 x 63 x 16000 < 2^31), its unit xd / 128; the others meet
 * one int8 value under the sub-scale. x's blocks are the same for every row of W, so the
 * branch is too; it chooses between two whole loops (one loop with the choice inside, as
 * q6k_x8_chunk has it, ran 3 % slower here: 411 against 399 us, alternated, one core). */
static void k45_x8_chunk(const void *p, int64_t c) {
    const X8Args *a = p;
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
            const int held = a->hard[blk];
            __m256i ci = _mm256_setzero_si256();
            if (held) {
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    __m256i lo, hi;
                    k45_values(b, five, qh, t, &lo, &hi);
                    ci = _mm256_add_epi32(ci, _mm256_add_epi32(
                        digit_pair(lo, xh + 64 * t, xl + 64 * t, one_scale(S, 2 * t)),
                        digit_pair(hi, xh + 64 * t + 32, xl + 64 * t + 32, one_scale(S, 2 * t + 1))));
                }
            } else {
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    __m256i lo, hi;
                    k45_values(b, five, qh, t, &lo, &hi);
                    ci = _mm256_add_epi32(ci, _mm256_add_epi32(x8_pair(lo, xh + 64 * t, one_scale(S, 2 * t)),
                                                               x8_pair(hi, xh + 64 * t + 32, one_scale(S, 2 * t + 1))));
                }
            }
            const float unit = held ? a->xd[blk] * (1.0f / 128.0f) : a->xd[blk];
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ci), _mm256_set1_ps(half_to_float(load_u16(b)) * unit), acc);
            accm = _mm256_fmadd_ps(mf, _mm256_loadu_ps(a->xs + blk * 8), accm);
        }
        a->out[n] = hsum(_mm256_add_ps(acc, accm));
    }
}

/* Q6_K at batch 1 the same way; each half block's sums go to floats on their own (a held
 * block's: 16 values of at most 63 x 128 x 16000 < 2^31, as q6k_digits2_chunk) */
static void q6k_x8_chunk(const void *p, int64_t c) {
    const X8Args *a = p;
    const int64_t nb = a->K / 256;
    const int64_t n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->qs + n * nb * Q6K_BYTES;
        __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * Q6K_BYTES;
            for (int64_t l = 0; l < Q6K_BYTES; l += 64)
                _mm_prefetch((const char *)b + PF_AHEAD + l, _MM_HINT_T0);
            const float d = half_to_float(load_u16(b + 208));
            const int8_t *xh = a->xh + blk * 256, *xl = a->xl + blk * 256;
            const __m128i s8 = _mm_loadu_si128((const __m128i *)(b + 192));
            const __m256i S16 = _mm256_cvtepi8_epi16(s8);
            const __m256i Sh[2] = {_mm256_permute2x128_si256(S16, S16, 0x00),
                                   _mm256_permute2x128_si256(S16, S16, 0x11)};
            const int held = a->hard[blk];
            const float unit = held ? a->xd[blk] * (1.0f / 128.0f) : a->xd[blk];
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m256i ci = _mm256_setzero_si256();
#pragma GCC unroll 2
                for (int up = 0; up < 2; up++) {
                    const int t = 2 * h + up;
                    __m256i r0, r1;
                    q6k_values(b, t, &r0, &r1);
                    const __m256i s0 = run_scales(Sh[h], 2 * t), s1 = run_scales(Sh[h], 2 * t + 1);
                    ci = _mm256_add_epi32(ci, held
                        ? _mm256_add_epi32(digit_pair(r0, xh + 64 * t, xl + 64 * t, s0),
                                           digit_pair(r1, xh + 64 * t + 32, xl + 64 * t + 32, s1))
                        : _mm256_add_epi32(x8_pair(r0, xh + 64 * t, s0), x8_pair(r1, xh + 64 * t + 32, s1)));
                }
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ci), _mm256_set1_ps(d * unit), acc);
            }
            const __m256 dv = _mm256_set1_ps(d);
            accm = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), dv),
                                   _mm256_loadu_ps(a->xs + blk * 16), accm);
            accm = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), dv),
                                   _mm256_loadu_ps(a->xs + blk * 16 + 8), accm);
        }
        a->out[n] = hsum(_mm256_add_ps(acc, accm));
    }
}

/* IQ4_XS at batch 1: the high digits (or int8 values) and a held block's low digits in
 * sums of their own (each lane at most 8 x 2 x 2 x 127 x 127 x 32) */
static void iq4xs_x8_chunk(const void *p, int64_t c) {
    const X8Args *a = p;
    const int64_t nb = a->K / 256;
    const int64_t n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->qs + n * nb * IQ4XS_BYTES;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * IQ4XS_BYTES;
            for (int64_t l = 0; l < IQ4XS_BYTES; l += 64)
                _mm_prefetch((const char *)b + PF_AHEAD + l, _MM_HINT_T0);
            const __m256i S = iq4xs_subscales(b);
            const int8_t *xh = a->xh + blk * 256, *xl = a->xl + blk * 256;
            const int held = a->hard[blk];
            const float dx = half_to_float(load_u16(b)) * a->xd[blk];
            __m256i ci = _mm256_setzero_si256(), cl = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                __m256i r0, r1;
                iq4xs_values(b, t, &r0, &r1);
                const __m256i s0 = one_scale(S, 2 * t), s1 = one_scale(S, 2 * t + 1);
                ci = _mm256_add_epi32(ci, _mm256_add_epi32(x8_spair(r0, xh + 64 * t, s0),
                                                           x8_spair(r1, xh + 64 * t + 32, s1)));
                if (held)
                    cl = _mm256_add_epi32(cl, _mm256_add_epi32(x8_spair(r0, xl + 64 * t, s0),
                                                               x8_spair(r1, xl + 64 * t + 32, s1)));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ci), _mm256_set1_ps(dx), acc);
            if (held)
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(cl), _mm256_set1_ps(dx * (1.0f / 128.0f)), acc);
        }
        a->out[n] = hsum(acc);
    }
}

/* a Q4_K, Q5_K, Q6_K or IQ4_XS product at batch 1 with int8 activations (a dense row,
 * as x8_dense_row says: the int16 digits, or for IQ4_XS its int16 row kernel through the
 * caller); 0 where the buffers cannot be had (the caller then takes the int16 path). The scratch's int16 x holds the two digit arrays (K bytes
 * each). */
static int x8_product(const PnMat *m, const float *x, const PnScratch *s, float *out) {
    const int64_t K = m->K;
    if (!x8_buffers(m->code, 1, K)) return 0;
    float *xs = m->code == Q6K ? x8r_xs16 : s->xs;
    int8_t *xh = (int8_t *)s->xq, *xl = xh + K;
    quantize_x8_rows(x, 1, K, m->code, xh, xl, x8r_hard, s->xd, xs);
    if (x8_dense_row(x8r_hard, 1, K / 256))         /* as x8_rows_product: int16 */
        return m->code == Q6K ? q6k_digits2(m, x, s, out)
             : m->code == IQ4XS ? 0 : k45_digits2(m, x, s, out);
    X8Args a = {m->code, m->qs, m->N, K, xh, xl, x8r_hard, s->xd, xs, out, piece_rows(m->N)};
    pool_run(m->code == Q6K ? q6k_x8_chunk : m->code == IQ4XS ? iq4xs_x8_chunk : k45_x8_chunk,
             &a, (m->N + a.rows - 1) / a.rows);
    return 1;
}
int pn_has_x8(void) { return 1; }
#else
int pn_has_x8(void) { return 0; }   /* AVX-512 builds: their two-digit VNNI products */
#endif
