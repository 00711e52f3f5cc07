/* x8.c: batch-1 K-quants through int8 activations (`--activations int8`, a matrix's act8;
 * AVX2 builds without AVX-512): half the multiply work of int16 where a model's accuracy
 * allows it (a step per run of 32: KL 0.0018 against int16 on Qwen2.5-Coder-1.5B, where
 * a step per 256 fell to top-1 90 %); worker/activations.py measures it per model. */
#if defined(__AVX2__) && !defined(PN_ZMM)
/* -- int8 activations (`--activations int8`, a matrix's act8): at batch 1 x is held as
 * int8 values q (|q| <= 127) in runs of 32, each run with its own integer step s (1 .. 63)
 * of the super-block's unit D = max |x| / (127 x 63): x ~ D s q. A run's step follows its
 * own largest value (as llama.cpp's q8_0 blocks of 32; one step per 256, its q8_K, lost
 * the small values of a run beside an outlier: Qwen2.5-1.5B top-1 90 %), yet it is an
 * integer that joins the weights' sub-scale in the same `vpmaddwd`: one digit meets the
 * weights' bytes, per 64 values 4 multiplies (2 `vpmaddubsw`, 2 `vpmaddwd`) against the
 * two digits' 8. Whether a model stays within the accuracy bound with it is measured per
 * model (worker/activations.py), not assumed. */
static __thread int16_t *x8_steps;
static __thread int64_t x8_steps_cap;

/* x [K] → x8, steps [K/32] (s), xd [K/256] (D), xs [K/32] (each run's sum times D s: the
 * mins' term); rounding half away from zero, as pn_quantize_xk */
static void quantize_x8(const float *x, int64_t K, int8_t *x8, int16_t *steps, float *xd,
                        float *xs) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 half = _mm256_set1_ps(0.5f), lim = _mm256_set1_ps(127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t blk = 0; blk < K / 256; blk++) {
        const float *v = x + blk * 256;
        float amax[8], top = 0.0f;
        for (int j = 0; j < 8; j++) {
            __m256 m = _mm256_setzero_ps();
            for (int i = 0; i < 32; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(v + 32 * j + i), absmask));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            amax[j] = _mm_cvtss_f32(m4);
            top = amax[j] > top ? amax[j] : top;
        }
        const float D = top / 16129.0f;
        for (int j = 0; j < 8; j++) {
            int st = D > 0 ? (int)ceilf(amax[j] / (D * 127.0f)) : 1;
            st = st < 1 ? 1 : st > 127 ? 127 : st;
            const float step = D * (float)st, inv = D > 0 ? 1.0f / step : 0.0f;
            const __m256 vinv = _mm256_set1_ps(inv);
            __m256i iv[4], tot = _mm256_setzero_si256();
            for (int h = 0; h < 4; h++) {
                __m256 r = _mm256_mul_ps(_mm256_loadu_ps(v + 32 * j + 8 * h), vinv);
                r = _mm256_add_ps(r, _mm256_or_ps(_mm256_and_ps(r, sign), half));
                r = _mm256_max_ps(_mm256_min_ps(r, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
                iv[h] = _mm256_cvttps_epi32(r);
                tot = _mm256_add_epi32(tot, iv[h]);
            }
            /* packs work within 128-bit lanes: 4-byte groups come out a0 b0 c0 d0 a1 b1 c1 d1 */
            const __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                                  _mm256_packs_epi32(iv[2], iv[3]));
            _mm256_storeu_si256((__m256i *)(x8 + blk * 256 + 32 * j),
                                _mm256_permutevar8x32_epi32(b8, order));
            __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(tot), _mm256_extracti128_si256(tot, 1));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
            xs[blk * 8 + j] = (float)_mm_cvtsi128_si32(t4) * step;
            steps[blk * 8 + j] = (int16_t)st;
        }
        xd[blk] = D;
    }
}

/* w's 32 bytes against 32 int8 values of x under one int16 scale (in every lane of sl) */
static inline __m256i x8_pair(__m256i w, const int8_t *x, __m256i sl) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)x)), sl);
}

typedef struct {
    int code; const uint8_t *qs; int64_t N, K; const int8_t *x8; const int16_t *steps;
    const float *xd, *xs;           /* Q6_K: xs per 16, the -32 offset's term */
    float *out; int64_t rows;
} X8Args;

/* Q4_K / Q5_K: k45_digits2_chunk with one digit (pairs at most 2 x 31 x 127, times a
 * combined scale of at most 63 x 63; a lane sums 32 values a super-block: 32 x 31 x 127
 * x 3969 < 2^31) */
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
            const int8_t *xb = a->x8 + blk * 256;
            const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
            /* the weights' sub-scale times x's step, per run of 32 (at most 63 x 63) */
            const __m256i S = _mm256_broadcastsi128_si256(_mm_mullo_epi16(
                _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sm)),
                _mm_loadu_si128((const __m128i *)(a->steps + blk * 8))));
            __m256i ci = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                __m256i lo, hi;
                k45_values(b, five, qh, t, &lo, &hi);
                ci = _mm256_add_epi32(ci, _mm256_add_epi32(x8_pair(lo, xb + 64 * t, one_scale(S, 2 * t)),
                                                           x8_pair(hi, xb + 64 * t + 32, one_scale(S, 2 * t + 1))));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ci), _mm256_set1_ps(half_to_float(load_u16(b)) * a->xd[blk]), acc);
            accm = _mm256_fmadd_ps(mf, _mm256_loadu_ps(a->xs + blk * 8), accm);
        }
        a->out[n] = hsum(_mm256_add_ps(acc, accm));
    }
}

/* Q6_K: q6k_digits2_chunk with one digit (pairs at most 2 x 63 x 127, times a combined
 * scale of at most 128 x 63; each half's sums go to floats on their own, a lane then
 * summing 16 values: 16 x 63 x 127 x 8064 < 2^31) */
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
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = half_to_float(load_u16(b + 208));
            const int8_t *xb = a->x8 + blk * 256;
            const __m128i s8 = _mm_loadu_si128((const __m128i *)sc);
            /* each run of 16's scale times its run of 32's step (at most 128 x 63) */
            const __m128i st = _mm_loadu_si128((const __m128i *)(a->steps + blk * 8));
            const __m256i S16 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(s8), _mm256_setr_m128i(
                _mm_unpacklo_epi16(st, st), _mm_unpackhi_epi16(st, st)));
            const __m256i Sh[2] = {_mm256_permute2x128_si256(S16, S16, 0x00),
                                   _mm256_permute2x128_si256(S16, S16, 0x11)};
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m256i ci = _mm256_setzero_si256();
#pragma GCC unroll 2
                for (int up = 0; up < 2; up++) {
                    const int t = 2 * h + up;
                    __m256i r0, r1;
                    q6k_values(b, t, &r0, &r1);
                    ci = _mm256_add_epi32(ci, _mm256_add_epi32(
                        x8_pair(r0, xb + 64 * t, run_scales(Sh[h], 2 * t)),
                        x8_pair(r1, xb + 64 * t + 32, run_scales(Sh[h], 2 * t + 1))));
                }
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ci), _mm256_set1_ps(d * a->xd[blk]), acc);
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

/* a Q4_K, Q5_K or Q6_K product at batch 1 with int8 activations; 0 where the buffers
 * cannot be had (the caller then takes the int16 path) */
static int x8_product(const PnMat *m, const float *x, const PnScratch *s, float *out) {
    const int64_t K = m->K;
    if (K > dg2_cap) {
        int8_t *nbuf = aligned_alloc(64, (size_t)(K + 63) / 64 * 64);
        if (!nbuf) return 0;
        free(dg2_buf), dg2_buf = nbuf, dg2_cap = K;
    }
    if (K / 32 > x8_steps_cap) {
        int16_t *nbuf = aligned_alloc(64, (size_t)(K / 32 * 2 + 63) / 64 * 64);
        if (!nbuf) return 0;
        free(x8_steps), x8_steps = nbuf, x8_steps_cap = K / 32;
    }
    if (m->code == Q6K && K / 16 > xs16_dg_cap) {
        float *nbuf = aligned_alloc(64, (size_t)(K / 16 + 15) / 16 * 16 * sizeof(float));
        if (!nbuf) return 0;
        free(xs16_dg), xs16_dg = nbuf, xs16_dg_cap = K / 16;
    }
    quantize_x8(x, K, dg2_buf, x8_steps, s->xd, s->xs);
    const float *xs = s->xs;
    if (m->code == Q6K) {
        for (int64_t r = 0; r < K / 16; r++) {      /* -32 x each run's sum, in x's units */
            int32_t t = 0;
            for (int i = 0; i < 16; i++) t += dg2_buf[16 * r + i];
            xs16_dg[r] = -32.0f * (float)t * s->xd[r / 16] * (float)x8_steps[r / 2];
        }
        xs = xs16_dg;
    }
    X8Args a = {m->code, m->qs, m->N, K, dg2_buf, x8_steps, s->xd, xs, out, piece_rows(m->N)};
    pool_run(m->code == Q6K ? q6k_x8_chunk : k45_x8_chunk, &a, (m->N + a.rows - 1) / a.rows);
    return 1;
}
int pn_has_x8(void) { return 1; }
#else
int pn_has_x8(void) { return 0; }   /* AVX-512 builds: their two-digit VNNI products */
#endif
