/* The CPU kernels for QMatrix weights (worker/qmatrix.py): y[B, N] = x[B, K] @ W.T, and
 * the decode step's other layers, as ONE translation unit.
 *
 * Built at first use by worker/kernels_cpu.py with the host's C compiler (-O3, the
 * target PANTHEON_ISA names: native, avx2 or generic) and cached by the bytes of every
 * file of this folder and the CPU. The parts are included here, in order, rather than
 * compiled apart, so that the static helpers inline into every kernel that calls them
 * exactly as they would in one file (the hot loops depend on it); a part uses only what
 * the parts before it define. docs/kernels.md maps the files and the figures behind
 * each path.
 */
#define PN_TYPES_ONLY
#include "pantheon.h"
#undef PN_TYPES_ONLY

/* The instruction-set paths of this build, by what the compiler targets. A part's code
 * for one path sits under that path's guard; each exported function is defined in every
 * build (the paths a build lacks answer 0 or do nothing). */
#if defined(__AVX2__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PN_ZMM 1        /* 512-bit integer products (VNNI): pairs, token lanes, digits */
#endif
#if defined(PN_ZMM) && defined(__AMX_TILE__) && defined(__AMX_BF16__) \
    && defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__x86_64__) \
    && defined(__linux__)
#define PN_AMX 1        /* bf16 tile products (Xeons with AMX, where the kernel grants them) */
#endif

#include "codes.c"        /* the kinds' codes, fp16 to float, the IQ4 levels */
#include "pool.c"         /* the thread pool every parallel loop runs on */
#include "formats.c"      /* each format's layout, decoded to floats; the fp32 row loops */
#include "amx.c"          /* many rows of x on AMX tiles (bf16 hi / lo halves) */
#include "int16.c"        /* 256-bit int16 primitives: a block of 32 widened, its scales */
#include "rows.c"         /* blocks of 32: x to int16, the row kernels (AVX2, AVX-512 pairs) */
#include "k_widen.c"      /* K-quants: x per super-block; a super-block widened to int16 */
#include "k_rows.c"       /* K-quants: the row kernels, any number of rows of x */
#include "lanes.c"        /* many rows of x: tokens across the lanes (AVX-512 VNNI) */
#include "digits.c"       /* batch-1 K-quants: int16 x as two int8 digits (AVX-512 VNNI) */
#include "amx_codes.c"    /* decode steps on AMX tiles: the weights' own codes */
#include "digits_avx2.c"  /* batch-1 K-quants: two digits on 256-bit vectors */
#include "x8.c"           /* int8 activations (--activations int8): how x is held; batch 1 */
#include "x8_rows.c"      /* int8 activations: K-quants on many rows of x */
#include "b_groups.c"     /* blocks of 32, many rows of x, 256-bit: W's rows across lanes */
#include "plan.c"         /* pn_plan (which product runs) and pn_matmul_int (running it) */
#include "floats.c"       /* fp32 products (gemv), dequantized rows (tiles), the embedding gather */
#include "attention.c"    /* a step's single-token queries over their KV caches */
#include "elementwise.c"  /* norms, rotary, SiLU, copies */
#include "layer.c"        /* a decode step's layer in one call, DeltaNet included */
#include "deltanet.c"     /* Gated DeltaNet's prefill: a prompt chunk's conv, rule, norm */
#include "repack.c"       /* K-quant repacking at load */
#include "options.c"      /* pn_init: the options to each part */

#include "pantheon.h"      /* the prototypes, against the definitions above */
