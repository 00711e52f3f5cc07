/* floats.c: the float paths' entry points — pn_gemv (fp32 products of up to MAXB rows,
 * the kinds no integer product takes), pn_dequant_rows (the prefill tiles that
 * kernels_cpu multiplies with a one-thread BLAS) and pn_gather (the embedding lookup). */
typedef struct {
    int code; const uint8_t *qs; const uint16_t *sc, *mn; int64_t N, K, bs;
    const float *x; int64_t B; float *out; int64_t rows;
} GemvArgs;

static void gemv_chunk(const void *p, int64_t c) {
    const GemvArgs *a = p;
    int64_t n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    if (a->B == 1) gemv1_rows(a->code, a->qs, a->sc, a->mn, a->K, a->bs, a->N, a->x, a->out, n0, n1);
    else gemv_rows(a->code, a->qs, a->sc, a->mn, a->K, a->bs, a->N, a->x, a->B, a->out, n0, n1);
}

/* out[B, N] = x[B, K] @ W.T, B <= MAXB. Rows of W are split over the pool. */
void pn_gemv(int code, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
             int64_t N, int64_t K, int64_t bs, const float *x, int64_t B, float *out) {
    GemvArgs a = {code, qs, sc, mn, N, K, bs, x, B, out, piece_rows(N)};
    pool_run(gemv_chunk, &a, (N + a.rows - 1) / a.rows);
}

typedef struct {
    int code; const uint8_t *qs; const uint16_t *sc, *mn; int64_t K, bs, r0, r1; float *out;
} DequantArgs;

/* rows [r0 + 16 c, r0 + 16 c + 16) of a DequantArgs */
static void dequant_chunk(const void *p, int64_t c) {
    const DequantArgs *a = p;
    const int64_t run = block_of(a->code, a->bs), nb = a->K / run;
    const int64_t lo = a->r0 + 16 * c, hi = lo + 16 < a->r1 ? lo + 16 : a->r1;
    for (int64_t r = lo; r < hi; r++)
        if (is_k(a->code)) dequant_k_row(a->code, a->qs, a->K, r, a->out + (r - a->r0) * a->K);
        else for (int64_t blk = 0; blk < nb; blk++)
            dequant_block(a->code, a->qs, a->sc, a->mn, a->K, run, r, blk,
                          a->out + (r - a->r0) * a->K + blk * run);
}

/* out[r1 - r0, K] = rows [r0, r1) of W as floats (the tile of the prefill path): on the
 * calling thread (threads == 1: the tile threads each dequantize their own), else over
 * the kernels' pool */
void pn_dequant_rows(int code, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                     int64_t K, int64_t bs, int64_t r0, int64_t r1, float *out, int threads) {
    const DequantArgs a = {code, qs, sc, mn, K, bs, r0, r1, out};
    const int64_t n = (r1 - r0 + 15) / 16;
    if (threads == 1)
        for (int64_t c = 0; c < n; c++) dequant_chunk(&a, c);
    else
        pool_run(dequant_chunk, &a, n);
}

/* out[T, K] = rows ids[0..T) of W (the embedding lookup). */
void pn_gather(int code, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
               int64_t K, int64_t bs, const int64_t *ids, int64_t T, float *out) {
    int64_t run = block_of(code, bs), nb = K / run;
    for (int64_t t = 0; t < T; t++)
        if (is_k(code)) dequant_k_row(code, qs, K, ids[t], out + t * K);
        else for (int64_t blk = 0; blk < nb; blk++)
            dequant_block(code, qs, sc, mn, K, run, ids[t], blk, out + t * K + blk * run);
}
