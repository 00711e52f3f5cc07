/* plan.c: which product runs (pn_plan: the one place that decides; kernels_cpu.plan and
 * the C decode layer ask it) and running it (pn_matmul_int, one ctypes call per product:
 * 12.9 -> 5 us per call against three calls), with the next matrix's first rows handed to
 * the pool's idle threads to fetch. */
#if defined(__AVX2__)
/* -- one call per product (kernels_cpu.matmul): a matrix's fixed arguments travel as one
 * struct, its scratch as another, so a decode step's hundred-odd products cost one
 * ctypes call each instead of three (12.9 -> 5 us per call measured on a tiny q4 matrix,
 * most of it argument conversion) */

#define NEXT_BYTES (512 << 10)      /* of the next matrix, fetched between products */

/* Q4_K at batch 1 through int8 digits (0: the int16 path, which tests compare it with) */
static int DIGITS[1] = {1};


/* The leading part of m's arrays (what the first rows need), as fetch spans. */
static void next_spans(const PnMat *m, Span_ out[3]) {
    const int64_t row = is_k(m->code) ? m->K / 256 * k_bytes(m->code)
                      : m->code == Q4 || m->code == IQ4NL ? m->K / 2 : m->code == F16 || m->code == BF16 ? 2 * m->K : m->K;
    int64_t rows = NEXT_BYTES / (row > 0 ? row : 1);
    rows = rows < m->N ? rows : m->N;
    const int64_t scales = is_k(m->code) || m->sc == NULL ? 0 : rows * (m->K / m->bs) * 2;
    out[0] = (Span_){(const char *)m->qs, rows * row};
    out[1] = (Span_){(const char *)m->sc, scales};
    out[2] = (Span_){(const char *)m->mn, m->mn == m->sc ? 0 : scales};
}


/* Which kernel multiplies m by B rows of x: the one place that decides (pn_matmul_int
 * runs it, pn_int_ok and kernels_cpu.plan ask it). PLAN_NONE: no integer product
 * applies, and the caller takes the float paths (gemv, or dequantized tiles and BLAS). */
enum {
    PLAN_NONE = 0,
    PLAN_AMX,           /* AMX tiles (8 or more rows; AVX-512 builds with the tile state) */
    PLAN_DIGITS,        /* batch-1 K-quants through int8 digits of the int16 activations */
    PLAN_X8,            /* batch-1 K-quants through int8 activations (act8, AVX2 builds) */
    PLAN_K_LANES,       /* K-quants, 13+ rows: tokens across the lanes (AVX-512 VNNI) */
    PLAN_K_ROWS,        /* K-quants: the int16 row kernels, 8 rows of x a pass */
    PLAN_B_LANES,       /* blocks of 32, 11+ rows: tokens across the lanes (AVX-512 VNNI) */
    PLAN_B_ROWS,        /* blocks of 32, up to MAXB rows: the int16 row kernels */
    PLAN_B_GROUPS,      /* blocks of 32, BG_MIN_ROWS+ rows, 256-bit builds: W's rows across lanes */
    PLAN_X8_ROWS,       /* K-quants, 2+ rows, int8 activations (act8, AVX2 builds) */
};

static int64_t BG_MIN[1] = {BG_MIN_ROWS};

int pn_plan(const PnMat *m, int64_t B) {
#if defined(PN_AMX)
    if (amx_takes(m, B)) return PLAN_AMX;
#endif
#if defined(PN_ZMM)
    if (B == 1 && DIGITS[0] && (m->code == Q4K || m->code == Q5K || m->code == Q6K ||
                                m->code == Q3K || m->code == Q2K))
        return PLAN_DIGITS;
#else
    if (m->act8 && (m->code == Q4K || m->code == Q5K || m->code == Q6K || m->code == IQ4XS))
        return B == 1 ? PLAN_X8 : PLAN_X8_ROWS;
    if (B == 1 && DIGITS[0] && (m->code == Q4K || m->code == Q5K || m->code == Q6K))
        return PLAN_DIGITS;
#endif
    if (is_k(m->code)) {
#if defined(PN_ZMM)
        if (KTILE_MIN[0] > 0 && B >= KTILE_MIN[0] && m->code != Q2K) return PLAN_K_LANES;
#endif
        return PLAN_K_ROWS;
    }
#if defined(PN_ZMM)
    if (blocks32(m) && KTILE_MIN[1] > 0 && B >= KTILE_MIN[1]) return PLAN_B_LANES;
#else
    if (blocks32(m) && BG_MIN[0] > 0 && B >= BG_MIN[0]) return PLAN_B_GROUPS;
#endif
    if (i8_kind(m->code) && B <= MAXB && m->K / m->bs <= MAX_RUNS) return PLAN_B_ROWS;
    return PLAN_NONE;
}

/* batch-1 K-quants through the digits (0 where a scratch buffer cannot be had) */
static int digits_product(const PnMat *m, const float *x, const PnScratch *s, float *out) {
#if defined(PN_ZMM)
    if (m->code == Q4K || m->code == Q5K) {
        quantize_digits(x, m->K, (int8_t *)s->xq, s->xd, s->xs, DIGIT_ORDER, NULL);
        DgArgs a = {m->qs, m->N, m->K, (const int8_t *)s->xq, s->xd, s->xs, out, piece_rows(m->N), NULL};
        pool_run(m->code == Q4K ? q4k_digits_chunk : q5k_digits_chunk, &a, (m->N + a.rows - 1) / a.rows);
        return 1;
    }
    if (m->K / 16 > dg_sums_cap) {     /* 64-byte aligned: read 16 at a time */
        int32_t *nb = aligned_alloc(64, sizeof(int32_t) * (size_t)((m->K / 16 + 15) / 16 * 16));
        if (!nb) return 0;
        free(dg_sums), dg_sums = nb, dg_sums_cap = m->K / 16;
    }
    quantize_digits(x, m->K, (int8_t *)s->xq, s->xd, s->xs, NATURAL_ORDER, dg_sums);
    DgArgs a = {m->qs, m->N, m->K, (const int8_t *)s->xq, s->xd, s->xs, out,
                piece_rows(m->N), dg_sums};
    pool_run(m->code == Q6K ? q6k_digits_chunk : m->code == Q3K ? q3k_digits_chunk
             : q2k_digits_chunk, &a, (m->N + a.rows - 1) / a.rows);
    return 1;
#else
    return m->code == Q6K ? q6k_digits2(m, x, s, out) : k45_digits2(m, x, s, out);
#endif
}

/* out[B, N] = x @ W.T through the integer product pn_plan picks; 0 where none applies
 * (the caller then takes another path). A plan whose scratch cannot be had falls back
 * to the row kernels, which need none. */
int pn_matmul_int(const PnMat *m, const float *x, int64_t B, const PnScratch *s, float *out) {
    const int plan = pn_plan(m, B);
    if (plan == PLAN_NONE) return 0;
    Span_ next[3];
    if (m->next) {
        next_spans(m->next, next);
        tl_next = next;             /* read by the pool_run below, on this thread */
    }
    switch (plan) {
#if defined(PN_AMX)
    case PLAN_AMX:
        if (pn_matmul_amx(m, x, B, out)) return 1;
        break;
#endif
    case PLAN_DIGITS:
        if (digits_product(m, x, s, out)) return 1;
        break;
#if !defined(PN_ZMM)
    case PLAN_X8:
        if (x8_product(m, x, s, out)) return 1;
        break;
    case PLAN_X8_ROWS:
        if (x8_rows_product(m, x, B, s, out)) return 1;
        break;
#endif
#if defined(PN_ZMM)
    case PLAN_K_LANES:
        pn_quantize_xk(x, B, m->K, s->xq, s->xd, s->xs);
        gemm_k_tiled(m->code, m->qs, m->N, m->K, s->xq, s->xd, s->xs, B, out);
        return 1;
    case PLAN_B_LANES:
        gemm_b_tiled(m, x, B, s, out);
        return 1;
#else
    case PLAN_B_GROUPS:
        gemm_b_groups(m, x, B, s, out);
        return 1;
#endif
    default:
        break;
    }
    if (is_k(m->code)) {            /* PLAN_K_ROWS, or a plan above that could not run */
        pn_quantize_xk(x, B, m->K, s->xq, s->xd, s->xs);
        pn_gemv_k(m->code, m->qs, m->N, m->K, s->xq, s->xd, s->xs, B, out);
        return 1;
    }
    if (i8_kind(m->code) && B <= MAXB && m->K / m->bs <= MAX_RUNS) {
        pn_quantize_x(x, B, m->K, s->xq, s->xd, s->xs, pn_pairs_x(m->code, m->bs, B));
        pn_gemv_i8(m->code, m->qs, m->sc, m->mn, m->N, m->K, m->bs, s->xq, s->xd, s->xs, B, out);
        return 1;
    }
    tl_next = NULL;
    return 0;
}

/* whether pn_matmul_int takes m at B rows (asked before a step: the C decode layer) */
int pn_int_ok(const PnMat *m, int64_t B) { return pn_plan(m, B) != PLAN_NONE; }

int pn_has_i8(void) { return 1; }
#else
int pn_has_i8(void) { return 0; }
int pn_int_ok(const PnMat *m, int64_t B) { return 0; }
int pn_plan(const PnMat *m, int64_t B) { (void)m; (void)B; return 0; }
int pn_matmul_int(const PnMat *m, const float *x, int64_t B, const PnScratch *s, float *out) { return 0; }
#endif
