/* repack.c: Q4_K / Q6_K repacked at load on the pool (worker/qmatrix.py's fast path). */
#if defined(__F16C__)
static inline uint16_t float_to_half(float f) {       /* round to nearest even, as NumPy */
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

/* Q4_K super-blocks (144 bytes) → q4 blocks: nibbles moved, scale = fp16(d * sc),
 * min = fp16(-(dmin * m)), per 32. */
typedef struct { const uint8_t *b; int64_t n; void *qs; uint16_t *sc, *mn; } RepackArgs;
#define REPACK_PIECE 256                /* super-blocks per work item of the pool */

static void repack_q4_k_chunk(const void *p, int64_t c) {
    const RepackArgs *a = p;
    const uint8_t *restrict b = a->b;
    uint8_t *restrict qs = a->qs;
    uint16_t *restrict sc = a->sc, *restrict mn = a->mn;
    const int64_t i1 = (c + 1) * REPACK_PIECE < a->n ? (c + 1) * REPACK_PIECE : a->n;
    for (int64_t i = c * REPACK_PIECE; i < i1; i++) {
        const uint8_t *blk = b + i * 144, *s = blk + 4, *g = blk + 16;
        uint16_t hd, hm;
        memcpy(&hd, blk, 2);
        memcpy(&hm, blk + 2, 2);
        float d = half_to_float(hd), dmin = half_to_float(hm);
        for (int j = 0; j < 8; j++) {
            int scj, mj;
            if (j < 4) { scj = s[j] & 63; mj = s[j + 4] & 63; }
            else {
                scj = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
                mj = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
            }
            sc[i * 8 + j] = float_to_half(d * (float)scj);
            mn[i * 8 + j] = float_to_half(-(dmin * (float)mj));
        }
        uint8_t *q = qs + i * 128;
        for (int grp = 0; grp < 4; grp++)
            for (int k = 0; k < 16; k++) {
                uint8_t lo = g[grp * 32 + k], hi = g[grp * 32 + 16 + k];
                q[grp * 32 + k] = (uint8_t)((lo & 15) | (hi << 4));
                q[grp * 32 + 16 + k] = (uint8_t)((lo >> 4) | (hi & 0xF0));
            }
    }
}

void pn_repack_q4_k(const uint8_t *b, int64_t n, uint8_t *qs, uint16_t *sc, uint16_t *mn) {
    const RepackArgs a = {b, n, qs, sc, mn};
    pool_run(repack_q4_k_chunk, &a, (n + REPACK_PIECE - 1) / REPACK_PIECE);
}

/* Q6_K super-blocks (210 bytes) → int8 values (q - 32) and fp16(d * scale) per 16. */
static void repack_q6_k_chunk(const void *p, int64_t c) {
    const RepackArgs *a = p;
    const uint8_t *restrict b = a->b;
    int8_t *restrict qs = a->qs;
    uint16_t *restrict sc = a->sc;
    const int64_t i1 = (c + 1) * REPACK_PIECE < a->n ? (c + 1) * REPACK_PIECE : a->n;
    for (int64_t i = c * REPACK_PIECE; i < i1; i++) {
        const uint8_t *blk = b + i * 210, *ql = blk, *qh = blk + 128;
        const int8_t *scales = (const int8_t *)(blk + 192);
        uint16_t hd;
        memcpy(&hd, blk + 208, 2);
        float d = half_to_float(hd);
        for (int j = 0; j < 16; j++) sc[i * 16 + j] = float_to_half(d * (float)scales[j]);
        int8_t *y = qs + i * 256;
        for (int h = 0; h < 2; h++) {
            const uint8_t *l = ql + 64 * h, *hb = qh + 32 * h;
            int8_t *o = y + 128 * h;
            for (int k = 0; k < 32; k++) {
                o[k] = (int8_t)(((l[k] & 15) | ((hb[k] & 3) << 4)) - 32);
                o[k + 32] = (int8_t)(((l[k + 32] & 15) | (((hb[k] >> 2) & 3) << 4)) - 32);
                o[k + 64] = (int8_t)(((l[k] >> 4) | (((hb[k] >> 4) & 3) << 4)) - 32);
                o[k + 96] = (int8_t)(((l[k + 32] >> 4) | (((hb[k] >> 6) & 3) << 4)) - 32);
            }
        }
    }
}

void pn_repack_q6_k(const uint8_t *b, int64_t n, int8_t *qs, uint16_t *sc) {
    const RepackArgs a = {b, n, qs, sc, NULL};
    pool_run(repack_q6_k_chunk, &a, (n + REPACK_PIECE - 1) / REPACK_PIECE);
}
int pn_has_repack(void) { return 1; }
#else
int pn_has_repack(void) { return 0; }
void pn_repack_q4_k(const uint8_t *b, int64_t n, uint8_t *qs, uint16_t *sc, uint16_t *mn) {}
void pn_repack_q6_k(const uint8_t *b, int64_t n, int8_t *qs, uint16_t *sc) {}
#endif
