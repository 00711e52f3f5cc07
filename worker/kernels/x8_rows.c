/* x8_rows.c: K-quants (Q4_K, Q5_K, Q6_K, IQ4_XS) against many rows of x with int8 activations
 * (`--activations int8`, a matrix's act8; AVX2 builds without AVX-512): prefill chunks
 * and batched decode steps, x held as x8.c's quantize_x8_rows says. The int16 row
 * kernels (k_row_avx2) spend per 64 values and row 4 vpmaddwd and 4 adds, and widen
 * every super-block to int16 with its sub-scales multiplied in; here the weights' bytes
 * meet x's int8 values in vpmaddubsw (32 products an instruction) and the sub-scale, a
 * vector shared by every row of the group, joins in vpmaddwd: per 64 values and row
 * 2 + 2 multiplies and 2 adds, and a super-block's nibbles are only masked and shifted.
 * A held row-block's low digits take a pass of their own (x8r_add_low_digits). */
#if defined(__AVX2__) && !defined(PN_ZMM)

#define X8R_GROUP 8             /* rows of x per pass over a row of W */
/* No load moves across it: without, GCC hoisted a whole block's x (8 rows x 256 bytes)
 * ahead of the products and spilled it to the stack (0.85x the int16 kernel's speed) */
#define X8R_BARRIER() __asm__ volatile("" ::: "memory")

typedef struct {
    int code; const uint8_t *qs; int64_t N, K, B;
    const int8_t *xh, *xl;
    const int32_t *held; int64_t n_held;        /* the held row-blocks: blk B + b */
    const float *xd, *xs;
    float *out; int64_t rows;
} X8RowsArgs;


/* A held block's low digits (xl, 256) against the block's weights at p: its int32 sums
 * per lane (each lane at most 32 x 63 x 128 x 127) */
static inline __m256i x8r_low_digits(int code, const uint8_t *p, const int8_t *xl) {
    __m256i c = _mm256_setzero_si256();
    if (code == IQ4XS) {
        const __m256i S = iq4xs_subscales(p);
        for (int t = 0; t < 4; t++) {
            __m256i r0, r1;
            iq4xs_values(p, t, &r0, &r1);
            c = _mm256_add_epi32(c, _mm256_add_epi32(x8_spair(r0, xl + 64 * t, one_scale(S, 2 * t)),
                                                     x8_spair(r1, xl + 64 * t + 32, one_scale(S, 2 * t + 1))));
        }
        return c;
    }
    if (code != Q6K) {
        const int five = code == Q5K;
        uint8_t sm[16];
        k_scales_fast(p + 4, sm);
        const __m256i S = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sm)));
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {
            __m256i lo, hi;
            k45_values(p, five, qh, t, &lo, &hi);
            c = _mm256_add_epi32(c, _mm256_add_epi32(x8_pair(lo, xl + 64 * t, one_scale(S, 2 * t)),
                                                     x8_pair(hi, xl + 64 * t + 32, one_scale(S, 2 * t + 1))));
        }
        return c;
    }
    const __m256i S16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
    for (int t = 0; t < 4; t++) {
        const __m256i Sa = _mm256_permute2x128_si256(S16, S16, t >= 2 ? 0x11 : 0x00);
        __m256i r0, r1;
        q6k_values(p, t, &r0, &r1);
        c = _mm256_add_epi32(c, _mm256_add_epi32(x8_pair(r0, xl + 64 * t, run_scales(Sa, 2 * t)),
                                                 x8_pair(r1, xl + 64 * t + 32, run_scales(Sa, 2 * t + 1))));
    }
    return c;
}

/* One quad of a block (values 64t .. 64t + 63: runs 2t, 2t + 1, weights w0, w1 under
 * sub-scales s0, s1) against G rows of x, added to their sums c. Signed weights
 * (IQ4_XS: `sg`, their levels in g0, g1) go in as |w| (w0, w1) with x taking their sign. */
static inline __attribute__((always_inline)) void x8r_quad(
        __m256i c[], const int G, const int8_t *xh, int t, __m256i w0, __m256i w1,
        __m256i s0, __m256i s1, const int sg, __m256i g0, __m256i g1) {
    for (int b = 0; b < G; b++) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(xh + b * 256 + 64 * t));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(xh + b * 256 + 64 * t + 32));
        if (sg) x0 = _mm256_sign_epi8(x0, g0), x1 = _mm256_sign_epi8(x1, g1);
        c[b] = _mm256_add_epi32(c[b], _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), s0),
            _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), s1)));
    }
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
        if (a->code == IQ4XS) {
            const __m256i S = iq4xs_subscales(p);
            const float d = half_to_float(load_u16(p));
            __m256i c[X8R_GROUP];
            for (int b = 0; b < G; b++) c[b] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                X8R_BARRIER();
                __m256i r0, r1;
                iq4xs_values(p, t, &r0, &r1);
                x8r_quad(c, G, xh, t, _mm256_abs_epi8(r0), _mm256_abs_epi8(r1),
                         one_scale(S, 2 * t), one_scale(S, 2 * t + 1), 1, r0, r1);
            }
            for (int b = 0; b < G; b++)
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c[b]), _mm256_set1_ps(d * xd[b]), acc[b]);
        } else if (!six) {
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
                x8r_quad(c, G, xh, t, lo, hi, one_scale(S, 2 * t), one_scale(S, 2 * t + 1), 0, lo, hi);
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
                x8r_quad(c, G, xh, t, r0, r1, run_scales(Sa, 2 * t), run_scales(Sa, 2 * t + 1), 0, r0, r1);
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

/* out[B, N] = x @ W.T for Q4_K, Q5_K, Q6_K with int8 activations, 2 or more rows; 0
 * where the buffers cannot be had (the caller then takes the int16 path). A row with a
 * third or more of its blocks held (x8_dense_row: a sequence's first positions, the
 * attention sink's outliers, are such) is the int16 kernel's, as at batch 1: each held
 * row-block costs about as much again in its own pass, so past that int16 is the faster,
 * and the finer; it is each row's own choice, so a row's product does not depend on the
 * rows beside it. The scratch's int16 x holds both digit arrays ([B, K] bytes each). */
static int x8_rows_product(const PnMat *m, const float *x, int64_t B, const PnScratch *s,
                           float *out) {
    const int64_t K = m->K, nb = K / 256, N = m->N;
    if (!x8_buffers(m->code, B, K)) return 0;
    float *xs = m->code == Q6K ? x8r_xs16 : s->xs;     /* 16 sums a block: twice the scratch's */
    int8_t *xh = (int8_t *)s->xq, *xl = xh + B * K;
    quantize_x8_rows(x, B, K, m->code, xh, xl, x8r_hard, s->xd, xs);
    uint8_t *dense = x8r_hard + nb * B;             /* per row */
    int64_t n_dense = 0;
    for (int64_t b = 0; b < B; b++) n_dense += dense[b] = (uint8_t)x8_dense_row(x8r_hard + b, B, nb);
    if (n_dense == B) return 0;                     /* every row: the int16 kernel */
    int64_t n_held = 0;
    for (int64_t at = 0; at < nb * B; at++)     /* a dense row's blocks: not here */
        if (x8r_hard[at] && !dense[at % B]) x8r_held[n_held++] = (int32_t)at;
    X8RowsArgs a = {m->code, m->qs, N, K, B, xh, xl, x8r_held, n_held, s->xd, xs, out,
                    piece_rows(N)};
    pool_run(x8_rows_chunk, &a, (N + a.rows - 1) / a.rows);
    if (n_dense) {                  /* their rows again, through the int16 kernel */
        const int64_t nd = n_dense;
        float *f = malloc(sizeof(float) * (size_t)(nd * (K + nb + K / 32 + N)));
        int16_t *xq16 = malloc(sizeof(int16_t) * (size_t)(nd * K));
        if (!f || !xq16) {          /* a few MB: the host is out of memory */
            free(f), free(xq16);
            return 0;
        }
        float *rows_x = f, *xd16 = rows_x + nd * K, *xs16 = xd16 + nd * nb, *o16 = xs16 + nd * K / 32;
        for (int64_t b = 0, i = 0; b < B; b++)
            if (dense[b]) memcpy(rows_x + i++ * K, x + b * K, sizeof(float) * (size_t)K);
        pn_quantize_xk(rows_x, nd, K, xq16, xd16, xs16);
        pn_gemv_k(m->code, m->qs, N, K, xq16, xd16, xs16, nd, o16);
        for (int64_t b = 0, i = 0; b < B; b++)
            if (dense[b]) memcpy(out + b * N, o16 + i++ * N, sizeof(float) * (size_t)N);
        free(f), free(xq16);
    }
    return 1;
}
#endif
