/* amx.c: many rows of x on AMX tiles (Xeons with AMX; PN_AMX builds): W decoded into bf16
 * hi / lo halves, three tile products per 32 k. From 8 rows it beat the integer products
 * (SmolLM2 batch 16: 611-657 tok/s against 334-369; figures below). */
/* -- many rows of x on AMX tiles (the prefill's products) -------------------------------
 * TDPBF16PS adds a 16 x 32 bf16 tile times a 32 x 16 bf16 tile into 16 x 16 fp32 sums.
 * Each float f is split into hi (f with its low 16 bits cleared: exact in bf16) and
 * lo = bf16(f - hi); hi*hi + hi*lo + lo*hi leaves out lo*lo (2^-16 of a product) and lo's
 * rounding (2^-17 of f), so three tile products per 32 k carry the fp32 product to about
 * 2^-16, as close as the integer path's int16 activations. W is the A operand (16 of its
 * rows x 32 k, as dequantized: row-major), x the B operand: pairs of k interleaved across
 * 16 rows, packed once per call. A thread's chunk is 32 rows of W, dequantized once into
 * its own buffers and multiplied by every row of x. */
/* Rows of x from which the tiles beat the integer products (measured on a Xeon with AMX,
 * 2 threads, whole models: `pantheon bench engine`, the threshold moved): a tile of x
 * costs about the same for 1 to 16 rows. SmolLM2 (q4) batch 8: 376-405 tok/s on the
 * tiles against 342-345, batch 16 611-657 against 334-369. Qwen2.5-1.5B (Q4_K / Q6_K, read
 * from memory): batch 4 40 against 46, batch 8 50 against 46, batch 16 83 against 64. */
#define AMX_MIN_ROWS 8           /* q4, q8, f16, bf16 (PnOptions.amx_rows; amx_takes) */
#define AMX_MIN_ROWS_K 8         /* Q4_K, Q6_K (PnOptions.amx_rows_k) */

#if defined(PN_AMX)
extern long syscall(long number, ...);     /* <unistd.h> hides these under -std=c11 */
extern int fork(void);
extern int waitpid(int pid, int *status, int options);
extern void _exit(int status);

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileCfg;

static void amx_config(void) {       /* 8 tiles of 16 rows x 64 bytes */
    TileCfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
}

static int amx_state = -1;          /* -1 not asked yet, 0 refused, 1 granted */

/* Ask the kernel for the tile state (once per process; a kernel before Linux 5.16 or a
 * hypervisor that hides it refuses), then run one tile product in a forked child: where
 * the instructions trap anyway (a virtual machine that lists AMX but does not pass it
 * through), only the child dies and the callers keep the other paths. */
int pn_amx_init(void) {
    if (amx_state >= 0) return amx_state;
    amx_state = 0;
    if (syscall(158 /* arch_prctl */, 0x1023 /* REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0)
        return 0;
    int pid = fork(), status = 0;
    if (pid == 0) {
        amx_config();
        _tile_zero(0); _tile_zero(1); _tile_zero(2);
        _tile_dpbf16ps(0, 1, 2);
        _tile_release();
        _exit(0);
    }
    if (pid > 0 && waitpid(pid, &status, 0) == pid)
        amx_state = (status & 0x7f) == 0 && ((status >> 8) & 0xff) == 0;  /* exited with 0 */
    return amx_state;
}

/* hi and lo bf16 halves of 32 floats, as 16 pairs each */
static inline void split_bf16(__m512 a, __m512 b, __m512i *hi, __m512i *lo) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 ah = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), top));
    __m512 bh = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), top));
    *hi = (__m512i)_mm512_cvtne2ps_pbh(bh, ah);
    *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, bh), _mm512_sub_ps(a, ah));
}

typedef struct {
    const float *x; int64_t M, K; uint32_t *xp; int side;
    float *xs;                      /* or NULL: also x's sums per run of 32, [K / 32][16] */
} PackArgs;

/* x's rows 16g .. 16g+15 (zeros past M) → per 32 k two tiles, hi then lo: tile row p,
 * column m holds the pair (k = 32s + 2p, 32s + 2p + 1) of row 16g + m. `side` (M <= 8,
 * the decode steps' way): one tile, the rows' hi halves in columns 0-7, lo in 8-15. */
static void amx_pack_chunk(const void *p, int64_t g) {
    const PackArgs *a = p;
    const int64_t KS = a->K / 32;
    uint32_t hi[16][16], lo[16][16];
    for (int64_t s = 0; s < KS; s++) {
        for (int m = 0; m < 16; m++) {
            int64_t row = 16 * g + m;
            __m512i h = _mm512_setzero_si512(), l = h;
            float sum = 0.0f;
            if (row < a->M) {
                const float *src = a->x + row * a->K + 32 * s;
                const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
                split_bf16(v0, v1, &h, &l);
                if (a->xs) sum = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
            }
            if (a->xs) a->xs[16 * s + m] = sum;     /* (one group of rows: g = 0) */
            _mm512_storeu_si512(hi[m], h);
            _mm512_storeu_si512(lo[m], l);
        }
        uint32_t *t = a->xp + ((g * KS + s) * 2) * 256;
        if (a->side)                /* 8 rows or fewer: their hi halves, then their lo ones */
            for (int q = 0; q < 16; q++)
                for (int m = 0; m < 8; m++) t[q * 16 + m] = hi[m][q], t[q * 16 + 8 + m] = lo[m][q];
        else
            for (int q = 0; q < 16; q++)
                for (int m = 0; m < 16; m++) t[q * 16 + m] = hi[m][q], t[256 + q * 16 + m] = lo[m][q];
    }
}

typedef struct {
    const PnMat *m; const uint32_t *xp; int64_t M, Mp; float *out;
    const float *xs;                /* Mp == 16: x's sums per run of 32, [K / 32][16] */
    int side;                       /* x's halves side by side in one tile (M <= 8) */
} AmxArgs;

#define AMX_CODES_ROWS 128          /* rows of W per piece of the decode steps' way */
/* the decode steps' way for some kinds (defined with the integer kernels, below) */
static int amx_codes_ok(const PnMat *m);
static void amx_codes_chunk(const void *p, int64_t c);

static __thread float *amx_row;      /* a thread's buffers: one row as floats, 32 rows of */
static __thread uint16_t *amx_w;     /* W as bf16 hi then lo */
static __thread int64_t amx_cap;

static void amx_row_floats(const PnMat *m, int64_t r, float *out) {
    int64_t run = block_of(m->code, m->bs), nb = m->K / run;
    for (int64_t blk = 0; blk < nb; blk++)
        dequant_block(m->code, m->qs, m->sc, m->mn, m->K, run, r, blk, out + blk * run);
}

static inline void store_split(uint16_t *hi, uint16_t *lo, __m512 a, __m512 b) {
    __m512i h, l;
    split_bf16(a, b, &h, &l);
    _mm512_storeu_si512(hi, h);
    _mm512_storeu_si512(lo, l);
}

/* a K-quant super-block's 256 weights as bf16 hi and lo halves (with the integer
 * kernels' decoding, below) */
static void super_bf16(int code, const uint8_t *b, uint16_t *hi, uint16_t *lo);

/* Row r of W as bf16 hi and lo halves: the K-quants, q4 and q8 (runs of 32) decoded in
 * registers; other kinds through a row of floats. */
static void amx_row_bf16(const PnMat *m, int64_t r, float *row, uint16_t *hi, uint16_t *lo) {
    const int64_t K = m->K;
    if (is_k(m->code)) {
        const int64_t nb = K / 256, bytes = k_bytes(m->code);
        for (int64_t blk = 0; blk < nb; blk++)
            super_bf16(m->code, m->qs + (r * nb + blk) * bytes, hi + 256 * blk, lo + 256 * blk);
        return;
    }
    if (m->code == Q4 || ((m->code == Q8 || m->code == Q8M) && m->bs == 32)) {
        const int64_t nb = K / 32;
        for (int64_t blk = 0; blk < nb; blk++) {
            const __m512 s = _mm512_set1_ps(half_to_float(m->sc[r * nb + blk]));
            const __m512 mn = _mm512_set1_ps(m->code == Q8 ? 0.0f : half_to_float(m->mn[r * nb + blk]));
            __m512 a, b;
            if (m->code == Q4) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(m->qs + r * (K / 2) + 16 * blk));
                const __m128i low4 = _mm_set1_epi8(15);
                a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
                b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
            } else {
                const int8_t *q = (const int8_t *)m->qs + r * K + 32 * blk;
                a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
                b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
            }
            store_split(hi + 32 * blk, lo + 32 * blk, _mm512_fmadd_ps(a, s, mn), _mm512_fmadd_ps(b, s, mn));
        }
        return;
    }
    amx_row_floats(m, r, row);
    for (int64_t k = 0; k < K; k += 32)
        store_split(hi + k, lo + k, _mm512_load_ps(row + k), _mm512_load_ps(row + k + 16));
}

static void amx_chunk(const void *p, int64_t c) {
    const AmxArgs *a = p;
    const PnMat *m = a->m;
    const int64_t K = m->K, KS = K / 32, N = m->N, n0 = 32 * c;
    if (amx_cap < K) {
        free(amx_row), free(amx_w);
        amx_row = aligned_alloc(64, (size_t)K * 4);
        amx_w = aligned_alloc(64, (size_t)K * 2 * 64);
        amx_cap = amx_row && amx_w ? K : 0;
        if (!amx_cap) abort();      /* a few MiB at most: the host is out of memory */
    }
    uint16_t *whi = amx_w, *wlo = amx_w + 32 * K;
    for (int r = 0; r < 32; r++)
        if (n0 + r < N) amx_row_bf16(m, n0 + r, amx_row, whi + r * K, wlo + r * K);
        else memset(whi + r * K, 0, (size_t)K * 2), memset(wlo + r * K, 0, (size_t)K * 2);
    amx_config();
    float tile[4][16][16];
    const int64_t wstride = K * 2, tb = 256;   /* bytes per W row; uint32 per x tile */
    if (a->Mp == 16) {              /* one tile of x's rows (a decode step): W's two tiles */
        _tile_zero(0); _tile_zero(1);
        for (int64_t s = 0; s < KS; s++) {
            const uint32_t *h0 = a->xp + 2 * s * tb;
            _tile_loadd(2, h0, 64);
            _tile_loadd(3, h0 + tb, 64);
            _tile_loadd(4, whi + 32 * s, wstride);
            _tile_loadd(5, whi + 16 * K + 32 * s, wstride);
            _tile_loadd(6, wlo + 32 * s, wstride);
            _tile_loadd(7, wlo + 16 * K + 32 * s, wstride);
            _tile_dpbf16ps(0, 4, 2); _tile_dpbf16ps(1, 5, 2);
            _tile_dpbf16ps(0, 4, 3); _tile_dpbf16ps(1, 5, 3);
            _tile_dpbf16ps(0, 6, 2); _tile_dpbf16ps(1, 7, 2);
        }
        _tile_stored(0, tile[0], 64); _tile_stored(1, tile[1], 64);
        for (int t = 0; t < 2; t++) {
            const int64_t nb = n0 + 16 * t;
            for (int j = 0; j < a->M; j++) {
                float *o = a->out + j * N + nb;
                for (int i = 0; i < 16 && nb + i < N; i++) o[i] = tile[t][i][j];
            }
        }
        return;
    }
    for (int64_t g = 0; g < a->Mp / 16; g += 2) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        const uint32_t *x0 = a->xp + g * KS * 2 * tb, *x1 = x0 + KS * 2 * tb;
        for (int64_t s = 0; s < KS; s++) {
            const uint32_t *h0 = x0 + 2 * s * tb, *h1 = x1 + 2 * s * tb;
            /* the four sums tiles += W's two tiles (4, 5) x x's two (6, 7) */
#define QUAD() do { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); \
                     _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); } while (0)
            _tile_loadd(4, whi + 32 * s, wstride);
            _tile_loadd(5, whi + 16 * K + 32 * s, wstride);
            _tile_loadd(6, h0, 64);
            _tile_loadd(7, h1, 64);
            QUAD();                                 /* hi x hi */
            _tile_loadd(6, h0 + tb, 64);
            _tile_loadd(7, h1 + tb, 64);
            QUAD();                                 /* hi x lo */
            _tile_loadd(4, wlo + 32 * s, wstride);
            _tile_loadd(5, wlo + 16 * K + 32 * s, wstride);
            _tile_loadd(6, h0, 64);
            _tile_loadd(7, h1, 64);
            QUAD();                                 /* lo x hi */
#undef QUAD
        }
        _tile_stored(0, tile[0], 64); _tile_stored(1, tile[1], 64);
        _tile_stored(2, tile[2], 64); _tile_stored(3, tile[3], 64);
        for (int t = 0; t < 4; t++) {              /* tile t: rows n of W, columns m of x */
            const int64_t nb = n0 + 16 * (t >> 1), mb = 16 * (g + (t & 1));
            for (int j = 0; j < 16 && mb + j < a->M; j++) {
                float *o = a->out + (mb + j) * N + nb;
                for (int i = 0; i < 16 && nb + i < N; i++) o[i] = tile[t][i][j];
            }
        }
    }
}

static __thread uint32_t *amx_xp;   /* the calling thread's packing of x, and its sums */
static __thread int64_t amx_xp_cap, amx_xs_cap;
static __thread float *amx_xs;

/* out[M, N] = x[M, K] @ W.T on AMX tiles; 0 where they do not apply (no tiles granted,
 * K not in runs of 32, or memory for x's packing refused): the caller takes another path. */
int pn_matmul_amx(const PnMat *m, const float *x, int64_t M, float *out) {
    const Span_ *next = tl_next;    /* what the pool's idle threads fetch during the product */
    tl_next = NULL;
    if (pn_amx_init() != 1 || m->K % 32 || M < 1) return tl_next = next, 0;
    const int64_t Mp = M <= 16 ? 16 : (M + 31) / 32 * 32, need = Mp * m->K * 2;  /* words */
    if (need > amx_xp_cap) {
        free(amx_xp);
        amx_xp = aligned_alloc(64, (size_t)need * 4);
        amx_xp_cap = amx_xp ? need : 0;
        if (!amx_xp) return tl_next = next, 0;
    }
    if (Mp == 16 && amx_codes_ok(m) && m->K / 2 > amx_xs_cap) {
        free(amx_xs);
        amx_xs = aligned_alloc(64, (size_t)m->K / 2 * 4);
        amx_xs_cap = amx_xs ? m->K / 2 : 0;
        if (!amx_xs) return tl_next = next, 0;
    }
    const int codes = Mp == 16 && amx_codes_ok(m), side = codes && M <= 8;
    PackArgs pa = {x, M, m->K, amx_xp, side, codes ? amx_xs : NULL};
    pool_run_next(amx_pack_chunk, &pa, Mp / 16, NULL);
    AmxArgs a = {m, amx_xp, M, Mp, out, pa.xs, side};
    if (codes) {
        pool_run_next(amx_codes_chunk, &a, (m->N + AMX_CODES_ROWS - 1) / AMX_CODES_ROWS, next);
        return 1;
    }
    pool_run_next(amx_chunk, &a, (m->N + 31) / 32, next);
    return 1;
}
int pn_has_amx(void) { return pn_amx_init(); }

static int64_t amx_min_rows = AMX_MIN_ROWS, amx_min_rows_k = AMX_MIN_ROWS_K;
static inline int amx_takes(const PnMat *m, int64_t B) {
    const int64_t from = is_k(m->code) ? amx_min_rows_k : amx_min_rows;
    /* Q2_K (mins per 16) stays with the integer products: super_bf16 takes mins per 32 */
    return from > 0 && B >= from && m->K % 32 == 0 && m->code != Q2K && pn_amx_init() == 1;
}
#else
int pn_amx_init(void) { return 0; }
int pn_has_amx(void) { return 0; }
int pn_matmul_amx(const PnMat *m, const float *x, int64_t M, float *out) { return 0; }
#endif
