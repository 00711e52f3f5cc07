/* k_rows.c: the K-quant row kernels (pn_gemv_k), any number of rows of x: sub-pieces of W
 * stay in cache while every group of 8 rows of x passes (Zen 4, one core: 5.5 ns per
 * super-block and row at 128 rows, where dequantized tiles and OpenBLAS took ~9); on
 * 256-bit vectors a quad of 64 values at a time (k_row_avx2), on AVX-512 a sub-block per
 * vector (k_row512). */
/* bytes of a group's int16 x per pass of gemv_k_rows, so that it stays in L1
 * (PnOptions.xspan; 0: whole rows, which tests compare it with) */
#define XSPAN_BYTES (24 << 10)

#if defined(__AVX2__)

#define KGROUP 8        /* rows of x per pass over a piece of W (accumulators in registers) */
#if !defined(PN_ZMM)
/* AVX2 (16 vector registers): a super-block is taken 64 values at a time (a quad: four
 * vectors of 16 int16, times their sub-scales) and each quad meets every row of the
 * group at once, so the weights never leave registers; the int32 sums of the whole
 * super-block stay in one register per row of x (Q6_K: 32 x 4096 x 16000 < 2^31). The
 * earlier way widened all 256 values (16 vectors, the whole register file) into a
 * stored struct and read them back for every row. */
static inline __attribute__((always_inline)) void k_quad(
        int code, const uint8_t *restrict b, const uint8_t *restrict sm, int t, __m256i w[4]) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (code == Q4K || code == Q5K) {   /* bytes 32t..: low nibbles 64t + i, high 64t + 32 + i */
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + (code == Q5K ? Q5K_QS : 16) + 32 * t));
        __m256i lo = _mm256_and_si256(raw, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        if (code == Q5K) {      /* bits 2t, 2t + 1 of qh[i] */
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), one = _mm256_set1_epi8(1);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t + 1), one), 4));
        }
        const __m256i s0 = _mm256_set1_epi16(sm[2 * t]), s1 = _mm256_set1_epi16(sm[2 * t + 1]);
        w[0] = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)), s0);
        w[1] = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1)), s0);
        w[2] = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi)), s1);
        w[3] = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1)), s1);
        return;
    }
    if (code == Q3K || code == Q2K) {   /* runs 2t, 2t + 1 of 32 (half t / 2), a scale per 16 */
        const int three = code == Q3K, h = t >> 1;
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(b + (three ? 32 : 16) + 32 * h));
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        for (int i = 0; i < 2; i++) {
            const int j = 2 * (t & 1) + i, r = 4 * h + j;
            __m256i u = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * j), _mm256_set1_epi8(3));
            if (three)
                u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(
                    _mm256_srli_epi16(hm, 4 * h + j), _mm256_set1_epi8(1)), 2));
            widen_run(u, _mm256_set1_epi16(three ? sm[2 * r] - 32 : sm[2 * r] & 15),
                      _mm256_set1_epi16(three ? sm[2 * r + 1] - 32 : sm[2 * r + 1] & 15),
                      _mm256_set1_epi16(three ? 4 : 0), &w[2 * i], &w[2 * i + 1]);
        }
        return;
    }
    if (code == IQ4XS) {    /* runs 2t, 2t + 1: bytes 32t.., each run's low nibbles then high */
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 8 + 32 * t));
        const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_LEVELS));
        const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(raw, low4));
        const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4));
        const __m256i s0 = _mm256_set1_epi16((int16_t)(sm[2 * t] - 32));
        const __m256i s1 = _mm256_set1_epi16((int16_t)(sm[2 * t + 1] - 32));
        w[0] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo)), s0);
        w[1] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi)), s0);
        w[2] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(lo, 1)), s1);
        w[3] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(hi, 1)), s1);
        return;
    }
    /* Q6_K: quad t is runs 2t, 2t + 1 (values 64t ..), from half h = t / 2 of the block:
     * low nibbles of ql (t even) or high ones (t odd), 2 bits of qh each */
    const int h = t >> 1, up = t & 1;
    const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
    const int8_t *sc = (const int8_t *)(b + 192) + 4 * t;
    const __m256i two = _mm256_set1_epi8(3), off = _mm256_set1_epi16(32);
    __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    __m256i bits = _mm256_loadu_si256((const __m256i *)qh);
    if (up) {
        l0 = _mm256_srli_epi16(l0, 4);
        l1 = _mm256_srli_epi16(l1, 4);
        bits = _mm256_srli_epi16(bits, 4);
    }
    const __m256i r0 = _mm256_or_si256(_mm256_and_si256(l0, low4),
                                       _mm256_slli_epi16(_mm256_and_si256(bits, two), 4));
    const __m256i r1 = _mm256_or_si256(_mm256_and_si256(l1, low4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 2), two), 4));
    w[0] = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(r0)), off),
                              _mm256_set1_epi16(sc[0]));
    w[1] = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(r0, 1)), off),
                              _mm256_set1_epi16(sc[1]));
    w[2] = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(r1)), off),
                              _mm256_set1_epi16(sc[2]));
    w[3] = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(r1, 1)), off),
                              _mm256_set1_epi16(sc[3]));
}

/* Super-blocks [blk0, blk1) of one row of W (nb in all) against G rows of x (xq0 / xd0 /
 * xs0, row stride K), G a constant at each call: out[b * N] for b < G, or added to it
 * (`add`). `fetch`: prefetch W's stream this many bytes on (0: not at all). */
static inline __attribute__((always_inline)) void k_row_avx2(
        int code, const uint8_t *restrict row, int64_t nb, int64_t blk0, int64_t blk1, int64_t K,
        const int16_t *restrict xq0, const float *restrict xd0, const float *restrict xs0,
        float *restrict out, int64_t N, int64_t fetch, int add, const int G) {
    const int64_t bytes = k_bytes(code);
    __m256 acc[KGROUP];
    for (int b = 0; b < G; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t blk = blk0; blk < blk1; blk++) {
        const uint8_t *p = row + blk * bytes;
        if (fetch)
            for (int64_t l = 0; l < bytes; l += 64)
                _mm_prefetch((const char *)p + fetch + l, _MM_HINT_T0);
        uint8_t sm[16];
        float d;
        __m256 mf = _mm256_setzero_ps(), mf2 = _mm256_setzero_ps();   /* mf2: Q2_K's 8 - 15 */
        if (code == Q4K || code == Q5K) {
            k_scales_fast(p + 4, sm);
            d = half_to_float(load_u16(p));
            mf = _mm256_mul_ps(_mm256_set1_ps(-half_to_float(load_u16(p + 2))), _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8)))));
        } else if (code == Q3K) {
            q3k_scales(p + 96, sm);
            d = half_to_float(load_u16(p + 108));
        } else if (code == IQ4XS) {
            iq4xs_scales(p, sm);
            d = half_to_float(load_u16(p));
        } else if (code == Q2K) {
            memcpy(sm, p, 16);
            d = half_to_float(load_u16(p + 80));
            const __m256 nd = _mm256_set1_ps(-half_to_float(load_u16(p + 82)));
            const __m128i m = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)p), 4),
                                            _mm_set1_epi8(15));
            mf = _mm256_mul_ps(nd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)));
            mf2 = _mm256_mul_ps(nd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(m, 8))));
        } else {
            d = half_to_float(load_u16(p + 208));
        }
        __m256i c[KGROUP];
        for (int b = 0; b < G; b++) c[b] = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {
            __m256i w[4];
            k_quad(code, p, sm, t, w);
            for (int b = 0; b < G; b++) {
                const int16_t *x = xq0 + b * K + blk * 256 + 64 * t;
                const __m256i u = _mm256_add_epi32(
                    _mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)x)),
                    _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)(x + 16))));
                const __m256i v = _mm256_add_epi32(
                    _mm256_madd_epi16(w[2], _mm256_loadu_si256((const __m256i *)(x + 32))),
                    _mm256_madd_epi16(w[3], _mm256_loadu_si256((const __m256i *)(x + 48))));
                c[b] = _mm256_add_epi32(c[b], _mm256_add_epi32(u, v));
            }
        }
        for (int b = 0; b < G; b++) {
            const int64_t xb = (int64_t)b * nb + blk;
            __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c[b]), _mm256_set1_ps(d * xd0[xb]), acc[b]);
            if (code == Q2K)
                t = _mm256_fmadd_ps(mf2, _mm256_loadu_ps(xs0 + xb * 16 + 8),
                                    _mm256_fmadd_ps(mf, _mm256_loadu_ps(xs0 + xb * 16), t));
            else if (code == Q4K || code == Q5K)
                t = _mm256_fmadd_ps(mf, _mm256_loadu_ps(xs0 + xb * 8), t);
            acc[b] = t;
        }
    }
    for (int b = 0; b < G; b++) out[b * N] = (add ? out[b * N] : 0.0f) + hsum(acc[b]);
}
#endif

#if defined(PN_ZMM)
/* One row of W against G rows of x (G a constant, so every accumulator stays in a
 * register): per super-block the weights widen once, then the G rows' int32 sums grow
 * one sub-block at a time, so G independent vpdpwssd chains interleave instead of one
 * chain of 8 dependent products per row (latency 4 cycles, issue 1 a cycle). The mins'
 * term (Q4_K) goes into the same float accumulator through its 8 low lanes. Each int32
 * lane sums 16 products per super-block (Q6_K: 16 x 4096 x 16000 < 2^31). Arguments as
 * k_row_avx2's. */
static inline __attribute__((always_inline)) void k_row512(
        int code, const uint8_t *restrict row, int64_t nb, int64_t blk0, int64_t blk1, int64_t K,
        const int16_t *restrict x, const float *restrict dx, const float *restrict xs,
        float *restrict out, int64_t N, int64_t fetch, int add, const int G) {
    const int64_t bytes = k_bytes(code);
    __m512 acc[KGROUP];
    for (int b = 0; b < G; b++) acc[b] = _mm512_setzero_ps();
    for (int64_t blk = blk0; blk < blk1; blk++) {
        Super512 S;
        if (fetch)
            for (int64_t l = 0; l < bytes; l += 64)
                _mm_prefetch((const char *)row + blk * bytes + fetch + l, _MM_HINT_T0);
        load_super512(code, row + blk * bytes, &S);
        __m512i c[KGROUP];
        for (int b = 0; b < G; b++) c[b] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
#pragma GCC unroll 8
            for (int b = 0; b < G; b++)
                c[b] = _mm512_dpwssd_epi32(c[b], S.w[j], _mm512_loadu_si512(
                    (const void *)(x + b * K + blk * 256 + 32 * j)));
        const __m512 mf = _mm512_castps256_ps512(S.mf);     /* upper lanes undefined: */
#pragma GCC unroll 8
        for (int b = 0; b < G; b++) {                        /* masked off below */
            acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c[b]), _mm512_set1_ps(S.d * dx[b * nb + blk]),
                                     acc[b]);
            if (code == Q2K)                                 /* mins per 16, x's sums too */
                acc[b] = _mm512_fmadd_ps(S.mf16, _mm512_loadu_ps(xs + (b * nb + blk) * 16), acc[b]);
            else if (code != Q3K)
                acc[b] = _mm512_mask3_fmadd_ps(mf, _mm512_castps256_ps512(
                    _mm256_loadu_ps(xs + (b * nb + blk) * 8)), acc[b], 0x00FF);
        }
    }
    for (int b = 0; b < G; b++) out[b * N] = (add ? out[b * N] : 0.0f) + _mm512_reduce_add_ps(acc[b]);
}
#endif

#define KSUB 64         /* rows of W per sub-piece: its blocks stay in L2 across x's groups */
static int64_t XSPAN[1] = {XSPAN_BYTES};

/* Rows [n0, n1) of W against B rows of x, any B: sub-pieces of KSUB rows of W, each met
 * by every group of KGROUP rows of x, so W is read from memory once per call however
 * long x is (a prefill chunk). A long row (K = 8960: 8 rows of x are 143 KB of int16)
 * is taken in spans of super-blocks whose x fits L1, each span's sums added to the
 * output: with the whole row at once every load of x came from L2 (one core, 8 rows of
 * x, in cache: 6.1 ns per super-block and row against 4.3 at K = 1536). */
static void gemv_k_rows(int code, const uint8_t *restrict qs, int64_t K, int64_t N,
                        const int16_t *restrict xq, const float *restrict xd,
                        const float *restrict xs, int64_t B, float *restrict out,
                        int64_t n0, int64_t n1) {
    const int64_t nb = K / 256, bytes = k_bytes(code);
    for (int64_t s0 = n0; s0 < n1; s0 += KSUB) {
        const int64_t s1 = s0 + KSUB < n1 ? s0 + KSUB : n1;
        for (int64_t b0 = 0; b0 < B; b0 += KGROUP) {
            const int64_t g = B - b0 < KGROUP ? B - b0 : KGROUP;
            const int16_t *xg = xq + b0 * K;
            const float *dg = xd + b0 * nb, *sg = xs + b0 * nb * xs_per(code);
            int64_t span = XSPAN[0] ? XSPAN[0] / (g * 512) : nb;
            span = span < 1 ? 1 : span;
            for (int64_t k0 = 0; k0 < nb; k0 += span) {
                const int64_t k1 = k0 + span < nb ? k0 + span : nb;
                const int add = k0 > 0;
                /* the first group of x meets W from memory: prefetch PF_AHEAD on in
                 * the row, or in spans the same blocks two rows on */
                const int64_t f = b0 > 0 ? 0 : span < nb ? 2 * nb * bytes : PF_AHEAD;
                for (int64_t n = s0; n < s1; n++) {
                    const uint8_t *row = qs + n * nb * bytes;
                    float *o = out + b0 * N + n;
#if defined(PN_ZMM)
                    switch (g) {    /* a constant G each, so the accumulators stay in registers */
                    case 8: k_row512(code, row, nb, k0, k1, K, xg, dg, sg, o, N, f, add, 8); break;
                    case 7: k_row512(code, row, nb, k0, k1, K, xg, dg, sg, o, N, f, add, 7); break;
                    case 6: k_row512(code, row, nb, k0, k1, K, xg, dg, sg, o, N, f, add, 6); break;
                    case 5: k_row512(code, row, nb, k0, k1, K, xg, dg, sg, o, N, f, add, 5); break;
                    case 4: k_row512(code, row, nb, k0, k1, K, xg, dg, sg, o, N, f, add, 4); break;
                    case 3: k_row512(code, row, nb, k0, k1, K, xg, dg, sg, o, N, f, add, 3); break;
                    case 2: k_row512(code, row, nb, k0, k1, K, xg, dg, sg, o, N, f, add, 2); break;
                    default: k_row512(code, row, nb, k0, k1, K, xg, dg, sg, o, N, f, add, 1); break;
                    }
#else
                    const int16_t *x0 = xg;
                    if (g == 8) k_row_avx2(code, row, nb, k0, k1, K, x0, dg, sg, o, N, f, add, 8);
                    else if (g >= 4) {
                        k_row_avx2(code, row, nb, k0, k1, K, x0, dg, sg, o, N, f, add, 4);
                        for (int64_t b = 4; b < g; b++)
                            k_row_avx2(code, row, nb, k0, k1, K, x0 + b * K, dg + b * nb,
                                       sg + b * nb * xs_per(code), o + b * N, N, 0, add, 1);
                    } else if (g >= 2) {
                        k_row_avx2(code, row, nb, k0, k1, K, x0, dg, sg, o, N, f, add, 2);
                        if (g == 3)
                            k_row_avx2(code, row, nb, k0, k1, K, x0 + 2 * K, dg + 2 * nb,
                                       sg + 2 * nb * xs_per(code), o + 2 * N, N, 0, add, 1);
                    } else k_row_avx2(code, row, nb, k0, k1, K, x0, dg, sg, o, N, f, add, 1);
#endif
                }
            }
        }
    }
}


typedef struct {
    int code; const uint8_t *qs; int64_t N, K; const int16_t *xq; const float *xd, *xs;
    int64_t B; float *out; int64_t rows;
} KArgs;

static void k_chunk(const void *p, int64_t c) {
    const KArgs *a = p;
    int64_t n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    gemv_k_rows(a->code, a->qs, a->K, a->N, a->xq, a->xd, a->xs, a->B, a->out, n0, n1);
}

static __thread float *xs16_buf;    /* Q2_K: x's sums per 16 */
static __thread int64_t xs16_cap;

/* out[B, N] = W @ x for the K-quant kinds, x given by pn_quantize_xk; any B. Q2_K's mins
 * (one per 16 values) meet x's sums per 16, made here from xq (xs holds them per 32). */
void pn_gemv_k(int code, const uint8_t *qs, int64_t N, int64_t K, const int16_t *xq,
               const float *xd, const float *xs, int64_t B, float *out) {
    if (code == Q2K) {
        const int64_t nb = K / 256, n = B * nb * 16;
        if (n > xs16_cap) {
            float *nbuf = aligned_alloc(64, (size_t)(n + 15) / 16 * 16 * sizeof(float));
            if (!nbuf) abort();     /* a few KiB: the host is out of memory */
            free(xs16_buf), xs16_buf = nbuf, xs16_cap = n;
        }
        for (int64_t i = 0; i < n; i++) {
            int32_t t = 0;
            for (int k = 0; k < 16; k++) t += xq[16 * i + k];
            xs16_buf[i] = (float)t * xd[i / 16];
        }
        xs = xs16_buf;
    }
    KArgs a = {code, qs, N, K, xq, xd, xs, B, out, piece_rows(N)};
    pool_run(k_chunk, &a, (N + a.rows - 1) / a.rows);
}
#else
void pn_gemv_k(int code, const uint8_t *qs, int64_t N, int64_t K, const int16_t *xq,
               const float *xd, const float *xs, int64_t B, float *out) {}
#endif
