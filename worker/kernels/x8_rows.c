/* x8_rows.c: K-quants (Q4_K, Q5_K, Q6_K) against many rows of x with int8 activations
 * (`--activations int8`, a matrix's act8; AVX2 builds without AVX-512): prefill chunks
 * and batched decode steps. The int16 row kernels (k_row_avx2) spend per 64 values and
 * row 4 vpmaddwd and 4 adds, and widen every super-block to int16 with its sub-scales
 * multiplied in; here the weights' bytes meet x's int8 values in vpmaddubsw (32 products
 * an instruction) and the sub-scale joins in vpmaddwd: per 64 values and row 2 + 2
 * multiplies and 2 adds, and a super-block's nibbles are only masked and shifted.
 *
 * x is held per super-block of 256 with one step (llama.cpp's q8_K) where that keeps
 * every run of 32 at 8 or more levels; a super-block where some run's largest |x| is
 * under 1/16 of the block's (a run beside an outlier channel, which one step per 256
 * would round to a few levels: Qwen2.5-1.5B's FFN inputs, KL 0.016 against int16 with
 * one step everywhere) is held as int16 steps in two int8 digits, q = 128 h + l, as the
 * batch-1 digits kernels do: its products take a second vpmaddubsw. Whether a block is
 * held so is decided once per product for all its rows (a column property: outlier
 * channels are the same for every token), so every row of a group takes the same path
 * through a block. Measured, Qwen2.5-Coder-1.5B Q4_K_M teacher-forced over 384 tokens
 * (fake-quantized in NumPy): 2.7 % of the blocks so held, mean KL 0.0006 against int16
 * (one step per 256 everywhere: 0.016, a step per run of 32: 0.0009). */
#if defined(__AVX2__) && !defined(PN_ZMM)

#define X8_HARD_RATIO 16.0f     /* a run under 1/16 of its block's largest |x|: two digits */
#define X8R_GROUP 8             /* rows of x per pass over a row of W */
#define X8R_HELD_MAX_PART 3     /* more than 1 / 3 of x's row-blocks held: the int16 kernel */
/* No load moves across it: without, GCC hoisted a whole block's x (8 rows x 256 bytes)
 * ahead of the products and spilled it to the stack (0.85x the int16 kernel's speed) */
#define X8R_BARRIER() __asm__ volatile("" ::: "memory")

static __thread uint8_t *x8r_hard;      /* [K / 256, B]: the row's block is held as two digits */
static __thread int32_t *x8r_held;      /* the held ones' places, blk B + b */
static __thread int64_t x8r_hard_cap;
static __thread float *x8r_xs16;        /* Q6_K: -32 x each run of 16's sum, [B, K / 16] */
static __thread int64_t x8r_xs16_cap;

/* 8 floats' largest |.| */
static inline float hmax_abs8(__m256 m) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
}

/* 32 values times inv, rounded half away from zero (as pn_quantize_xk), as int32 in q[4] */
static inline void x8r_round32(const float *v, float inv, float lim, __m256i q[4]) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 half = _mm256_set1_ps(0.5f), vinv = _mm256_set1_ps(inv);
    const __m256 hi = _mm256_set1_ps(lim), lo = _mm256_set1_ps(-lim);
    for (int h = 0; h < 4; h++) {
        __m256 r = _mm256_mul_ps(_mm256_loadu_ps(v + 8 * h), vinv);
        r = _mm256_add_ps(r, _mm256_or_ps(_mm256_and_ps(r, sign), half));
        q[h] = _mm256_cvttps_epi32(_mm256_max_ps(_mm256_min_ps(r, hi), lo));
    }
}

/* 32 int32 (each in int8's range) to bytes, in order */
static inline void x8r_store8(int8_t *dst, const __m256i q[4]) {
    const __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                          _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(
        b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
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
                run[j] = hmax_abs8(m);
                top = run[j] > top ? run[j] : top;
                if (run[j] > 0.0f && (least == 0.0f || run[j] < least)) least = run[j];
            }
            /* (a run of zeros is exact at any step) */
            const int held = least > 0.0f && least * X8_HARD_RATIO < top;
            const float lim = held ? XK_MAX : 127.0f;
            const float d = top / lim, inv = d > 0 ? 1.0f / d : 0.0f;
            for (int j = 0; j < 8; j++) {
                __m256i q[4];
                x8r_round32(v + 32 * j, inv, lim, q);
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

typedef struct {
    int code; const uint8_t *qs; int64_t N, K, B;
    const int8_t *xh, *xl;
    const int32_t *held; int64_t n_held;        /* the held row-blocks: blk B + b */
    const float *xd, *xs;
    float *out; int64_t rows;
} X8RowsArgs;

/* w's 32 bytes against 32 int8 values at x under one int16 scale in every lane */
static inline __m256i x8r_pair(__m256i w, const int8_t *x, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)x)), s);
}

/* A held block's low digits (xl, 256) against the block's weights at p: its int32 sums
 * per lane (each lane at most 32 x 63 x 128 x 127) */
static inline __m256i x8r_low_digits(int code, const uint8_t *p, const int8_t *xl) {
    __m256i c = _mm256_setzero_si256();
    if (code != Q6K) {
        const int five = code == Q5K;
        uint8_t sm[16];
        k_scales_fast(p + 4, sm);
        const __m256i S = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sm)));
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {
            __m256i lo, hi;
            k45_values(p, five, qh, t, &lo, &hi);
            c = _mm256_add_epi32(c, _mm256_add_epi32(x8r_pair(lo, xl + 64 * t, one_scale(S, 2 * t)),
                                                     x8r_pair(hi, xl + 64 * t + 32, one_scale(S, 2 * t + 1))));
        }
        return c;
    }
    const __m256i S16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
    for (int t = 0; t < 4; t++) {
        const __m256i Sa = _mm256_permute2x128_si256(S16, S16, t >= 2 ? 0x11 : 0x00);
        __m256i r0, r1;
        q6k_values(p, t, &r0, &r1);
        c = _mm256_add_epi32(c, _mm256_add_epi32(x8r_pair(r0, xl + 64 * t, run_scales(Sa, 2 * t)),
                                                 x8r_pair(r1, xl + 64 * t + 32, run_scales(Sa, 2 * t + 1))));
    }
    return c;
}

/* Super-blocks [blk0, blk1) of one row of W against G rows of x (rows b0 ..): out[b * N]
 * set, or added to (`add`). Every row's xh meets the weights here (a held block's high
 * digits, whose weight of 128 its xd carries); the held blocks' low digits are added
 * afterwards (x8r_add_low_digits), so this pass has no branch. A lane's int32 sum over a
 * block stays small: 32 values of at most 63 x 128 x 127 (Q6_K). */
static inline __attribute__((always_inline)) void x8_row(
        const X8RowsArgs *a, const uint8_t *restrict row, int64_t blk0, int64_t blk1,
        int64_t b0, float *restrict out, int64_t fetch, int add, const int G) {
    const int64_t bytes = k_bytes(a->code), N = a->N;
    const int five = a->code == Q5K, six = a->code == Q6K;
    __m256 acc[X8R_GROUP];
    for (int b = 0; b < G; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t blk = blk0; blk < blk1; blk++) {
        const uint8_t *p = row + blk * bytes;
        if (fetch)
            for (int64_t l = 0; l < bytes; l += 64)
                _mm_prefetch((const char *)p + fetch + l, _MM_HINT_T0);
        const int64_t at = blk * a->B + b0;     /* the group's first row in this block */
        const int8_t *xh = a->xh + at * 256;
        const float *xd = a->xd + at;
        if (!six) {
            uint8_t sm[16];
            k_scales_fast(p + 4, sm);
            const float d = half_to_float(load_u16(p));
            const __m256 mf = _mm256_mul_ps(_mm256_set1_ps(-half_to_float(load_u16(p + 2))),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8)))));
            const __m256i S = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sm)));
            const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
            __m256i c[X8R_GROUP];
            for (int b = 0; b < G; b++) c[b] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                X8R_BARRIER();
                __m256i lo, hi;
                k45_values(p, five, qh, t, &lo, &hi);
                const __m256i s0 = one_scale(S, 2 * t), s1 = one_scale(S, 2 * t + 1);
                for (int b = 0; b < G; b++)
                    c[b] = _mm256_add_epi32(c[b], _mm256_add_epi32(
                        x8r_pair(lo, xh + b * 256 + 64 * t, s0), x8r_pair(hi, xh + b * 256 + 64 * t + 32, s1)));
            }
            for (int b = 0; b < G; b++)
                acc[b] = _mm256_fmadd_ps(mf, _mm256_loadu_ps(a->xs + (at + b) * 8),
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(c[b]), _mm256_set1_ps(d * xd[b]), acc[b]));
        } else {
            const float d = half_to_float(load_u16(p + 208));
            const __m128i s8 = _mm_loadu_si128((const __m128i *)(p + 192));
            const __m256i S16 = _mm256_cvtepi8_epi16(s8);
            const __m256 dv = _mm256_set1_ps(d);
            const __m256 sc0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), dv);
            const __m256 sc1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), dv);
            __m256i c[X8R_GROUP];
            for (int b = 0; b < G; b++) c[b] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                X8R_BARRIER();
                const __m256i Sa = _mm256_permute2x128_si256(S16, S16, t >= 2 ? 0x11 : 0x00);
                __m256i r0, r1;
                q6k_values(p, t, &r0, &r1);
                const __m256i s0 = run_scales(Sa, 2 * t), s1 = run_scales(Sa, 2 * t + 1);
                for (int b = 0; b < G; b++)
                    c[b] = _mm256_add_epi32(c[b], _mm256_add_epi32(
                        x8r_pair(r0, xh + b * 256 + 64 * t, s0), x8r_pair(r1, xh + b * 256 + 64 * t + 32, s1)));
            }
            for (int b = 0; b < G; b++)
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c[b]), _mm256_set1_ps(d * xd[b]), acc[b]);
            for (int b = 0; b < G; b++) {
                const float *s16 = a->xs + (at + b) * 16;
                acc[b] = _mm256_fmadd_ps(sc1, _mm256_loadu_ps(s16 + 8),
                                         _mm256_fmadd_ps(sc0, _mm256_loadu_ps(s16), acc[b]));
            }
        }
    }
    for (int b = 0; b < G; b++) out[b * N] = (add ? out[b * N] : 0.0f) + hsum(acc[b]);
}

/* The held blocks' low digits (x's `held` list: blk B + b, ascending) against rows
 * [s0, s1) of W, added to out: per held row-block one pass down the sub-piece's rows,
 * whose blocks are still in cache from x8_row. Rare (Qwen2.5-1.5B, 32-token chunks: 3 %
 * of the FFN down projection's row-blocks, 0.1-0.2 % of the others'), so the common pass
 * stays branch-free. */
static void x8r_add_low_digits(const X8RowsArgs *a, int64_t s0, int64_t s1) {
    const int64_t nb = a->K / 256, bytes = k_bytes(a->code), B = a->B;
    const int64_t dpos = a->code == Q6K ? 208 : 0;
    for (int64_t i = 0; i < a->n_held; i++) {
        const int64_t at = a->held[i], blk = at / B, b = at % B;
        const int8_t *xl = a->xl + at * 256;
        const float unit = a->xd[at] * (1.0f / 128.0f);      /* the low digit's */
        for (int64_t n = s0; n < s1; n++) {
            const uint8_t *p = a->qs + (n * nb + blk) * bytes;
            a->out[b * a->N + n] += (float)hsum_epi32(x8r_low_digits(a->code, p, xl)) *
                                    half_to_float(load_u16(p + dpos)) * unit;
        }
    }
}

/* Rows [n0, n1) of W against every row of x: as gemv_k_rows (sub-pieces of KSUB rows of
 * W met by every group of x's rows; long rows in spans whose x stays in L1). */
static void x8_rows_chunk(const void *p, int64_t c) {
    const X8RowsArgs *a = p;
    const int64_t n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    const int64_t nb = a->K / 256, bytes = k_bytes(a->code), B = a->B, N = a->N;
    for (int64_t s0 = n0; s0 < n1; s0 += KSUB) {
        const int64_t s1 = s0 + KSUB < n1 ? s0 + KSUB : n1;
        for (int64_t b0 = 0; b0 < B; b0 += X8R_GROUP) {
            const int64_t g = B - b0 < X8R_GROUP ? B - b0 : X8R_GROUP;
            int64_t span = XSPAN[0] ? XSPAN[0] / (g * 256) : nb;
            span = span < 1 ? 1 : span;
            for (int64_t k0 = 0; k0 < nb; k0 += span) {
                const int64_t k1 = k0 + span < nb ? k0 + span : nb;
                const int add = k0 > 0;
                const int64_t f = b0 > 0 ? 0 : span < nb ? 2 * nb * bytes : PF_AHEAD;
                for (int64_t n = s0; n < s1; n++) {
                    const uint8_t *row = a->qs + n * nb * bytes;
                    float *o = a->out + b0 * N + n;
                    int64_t b = 0;
                    if (g == 8) x8_row(a, row, k0, k1, b0, o, f, add, 8), b = 8;
                    else if (g >= 4) x8_row(a, row, k0, k1, b0, o, f, add, 4), b = 4;
                    for (; b + 2 <= g; b += 2)
                        x8_row(a, row, k0, k1, b0 + b, o + b * N, b ? 0 : f, add, 2);
                    if (b < g) x8_row(a, row, k0, k1, b0 + b, o + b * N, b ? 0 : f, add, 1);
                }
            }
        }
        if (a->n_held) x8r_add_low_digits(a, s0, s1);
    }
}

/* out[B, N] = x @ W.T for Q4_K, Q5_K, Q6_K with int8 activations, any B (the batch-1
 * product, x8_product, keeps its step per run of 32); 0 where the buffers cannot be
 * had, or where a third or more of x's row-blocks are held (a held row-block costs about
 * as much again in its own pass, so past that the int16 kernel is the faster, and it is
 * the finer): the caller then takes the int16 path. Qwen2.5-1.5B's first positions
 * (the attention sink's outliers) are such: batch-8 decode at positions 0-15 ran at
 * 0.88x int16 without this. The scratch's int16 x holds both digit arrays ([B, K]
 * bytes each). */
static int x8_rows_product(const PnMat *m, const float *x, int64_t B, const PnScratch *s,
                           float *out) {
    const int64_t K = m->K, nb = K / 256;
    if (nb * B > x8r_hard_cap) {
        uint8_t *nbuf = aligned_alloc(64, (size_t)(nb * B + 63) / 64 * 64);
        int32_t *nheld = aligned_alloc(64, (size_t)(nb * B * 4 + 63) / 64 * 64);
        if (!nbuf || !nheld) return free(nbuf), free(nheld), 0;
        free(x8r_hard), free(x8r_held), x8r_hard = nbuf, x8r_held = nheld, x8r_hard_cap = nb * B;
    }
    float *xs = s->xs;
    if (m->code == Q6K) {           /* 16 sums a block: twice what the scratch holds */
        if (B * nb * 16 > x8r_xs16_cap) {
            float *nbuf = aligned_alloc(64, (size_t)(B * nb * 16 + 15) / 16 * 16 * sizeof(float));
            if (!nbuf) return 0;
            free(x8r_xs16), x8r_xs16 = nbuf, x8r_xs16_cap = B * nb * 16;
        }
        xs = x8r_xs16;
    }
    int8_t *xh = (int8_t *)s->xq, *xl = xh + B * K;
    quantize_x8_rows(x, B, K, m->code, xh, xl, x8r_hard, s->xd, xs);
    int64_t n_held = 0;
    for (int64_t at = 0; at < nb * B; at++)
        if (x8r_hard[at]) x8r_held[n_held++] = (int32_t)at;
    if (n_held * X8R_HELD_MAX_PART > nb * B)
        return 0;
    X8RowsArgs a = {m->code, m->qs, m->N, K, B, xh, xl, x8r_held, n_held, s->xd, xs, out,
                    piece_rows(m->N)};
    pool_run(x8_rows_chunk, &a, (m->N + a.rows - 1) / a.rows);
    return 1;
}
#endif
