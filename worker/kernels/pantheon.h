/* pantheon.h: what the CPU kernels export (worker/kernels_cpu.py loads them with ctypes).
 *
 * The shared structs and every exported pn_* function. The ctypes declarations are read
 * from this file (worker/kernels_header.py: the prototypes below, and the structs'
 * fields), so keep to what that reader knows: int, int32_t, int64_t, float, pointers,
 * fixed arrays, and these structs. Every .c file of this folder is part of one translation
 * unit (pantheon.c), which includes this header first: a definition that disagrees with
 * its prototype here does not compile. Each ISA build defines every function (the
 * paths a build lacks answer 0 or do nothing: kernels_cpu asks pn_plan / pn_has_* first).
 */
#ifndef PANTHEON_H
#define PANTHEON_H
#include <stdint.h>

/* -- structs ---------------------------------------------------------------------------- */

/* Options set at init (pn_init, options.c): a negative value takes the build's default
 * (the figures behind each sit beside the code that reads it); 0 turns a path off. Tests
 * and benchmarks re-init with others (kernels_cpu.options). */
typedef struct PnOptions {
    int64_t threads;        /* the pool's threads, the caller included (started by the
                               first pn_init; later calls keep the pool as it is) */
    int64_t spin_us;        /* how long idle pool threads spin before they sleep */
    int64_t amx_rows;       /* products of q4 / q8 / f16 / bf16 from this many rows of x
                               take the AMX tiles (amx.c: AMX_MIN_ROWS) */
    int64_t amx_rows_k;     /* the same for the K-quants (AMX_MIN_ROWS_K) */
    int64_t ktile_k;        /* K-quant products from this many rows take the token lanes
                               (lanes.c, AVX-512 builds: KTILE_K) */
    int64_t ktile_b;        /* blocks-of-32 products: the same (KTILE_B) */
    int64_t bgroups;        /* blocks-of-32 products from this many rows take the b_groups
                               (b_groups.c, 256-bit builds: BG_MIN_ROWS) */
    int64_t xspan;          /* bytes of a group's int16 x per pass of the K-quant row
                               kernels (k_rows.c: XSPAN_BYTES; 0: whole rows) */
    int32_t digits;         /* batch-1 K-quants through int8 digits (digits.c,
                               digits_avx2.c; 0: the int16 row kernels; default on) */
    int32_t attn_generic;   /* 1: the portable attention loops for every head size
                               (attention.c; tests compare them; default off) */
} PnOptions;

/* a matrix and a scratch as pn_matmul_int takes them (kernels_cpu._CMat, _CScratch);
 * act8: its products at batch 1 take int8 activations where this build has them */
typedef struct PnMat {
    int32_t code, act8; const uint8_t *qs; const uint16_t *sc, *mn; int64_t N, K, bs;
    const struct PnMat *next;       /* the matrix the forward multiplies by next, or NULL */
} PnMat;
/* x quantized: xq [B, K], xd and xs [B, K/32] */
typedef struct PnScratch { int16_t *xq; float *xd, *xs; } PnScratch;

/* a decode step's layer (layer.c; worker/layers/decode_cpu.py fills them) */
typedef struct PnLayer {
    const PnMat *qkv[3], *o[3], *gu[3], *down[3];
    const float *bqkv, *norm1, *norm2, *q_norm, *k_norm;   /* bqkv, q/k norms: or NULL */
    float eps, scale;
    int64_t D, Hq, Hkv, hd, d_ff, half;
    void *K, *V; int64_t ctx, kv16;                        /* caches; kv16: their types, k | v << 2 */
    /* the spec's flags (0 / NULL: a llama block) */
    const float *post1, *post2;       /* post-mixer / post-MLP norms (Gemma 3) */
    int64_t gelu;                     /* the MLP's gate: 0 SiLU, 1 tanh-GELU */
    int64_t gated;                    /* q rows per head are [query | gate]: out * sigmoid(gate) */
    int64_t mixer;                    /* 0 attention, 1 Gated DeltaNet (the fields below) */
    const PnMat *ba[3];               /* [beta | alpha] rows */
    const float *conv, *dt, *a, *ssm_norm;     /* [C, kconv], [nv], [nv], [dv] */
    float *conv_state, *ssm_state;    /* [slots, kconv - 1, C], [slots, nv, dk, dv] */
    int64_t nk, nv, dk, dv, kconv, tiled;      /* tiled: value head h reads key head h % nk */
    const float *ba_dense;            /* or [D, 2 nv] floats ([in, out]: a file's F32 rows) */
} PnLayer;

typedef struct PnStep {            /* one step: its queries and scratch rows */
    int64_t B; const int64_t *slots, *last;
    float *h, *qkv, *part, *qn, *kn, *qr, *kr, *attn, *y, *gu, *act;
    PnScratch s;
    float *ba, *conv;                                      /* DeltaNet: [B, 2 nv], [B, C] */
} PnStep;

#endif /* PANTHEON_H */

/* The prototypes. pantheon.c includes this header twice: for the structs before its
 * parts (PN_TYPES_ONLY), and whole after them, where each prototype meets the definition
 * above it (a disagreement does not compile). Declared first, they changed the order in
 * which GCC meets the functions, and with it the register allocation of the largest
 * inlined kernel (gemv_k_rows, k_rows.c: 1.3x slower at 5 rows of x, measured); after
 * the parts, every function compiles to the instructions of the single-file build. */
#if !defined(PN_TYPES_ONLY) && !defined(PANTHEON_H_FUNCTIONS)
#define PANTHEON_H_FUNCTIONS
/* -- setup (pool.c, options.c) ---------------------------------------------------------- */
int pn_init(const PnOptions *options);      /* returns the pool's threads, caller included */
int pn_pool_init(int threads, int64_t spin_us);   /* pn_init's: starts the pool once */
int pn_max_rows(void);                      /* MAXB: rows of x per pass of the row kernels */

/* -- what this build has ---------------------------------------------------------------- */
int pn_has_i8(void);                        /* the integer products (AVX2 builds) */
int pn_has_x8(void);                        /* int8-activation products (256-bit builds) */
int pn_has_lanes(void);                     /* the token lanes (AVX-512 VNNI builds) */
int pn_has_amx(void);                       /* AMX tiles, and the kernel grants them */
int pn_amx_init(void);
int pn_has_repack(void);

/* -- one product: the plan, and running it (plan.c) ------------------------------------- */
int pn_plan(const PnMat *m, int64_t B);
int pn_int_ok(const PnMat *m, int64_t B);
int pn_matmul_int(const PnMat *m, const float *x, int64_t B, const PnScratch *s, float *out);
int pn_matmul_amx(const PnMat *m, const float *x, int64_t M, float *out);

/* -- the integer products' parts (rows.c, k_widen.c, k_rows.c) -------------------------- */
void pn_quantize_x(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd, float *xs,
                   int paired);
int pn_pairs_x(int code, int64_t bs, int64_t B);
void pn_gemv_i8(int code, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                int64_t N, int64_t K, int64_t bs, const int16_t *xq, const float *xd,
                const float *xs, int64_t B, float *out);
void pn_quantize_xk(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd, float *xs);
void pn_gemv_k(int code, const uint8_t *qs, int64_t N, int64_t K, const int16_t *xq,
               const float *xd, const float *xs, int64_t B, float *out);

/* -- float paths (floats.c) ------------------------------------------------------------- */
void pn_gemv(int code, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
             int64_t N, int64_t K, int64_t bs, const float *x, int64_t B, float *out);
void pn_dequant_rows(int code, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                     int64_t K, int64_t bs, int64_t r0, int64_t r1, float *out, int threads);
void pn_gather(int code, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
               int64_t K, int64_t bs, const int64_t *ids, int64_t T, float *out);

/* -- attention (attention.c) ------------------------------------------------------------ */
void pn_attend_decodes(const float *q, int64_t q_stride, int64_t B, int64_t Hq, int64_t Hkv,
                       int64_t hd, void *K, void *V, int64_t ctx, const int64_t *slots,
                       const int64_t *first, const int64_t *last, const float *knew,
                       int64_t k_stride, const float *vnew, int64_t v_stride, float *out,
                       int64_t out_stride, int kv);

/* -- element-wise layers (elementwise.c, layer.c) --------------------------------------- */
void pn_rms_norm(const float *x, int64_t rows, int64_t d, int64_t stride, const float *w,
                 float eps, float *out);
void pn_rms_norm_heads(const float *x, int64_t T, int64_t H, int64_t d, int64_t stride,
                       const float *w, float eps, float *out);
void pn_rope(const float *x, int64_t T, int64_t H, int64_t hd, int64_t stride,
             const float *cos_, const float *sin_, int64_t half, float scale, float *out);
void pn_silu_mul(const float *g, int64_t B, int64_t F, float *out);
void pn_gelu_mul(const float *g, int64_t B, int64_t F, float *out);
void pn_copy(void *dst, const void *src, int64_t n);

/* -- a decode step's layer in one call (layer.c) ---------------------------------------- */
int pn_decode_layer(const PnLayer *L, const PnStep *S, const int64_t *first,
                    const float *cos_, const float *sin_, float *x);

/* -- Gated DeltaNet's prefill of one sequence's chunk (deltanet.c) --------------------- */
int pn_deltanet_prefill(const float *mixed, int64_t ms, const float *z, int64_t zs,
                        const float *beta, const float *g, const float *conv, float *tail,
                        float *state, const float *ssm_norm, float eps, int64_t n, int64_t nk,
                        int64_t nv, int64_t dk, int64_t dv, int64_t K, int64_t tiled,
                        float *out, int64_t os);

/* -- repacking at load (repack.c) ------------------------------------------------------- */
void pn_repack_q4_k(const uint8_t *b, int64_t n, uint8_t *qs, uint16_t *sc, uint16_t *mn);
void pn_repack_q6_k(const uint8_t *b, int64_t n, int8_t *qs, uint16_t *sc);

#endif
