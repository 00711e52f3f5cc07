/* codes.c: what every part shares — the kinds' codes (kernels_cpu.CODES), MAXB, fp16 to
 * float, the IQ4 levels.
 *
 * Formats (row-major, blocks along K; scales and mins are fp16 bit patterns):
 *   q4:   qs[N][K/2]; block b of a row holds elements 32b+i (low nibble of byte
 *         16b+i) and 32b+16+i (high nibble), i < 16; scale, min [N][K/32]
 *   q8:   qs[N][K] int8; scale (and min, or none) [N][K/bs], bs 32 or 16
 *   f16:  qs[N][K] half bits;  bf16: qs[N][K] bfloat16 bits
 *   q2k .. q6k: the file's K-quant super-blocks of 256, as stored (formats.c)
 *   iq4nl: as q4 (nibbles, a scale per 32, no min), w = scale * IQ4_LEVELS[nibble]
 *   iq4xs: the file's IQ4_XS super-blocks of 256, as stored (formats.c)
 */
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>

#define MAXB 16     /* rows of x per pass; the caller splits larger batches */

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__F16C__)
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF, bits;
    if (e == 0) {                       /* zero or subnormal: m * 2^-24 */
        float v = (float)m * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (e == 31) bits = sign | 0x7F800000u | (m << 13);
    else bits = sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

enum { Q4 = 0, Q8 = 1, Q8M = 2, F16 = 3, BF16 = 4, Q4K = 5, Q6K = 6, Q5K = 7, Q3K = 8, Q2K = 9,
       IQ4XS = 10, IQ4NL = 11 };   /* worker/kernels_cpu.py CODES */

/* IQ4_NL and IQ4_XS: a nibble picks one of 16 int8 levels (common/block_decode.py) */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1, 13, 25, 38, 53, 69, 89, 113};
