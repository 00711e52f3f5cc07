/* CPU kernels for QMatrix weights (worker/qmatrix.py): y[B, N] = x[B, K] @ W.T.
 *
 * Built at first use by worker/kernels_cpu.py with the host's C compiler
 * (-O3 -march=native -fopenmp) and cached by source and CPU. Plain C that the
 * compiler vectorizes: each block of 32 weights is dequantized into a small
 * float buffer (w = scale * q + min) and multiplied into per-row vector
 * accumulators, so nothing is reduced horizontally until a row ends, and one
 * read of the quantized weights serves all B rows of x.
 *
 * Formats (row-major, blocks along K; scales and mins are fp16 bit patterns):
 *   q4:   qs[N][K/2]; block b of a row holds elements 32b+i (low nibble of byte
 *         16b+i) and 32b+16+i (high nibble), i < 16; scale, min [N][K/32]
 *   q8:   qs[N][K] int8; scale (and min, or none) [N][K/bs], bs 32 or 16
 *   f16:  qs[N][K] half bits;  bf16: qs[N][K] bfloat16 bits
 *   q2k .. q6k: the file's K-quant super-blocks of 256, as stored (see below)
 *   iq4nl: as q4 (nibbles, a scale per 32, no min), w = scale * IQ4_LEVELS[nibble]
 *   iq4xs: the file's IQ4_XS super-blocks of 256, as stored (see below)
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

/* -- the kernels' thread pool ----------------------------------------------------------
 * Work is split into chunks (rows of W) that threads claim one at a time from a shared
 * counter; the caller claims chunks too and returns once every chunk is finished. Unlike
 * an OpenMP loop it never waits for a thread that has not started: on a shared host a
 * worker thread preempted by another process simply claims nothing (an OpenMP barrier
 * waited for it, measured at up to 8x the kernel's time with a busy core beside it).
 * Idle threads spin briefly (the next projection usually follows within microseconds),
 * then sleep on a condition variable. */
#include <pthread.h>
#include <sched.h>
#include <time.h>

typedef void (*pn_task)(const void *args, int64_t chunk);
/* `next`: memory the caller will read soon after this job (the following matrix of the
 * forward), which a pool thread done with its chunks fetches while the caller is busy
 * between products, instead of spinning */
typedef struct { const char *p; int64_t len; } Span_;
typedef struct { pn_task fn; const void *args; int64_t n; Span_ next[3]; } Job;

#define MAX_POOL 256
static struct {
    int size;                     /* threads besides the caller */
    uint64_t claim;               /* atomic: generation << 32 | next chunk to claim */
    int64_t done;                 /* atomic: chunks finished in this generation */
    int sleepers;                 /* atomic: threads waiting on cv */
    Job jobs[2];                  /* generation g's job is jobs[g & 1] */
    int64_t spin_ns;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t threads[MAX_POOL];
} P = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .spin_ns = 200000};

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claim and run chunks of the current job until none is left. A claim succeeds only
 * while its generation is current, so a late thread never runs a stale job's chunk; a
 * job's descriptor is rewritten only two generations later, after all its chunks. */
static void run_chunks(void) {
    for (;;) {
        uint64_t c = __atomic_load_n(&P.claim, __ATOMIC_ACQUIRE);
        const Job *j = &P.jobs[(c >> 32) & 1];
        pn_task fn = __atomic_load_n(&j->fn, __ATOMIC_RELAXED);
        const void *args = __atomic_load_n(&j->args, __ATOMIC_RELAXED);
        int64_t i = (int64_t)(uint32_t)c, n = __atomic_load_n(&j->n, __ATOMIC_RELAXED);
        if (i >= n) return;
        if (__atomic_compare_exchange_n(&P.claim, &c, c + 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED)) {
            fn(args, i);
            __atomic_fetch_add(&P.done, 1, __ATOMIC_RELEASE);
        }
    }
}

/* Touch `next` of generation gen's job (once per generation and thread), a line at a
 * time, stopping as soon as another job starts. */
static void fetch_next(uint64_t gen) {
    const Job *j = &P.jobs[gen & 1];
    for (int k = 0; k < 3; k++) {
        const char *p = __atomic_load_n(&j->next[k].p, __ATOMIC_RELAXED);
        int64_t len = __atomic_load_n(&j->next[k].len, __ATOMIC_RELAXED);
        for (int64_t o = 0; p && o < len; o += 64) {
            if ((o & 4095) == 0 && (__atomic_load_n(&P.claim, __ATOMIC_ACQUIRE) >> 32) != gen)
                return;
            __builtin_prefetch(p + o, 0, 3);
        }
    }
}

static void *pool_thread(void *unused) {
    (void)unused;
    uint64_t fetched = 0;
    for (;;) {
        run_chunks();
        uint64_t gen = __atomic_load_n(&P.claim, __ATOMIC_SEQ_CST) >> 32;
        if (gen != fetched) {
            fetched = gen;
            fetch_next(gen);
            if ((__atomic_load_n(&P.claim, __ATOMIC_SEQ_CST) >> 32) != gen) continue;
        }
        int64_t t0 = now_ns();
        int spins = 0;
        while (__atomic_load_n(&P.claim, __ATOMIC_ACQUIRE) >> 32 == gen) {
            cpu_relax();
            if (++spins % 256 == 0 && now_ns() - t0 > P.spin_ns) break;
        }
        if (__atomic_load_n(&P.claim, __ATOMIC_ACQUIRE) >> 32 != gen) continue;
        pthread_mutex_lock(&P.mu);
        __atomic_fetch_add(&P.sleepers, 1, __ATOMIC_SEQ_CST);
        while (__atomic_load_n(&P.claim, __ATOMIC_SEQ_CST) >> 32 == gen)
            pthread_cond_wait(&P.cv, &P.mu);
        __atomic_fetch_sub(&P.sleepers, 1, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&P.mu);
    }
    return NULL;
}

/* Start the pool once: `threads` in all, the caller included; spin before sleeping. */
int pn_pool_init(int threads, int64_t spin_us) {
    if (P.size || threads <= 1) return P.size + 1;
    P.spin_ns = spin_us * 1000;
    int want = threads - 1 < MAX_POOL ? threads - 1 : MAX_POOL;
    for (int t = 0; t < want; t++) {
        if (pthread_create(&P.threads[t], NULL, pool_thread, NULL) != 0) break;
        pthread_detach(P.threads[t]);
        P.size++;
    }
    return P.size + 1;
}

/* Rows of W per claimed piece: about 16 pieces per thread (few claims to contend on, and
 * a preempted thread holds up at most a sixteenth of its share), in multiples of 16. */
static inline int64_t piece_rows(int64_t N) {
    int64_t per = N / (16 * (P.size + 1));
    per = (per + 15) / 16 * 16;
    return per < 16 ? 16 : per;
}

static pthread_mutex_t pool_caller = PTHREAD_MUTEX_INITIALIZER;

/* fn(args, 0 .. n-1), spread over the pool; returns when all have run. Callers take
 * turns (one job at a time); a process forked from one with a pool has no pool threads
 * and simply runs every chunk itself. */
static void pool_run_next(pn_task fn, const void *args, int64_t n, const Span_ *next) {
    if (P.size == 0 || n <= 1 || pthread_mutex_trylock(&pool_caller) != 0) {
        for (int64_t i = 0; i < n; i++) fn(args, i);
        return;
    }
    uint64_t g = (__atomic_load_n(&P.claim, __ATOMIC_RELAXED) >> 32) + 1;
    Job *j = &P.jobs[g & 1];
    __atomic_store_n(&j->fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&j->args, args, __ATOMIC_RELAXED);
    __atomic_store_n(&j->n, n, __ATOMIC_RELAXED);
    for (int k = 0; k < 3; k++) {
        __atomic_store_n(&j->next[k].p, next ? next[k].p : NULL, __ATOMIC_RELAXED);
        __atomic_store_n(&j->next[k].len, next ? next[k].len : 0, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&P.done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&P.claim, g << 32, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&P.sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
    run_chunks();
    int spins = 0;
    while (__atomic_load_n(&P.done, __ATOMIC_ACQUIRE) < n)  /* a chunk still running */
        if (++spins % 1024 == 0) sched_yield(); else cpu_relax();
    pthread_mutex_unlock(&pool_caller);
}

/* what the calling thread's next job may hand the pool to fetch (pn_matmul_int) */
static __thread const Span_ *tl_next;

static void pool_run(pn_task fn, const void *args, int64_t n) {
    const Span_ *next = tl_next;
    tl_next = NULL;
    pool_run_next(fn, args, n, next);
}

/* The `bs` weights of block `blk` of row `n`, as floats. */
static inline void dequant_block(int code, const uint8_t *restrict qs,
                                 const uint16_t *restrict sc, const uint16_t *restrict mn,
                                 int64_t K, int64_t bs, int64_t n, int64_t blk,
                                 float *restrict w) {
    int64_t nb = K / bs;
#if defined(__AVX2__)
    if (code == Q4) {                   /* 8 weights per step: widen, convert, scale */
        const uint8_t *q = qs + n * (K / 2) + blk * 16;
        __m256 s = _mm256_set1_ps(half_to_float(sc[n * nb + blk]));
        __m256 m = _mm256_set1_ps(half_to_float(mn[n * nb + blk]));
        __m128i raw = _mm_loadu_si128((const __m128i *)q), low4 = _mm_set1_epi8(15);
        __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
        __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int j = 0; j < 4; j++) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
            _mm256_storeu_ps(w + 8 * j, _mm256_fmadd_ps(v, s, m));
        }
        return;
    }
    if (code == IQ4NL) {                /* the levels looked up 16 at a time */
        const uint8_t *q = qs + n * (K / 2) + blk * 16;
        __m256 s = _mm256_set1_ps(half_to_float(sc[n * nb + blk]));
        __m128i raw = _mm_loadu_si128((const __m128i *)q), low4 = _mm_set1_epi8(15);
        __m128i lut = _mm_loadu_si128((const __m128i *)IQ4_LEVELS);
        __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(raw, low4));
        __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(w + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[j])), s));
        return;
    }
    if (code == Q8 || code == Q8M) {
        const int8_t *q = (const int8_t *)qs + n * K + blk * bs;
        __m256 s = _mm256_set1_ps(half_to_float(sc[n * nb + blk]));
        __m256 m = _mm256_set1_ps(code == Q8M ? half_to_float(mn[n * nb + blk]) : 0.0f);
        for (int j = 0; j < bs; j += 8) {
            __m128i b8 = _mm_loadl_epi64((const __m128i *)(q + j));
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8));
            _mm256_storeu_ps(w + j, _mm256_fmadd_ps(v, s, m));
        }
        return;
    }
#endif
    if (code == Q4) {
        const uint8_t *q = qs + n * (K / 2) + blk * 16;
        float s = half_to_float(sc[n * nb + blk]), m = half_to_float(mn[n * nb + blk]);
        for (int i = 0; i < 16; i++) {
            w[i] = (float)(q[i] & 15) * s + m;
            w[i + 16] = (float)(q[i] >> 4) * s + m;
        }
    } else if (code == IQ4NL) {
        const uint8_t *q = qs + n * (K / 2) + blk * 16;
        float s = half_to_float(sc[n * nb + blk]);
        for (int i = 0; i < 16; i++) {
            w[i] = s * (float)IQ4_LEVELS[q[i] & 15];
            w[i + 16] = s * (float)IQ4_LEVELS[q[i] >> 4];
        }
    } else if (code == Q8 || code == Q8M) {
        const int8_t *q = (const int8_t *)qs + n * K + blk * bs;
        float s = half_to_float(sc[n * nb + blk]);
        float m = code == Q8M ? half_to_float(mn[n * nb + blk]) : 0.0f;
        for (int i = 0; i < bs; i++) w[i] = (float)q[i] * s + m;
    } else if (code == F16) {
        const uint16_t *q = (const uint16_t *)qs + n * K + blk * bs;
        for (int i = 0; i < bs; i++) w[i] = half_to_float(q[i]);
    } else {
        const uint16_t *q = (const uint16_t *)qs + n * K + blk * bs;
        for (int i = 0; i < bs; i++) {
            uint32_t bits = (uint32_t)q[i] << 16;
            memcpy(&w[i], &bits, 4);
        }
    }
}

/* -- K-quant super-blocks kept as the file stores them (kinds q2k .. q6k) -------------
 * A row is K / 256 blocks of 84 (Q2_K), 110 (Q3_K), 144 (Q4_K), 176 (Q5_K) or 210 (Q6_K)
 * bytes, ggml's layout:
 *   Q4_K: d, dmin (fp16), 12 bytes of 6-bit sub-scales and mins (8 each), 128 bytes of
 *         nibbles: byte 32g + i holds element 64g + i (low) and 64g + 32 + i (high).
 *         w = d * sc[j] * q - dmin * m[j], j = element / 32.
 *   Q5_K: Q4_K's 16 bytes of d, dmin, sub-scales and mins, then 32 bytes of high bits qh,
 *         then Q4_K's 128 bytes of nibbles: element 64g + i (low nibble) takes bit 2g of
 *         qh[i] as its 16, 64g + 32 + i (high nibble) bit 2g + 1; q in 0 .. 31, w as Q4_K.
 *   Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (fp16):
 *         per half h of 128, l < 32: element 128h + l is lo4(ql[64h + l]) | bits 0-1 of
 *         qh[32h + l] << 4, + 32: lo4(ql[64h + 32 + l]) | bits 2-3, + 64: hi4(ql[64h + l])
 *         | bits 4-5, + 96: hi4(ql[64h + 32 + l]) | bits 6-7. w = d * sc[e / 16] * (q - 32).
 *   Q3_K: 32 bytes hmask, 64 of 2-bit values, 12 of 6-bit scales (q3k_scales), d (fp16):
 *         element 128h + 32j + l (j < 4, l < 32) is bits 2j, 2j + 1 of qs[32h + l] with
 *         bit 4h + j of hmask[l] as its 4; w = d * (sc[e / 16] - 32) * (q - 4).
 *   Q2_K: 16 bytes of 4-bit scale (low) and min (high) per 16 values, 64 of 2-bit values
 *         (Q3_K's order), d, dmin (fp16): w = d * sc[e / 16] * q - dmin * m[e / 16].
 *   IQ4_XS: d (fp16), 2 bytes of high scale bits, 4 of low ones (iq4xs_scales), then 8
 *         runs of 16 bytes: byte 16j + i holds element 32j + i (low nibble) and
 *         32j + 16 + i (high); w = d * (sc[j] - 32) * IQ4_LEVELS[nibble]. */
#define Q2K_BYTES 84
#define IQ4XS_BYTES 136
#define Q3K_BYTES 110
#define Q4K_BYTES 144
#define Q5K_BYTES 176
#define Q6K_BYTES 210
#define Q5K_QS 48           /* Q5_K: offset of the nibbles (after d, dmin, scales, qh) */

static inline void k_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* IQ4_XS's 8 sub-block scales, 6 bits each (the -32 not taken off): sub-block j's low 4
 * bits are nibble j % 2 of byte 4 + j / 2, its top 2 bits bits 2j, 2j + 1 of the uint16
 * at byte 2. */
static inline void iq4xs_scales(const uint8_t *b, uint8_t out[8]) {
    const uint16_t h = load_u16(b + 2);
    for (int j = 0; j < 8; j++)
        out[j] = (uint8_t)(((b[4 + j / 2] >> (4 * (j & 1))) & 15) | (((h >> (2 * j)) & 3) << 4));
}

/* Q3_K's 12 bytes → its 16 6-bit scales (before the -32): scales i, 4 + i are the low
 * nibbles of bytes i, 4 + i, scales 8 + i, 12 + i their high nibbles; bits 0-1, 2-3,
 * 4-5, 6-7 of byte 8 + i are the top two bits of each. */
static inline void q3k_scales(const uint8_t *s, uint8_t out[16]) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    const uint32_t four = 0x0F0F0F0Fu, two = 0x03030303u;
    const uint32_t v[4] = {(u0 & four) | ((u2 & two) << 4), (u1 & four) | (((u2 >> 2) & two) << 4),
                           ((u0 >> 4) & four) | (((u2 >> 4) & two) << 4),
                           ((u1 >> 4) & four) | (((u2 >> 6) & two) << 4)};
    memcpy(out, v, 16);
}

#if !defined(__AVX2__)
/* 256 weights of one super-block as floats (the portable decoding). */
static void dequant_superblock(int code, const uint8_t *restrict b, float *restrict w) {
    if (code == IQ4XS) {
        const float d = half_to_float(load_u16(b));
        uint8_t ls[8];
        iq4xs_scales(b, ls);
        for (int j = 0; j < 8; j++) {
            const float s = d * (float)((int)ls[j] - 32);
            const uint8_t *q = b + 8 + 16 * j;
            for (int i = 0; i < 16; i++) {
                w[32 * j + i] = s * (float)IQ4_LEVELS[q[i] & 15];
                w[32 * j + 16 + i] = s * (float)IQ4_LEVELS[q[i] >> 4];
            }
        }
        return;
    }
    if (code == Q4K || code == Q5K) {
        float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
        uint8_t sc[8], mn[8];
        k_scales(b + 4, sc, mn);
        const uint8_t *q = b + (code == Q5K ? Q5K_QS : 16), *qh = b + 16;
        const int five = code == Q5K;
        for (int g = 0; g < 4; g++) {
            float s0 = d * sc[2 * g], m0 = dmin * mn[2 * g];
            float s1 = d * sc[2 * g + 1], m1 = dmin * mn[2 * g + 1];
            for (int i = 0; i < 32; i++) {
                const int h0 = five ? ((qh[i] >> (2 * g)) & 1) << 4 : 0;
                const int h1 = five ? ((qh[i] >> (2 * g + 1)) & 1) << 4 : 0;
                w[64 * g + i] = s0 * (float)((q[32 * g + i] & 15) | h0) - m0;
                w[64 * g + 32 + i] = s1 * (float)((q[32 * g + i] >> 4) | h1) - m1;
            }
        }
        return;
    }
    if (code == Q3K || code == Q2K) {
        const int three = code == Q3K;
        const uint8_t *qs = b + (three ? 32 : 16);
        uint8_t sc[16];
        if (three) q3k_scales(b + 96, sc);
        else memcpy(sc, b, 16);
        const float d = half_to_float(load_u16(b + (three ? 108 : 80)));
        const float dmin = three ? 0.0f : half_to_float(load_u16(b + 82));
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    const int e = 128 * h + 32 * j + l, u = (qs[32 * h + l] >> (2 * j)) & 3;
                    w[e] = three ? d * (float)((int)sc[e / 16] - 32)
                                     * (float)((u | (((b[l] >> (4 * h + j)) & 1) << 2)) - 4)
                                 : d * (float)(sc[e / 16] & 15) * (float)u - dmin * (float)(sc[e / 16] >> 4);
                }
        return;
    }
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = half_to_float(load_u16(b + 208));
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t lo = ql[64 * h + l], hi = ql[64 * h + 32 + l], bits = qh[32 * h + l];
            const int e = 128 * h + l;
            w[e] = d * sc[e / 16] * (float)(((lo & 15) | ((bits & 3) << 4)) - 32);
            w[e + 32] = d * sc[(e + 32) / 16] * (float)(((hi & 15) | (((bits >> 2) & 3) << 4)) - 32);
            w[e + 64] = d * sc[(e + 64) / 16] * (float)(((lo >> 4) | (((bits >> 4) & 3) << 4)) - 32);
            w[e + 96] = d * sc[(e + 96) / 16] * (float)(((hi >> 4) | (((bits >> 6) & 3) << 4)) - 32);
        }
}
#endif

/* super-blocks of 256 read as the file has them */
static inline int is_k(int code) { return (code >= Q4K && code <= Q2K) || code == IQ4XS; }
static inline int64_t k_bytes(int code) {
    return code == Q4K ? Q4K_BYTES : code == Q5K ? Q5K_BYTES : code == Q6K ? Q6K_BYTES
         : code == Q3K ? Q3K_BYTES : code == IQ4XS ? IQ4XS_BYTES : Q2K_BYTES;
}
/* x's sums per super-block that the mins meet: per 32 (8), Q2_K's per 16 (16) */
static inline int64_t xs_per(int code) { return code == Q2K ? 16 : 8; }

#if defined(__AVX2__)
static void dequant_superblock_avx2(int code, const uint8_t *restrict b, float *restrict w);
#endif

/* Row r of a K-quant matrix as K floats. */
static void dequant_k_row(int code, const uint8_t *qs, int64_t K, int64_t r, float *out) {
    const int64_t nb = K / 256, bytes = k_bytes(code);
    for (int64_t blk = 0; blk < nb; blk++)
#if defined(__AVX2__)
        dequant_superblock_avx2(code, qs + (r * nb + blk) * bytes, out + blk * 256);
#else
        dequant_superblock(code, qs + (r * nb + blk) * bytes, out + blk * 256);
#endif
}

/* Float kinds have no blocks of their own: they are walked in runs of 32. */
static inline int64_t block_of(int code, int64_t bs) {
    return (code == F16 || code == BF16) ? 32 : bs;
}

/* One batch of up to MAXB rows of x against rows [n0, n1) of W. */
static void gemv_rows(int code, const uint8_t *restrict qs, const uint16_t *restrict sc,
                      const uint16_t *restrict mn, int64_t K, int64_t bs, int64_t N,
                      const float *restrict x, int64_t B, float *restrict out,
                      int64_t n0, int64_t n1) {
    int64_t run = block_of(code, bs), nb = K / run;
    float w[32];
    float acc[MAXB][32];
    for (int64_t n = n0; n < n1; n++) {
        memset(acc, 0, sizeof(float) * 32 * B);
        for (int64_t blk = 0; blk < nb; blk++) {
            dequant_block(code, qs, sc, mn, K, run, n, blk, w);
            if (run == 32) {
                for (int64_t b = 0; b < B; b++) {
                    const float *xb = x + b * K + blk * 32;
                    for (int i = 0; i < 32; i++) acc[b][i] += w[i] * xb[i];
                }
            } else {
                for (int64_t b = 0; b < B; b++) {
                    const float *xb = x + b * K + blk * 16;
                    for (int i = 0; i < 16; i++) acc[b][i] += w[i] * xb[i];
                }
            }
        }
        for (int64_t b = 0; b < B; b++) {
            float t = 0.0f;
            for (int i = 0; i < 32; i++) t += acc[b][i];
            out[b * N + n] = t;
        }
    }
}

/* A specialised B = 1 pass: the accumulators stay in registers. */
static void gemv1_rows(int code, const uint8_t *restrict qs, const uint16_t *restrict sc,
                       const uint16_t *restrict mn, int64_t K, int64_t bs, int64_t N,
                       const float *restrict x, float *restrict out, int64_t n0, int64_t n1) {
    int64_t run = block_of(code, bs), nb = K / run;
    float w[32];
    for (int64_t n = n0; n < n1; n++) {
        float acc[32] = {0};
        for (int64_t blk = 0; blk < nb; blk++) {
            dequant_block(code, qs, sc, mn, K, run, n, blk, w);
            const float *xb = x + blk * run;
            if (run == 32) {
                for (int i = 0; i < 32; i++) acc[i] += w[i] * xb[i];
            } else {
                for (int i = 0; i < 16; i++) acc[i] += w[i] * xb[i];
            }
        }
        float t = 0.0f;
        for (int i = 0; i < 32; i++) t += acc[i];
        out[n] = t;
    }
}

/* a matrix and a scratch as pn_matmul_int takes them (kernels_cpu._CMat, _CScratch);
 * act8: its products at batch 1 take int8 activations where this build has them */
typedef struct PnMat {
    int32_t code, act8; const uint8_t *qs; const uint16_t *sc, *mn; int64_t N, K, bs;
    const struct PnMat *next;       /* the matrix the forward multiplies by next, or NULL */
} PnMat;
typedef struct { int16_t *xq; float *xd, *xs; } PnScratch;   /* B x K, B x K/32, B x K/32 */

/* -- many rows of x on AMX tiles (the prefill's products) -------------------------------
 * TDPBF16PS adds a 16 x 32 bf16 tile times a 32 x 16 bf16 tile into 16 x 16 fp32 sums.
 * Each float f is split into hi (f with its low 16 bits cleared: exact in bf16) and
 * lo = bf16(f - hi); hi*hi + hi*lo + lo*hi leaves out lo*lo (2^-16 of a product) and lo's
 * rounding (2^-17 of f), so three tile products per 32 k carry the fp32 product to about
 * 2^-16, as close as the integer path's int16 activations. W is the A operand (16 of its
 * rows x 32 k, as dequantized: row-major), x the B operand: pairs of k interleaved across
 * 16 rows, packed once per call. A thread's chunk is 32 rows of W, dequantized once into
 * its own buffers and multiplied by every row of x. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) \
    && defined(__AVX512BW__) && defined(__AVX512VNNI__) \
    && defined(__AVX512F__) && defined(__x86_64__) && defined(__linux__)
#define PN_AMX 1
#define AMX_MIN_ROWS 8           /* q4, q8, f16, bf16 (see amx_takes) */
#define AMX_MIN_ROWS_K 8         /* Q4_K, Q6_K */
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

/* Rows of x from which the tiles beat the integer products (measured on a Xeon with AMX,
 * 2 threads, whole models: `pantheon bench engine`, the threshold moved): a tile of x
 * costs about the same for 1 to 16 rows. SmolLM2 (q4) batch 8: 376-405 tok/s on the
 * tiles against 342-345, batch 16 611-657 against 334-369. Qwen2.5-1.5B (Q4_K / Q6_K, read
 * from memory): batch 4 40 against 46, batch 8 50 against 46, batch 16 83 against 64. */
static int64_t amx_min_rows = AMX_MIN_ROWS, amx_min_rows_k = AMX_MIN_ROWS_K;
void pn_set_amx(int64_t min_rows) {
    amx_min_rows = min_rows < 0 ? AMX_MIN_ROWS : min_rows;
    amx_min_rows_k = min_rows < 0 ? AMX_MIN_ROWS_K : min_rows;
}
static inline int amx_takes(const PnMat *m, int64_t B) {
    const int64_t from = is_k(m->code) ? amx_min_rows_k : amx_min_rows;
    /* Q2_K (mins per 16) stays with the integer products: super_bf16 takes mins per 32 */
    return from > 0 && B >= from && m->K % 32 == 0 && m->code != Q2K && pn_amx_init() == 1;
}
#else
int pn_amx_init(void) { return 0; }
int pn_has_amx(void) { return 0; }
int pn_matmul_amx(const PnMat *m, const float *x, int64_t M, float *out) { return 0; }
void pn_set_amx(int64_t min_rows) { (void)min_rows; }
#endif


#if defined(__AVX2__)
#include <immintrin.h>
/* Integer path (decode): x is quantized per block of 32 to int16 with a float scale
 * (xq, xd; a relative error of 2^-16, where int8 activations as llama.cpp uses them
 * kept top-1 at only 97.3 % of SmolLM2's positions against fp32) and its exact block sums
 * kept (xs, for the mins). A block of weights, widened to int16, meets each row of x
 * in two madd (s16 x s16 pairs → s32) products, scaled into eight float lanes. */

/* 32 weights as int16 (w0: elements 0..15, w1: 16..31) against 32 int16 of x. */
static inline __m256i dot16(__m256i w0, __m256i w1, const int16_t *x) {
    __m256i a = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x));
    __m256i b = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16)));
    return _mm256_add_epi32(a, b);
}

/* acc + pairs of a x b (int16 → int32 lanes): one VNNI instruction where there is one. */
static inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define GROUP 8     /* rows of x that share one pass over a row of W (registers) */
#ifndef PF_AHEAD
/* The products wait on W's stream from memory unless software prefetches run this far
 * ahead (Qwen2.5-1.5B decode, steps alternated in one process: batch 1 15.5-16.5 ->
 * 17.4-18.7 tok/s at 2048, 17.9 at 1024, 18.8 at 4096; batch 8 41.8 -> 48.4) */
#define PF_AHEAD 2048
#endif

/* The 32 weights of block `blk` as int16: w0 elements 0..15, w1 elements 16..31. */
static inline void load_block(int code, const uint8_t *restrict row, int64_t blk,
                              __m256i *w0, __m256i *w1) {
    if (code == Q4) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(row + blk * 16));
        __m128i low4 = _mm_set1_epi8(15);
        *w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
        *w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        return;
    }
    if (code == IQ4NL) {        /* q4's nibbles, each looked up among the levels */
        __m128i raw = _mm_loadu_si128((const __m128i *)(row + blk * 16));
        __m128i low4 = _mm_set1_epi8(15), lut = _mm_loadu_si128((const __m128i *)IQ4_LEVELS);
        *w0 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(lut, _mm_and_si128(raw, low4)));
        *w1 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
        return;
    }
    const int8_t *q = (const int8_t *)row + blk * 32;
    *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
    *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
}

/* n fp16 values → floats, eight at a time. */
static inline void halves(const uint16_t *restrict h, int64_t n, float *restrict out) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = half_to_float(h[i]);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One block of one row of x: acc += scale * (w . x) in eight float lanes; `sf` holds the
 * row's scales as floats (one per block, or two per block for runs of 16). */
static inline __m256 block_dot(int64_t bs, __m256i w0, __m256i w1, const int16_t *x,
                               const float *sf, float xd, int64_t blk, __m256 acc) {
    if (bs == 32) {
        __m256 p = _mm256_cvtepi32_ps(dot16(w0, w1, x));
        return _mm256_fmadd_ps(p, _mm256_set1_ps(sf[blk] * xd), acc);
    }
    __m256 p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)));
    __m256 p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16))));
    acc = _mm256_fmadd_ps(p0, _mm256_set1_ps(sf[2 * blk] * xd), acc);
    return _mm256_fmadd_ps(p1, _mm256_set1_ps(sf[2 * blk + 1] * xd), acc);
}

#define MAX_RUNS 4096   /* scale entries per row held on the stack (K up to 65536) */

/* Row n of a q4 / q8 matrix (row_bytes of values, ns fp16 scales and mins): fetch the
 * stream PF_AHEAD on (W streams from memory), and its scales (and mins) as floats. */
static inline void row_scales(const uint8_t *restrict row, int64_t row_bytes,
                              const uint16_t *restrict sc, const uint16_t *restrict mn,
                              int64_t ns, int with_min, float *restrict sf, float *restrict mf) {
    for (int64_t l = 0; l < row_bytes; l += 64)
        _mm_prefetch((const char *)row + PF_AHEAD + l, _MM_HINT_T0);
    _mm_prefetch((const char *)sc + PF_AHEAD / 8, _MM_HINT_T0);
    if (with_min) _mm_prefetch((const char *)mn + PF_AHEAD / 8, _MM_HINT_T0);
    halves(sc, ns, sf);
    if (with_min) halves(mn, ns, mf);
}

/* Rows [n0, n1) of a q4 or q8 matrix against B quantized rows of x. A row's scales and
 * mins are converted to floats once, and its mins meet x's exact block sums in one dot
 * product after the blocks (the min term of a block is min * sum of its x). */
static void gemv_i8_rows(int code, const uint8_t *restrict qs, const uint16_t *restrict sc,
                         const uint16_t *restrict mn, int64_t K, int64_t bs, int64_t N,
                         const int16_t *restrict xq, const float *restrict xd,
                         const float *restrict xs, int64_t B, float *restrict out,
                         int64_t n0, int64_t n1) {
    const int64_t nx = K / 32, ns = K / bs, row_bytes = code == Q4 || code == IQ4NL ? K / 2 : K;
    const int with_min = code == Q4 || code == Q8M;
    float sf[MAX_RUNS], mf[MAX_RUNS];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = qs + n * row_bytes;
        /* mins only with bs 32: ns == nx */
        row_scales(row, row_bytes, sc + n * ns, mn + n * ns, ns, with_min, sf, mf);
        if (B == 1) {                 /* four chains of blocks: the FMAs overlap */
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
            for (int64_t blk = 0; blk < nx; blk++) {
                __m256i w0, w1;
                load_block(code, row, blk, &w0, &w1);
                acc[blk & 3] = block_dot(bs, w0, w1, xq + blk * 32, sf, xd[blk], blk,
                                         acc[blk & 3]);
            }
            out[n] = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),
                                        _mm256_add_ps(acc[2], acc[3])))
                     + (with_min ? dot(mf, xs, nx) : 0.0f);
            continue;
        }
        for (int64_t b0 = 0; b0 < B; b0 += GROUP) {
            int64_t g = B - b0 < GROUP ? B - b0 : GROUP;
            __m256 acc[GROUP];
            for (int64_t b = 0; b < g; b++) acc[b] = _mm256_setzero_ps();
            for (int64_t blk = 0; blk < nx; blk++) {
                __m256i w0, w1;
                load_block(code, row, blk, &w0, &w1);
                for (int64_t b = 0; b < g; b++) {
                    const int64_t xb = (b0 + b) * nx + blk;
                    acc[b] = block_dot(bs, w0, w1, xq + xb * 32, sf, xd[xb], blk, acc[b]);
                }
            }
            for (int64_t b = 0; b < g; b++)
                out[(b0 + b) * N + n] = hsum(acc[b])
                    + (with_min ? dot(mf, xs + (b0 + b) * nx, nx) : 0.0f);
        }
    }
}

/* Q8M (5-bit values with a min, bs 32) has a min per block too: handled above. Mins of
 * the bs 16 kind do not occur (Q6_K has none). */

/* x [B, K] → int16 per block of 32 (xq), its scale (xd) and exact block sums (xs).
 * `paired`: each pair of blocks a, b is stored as a0..15 b0..15 a16..31 b16..31, the
 * order in which the AVX-512 kernels below widen two blocks of weights (an odd last
 * block stays as it is). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 32 values → int16 in two halves of 16 at lo, hi, with the scalar code's arithmetic (r =
 * v * inv, then r + copysign(0.5, r) truncated); returns the step d, *sum the block's sum
 * (in a different order than the scalar code: the last bits may differ). */
static inline float quantize32(const float *v, float step_max, int16_t *lo, int16_t *hi,
                               float *sum) {
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    const float d = amax / step_max, inv = d > 0 ? 1.0f / d : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv), half = _mm512_set1_ps(0.5f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 ra = _mm512_mul_ps(a, vinv), rb = _mm512_mul_ps(b, vinv);
    ra = _mm512_add_ps(ra, _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(ra), sign), _mm512_castps_si512(half))));
    rb = _mm512_add_ps(rb, _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(rb), sign), _mm512_castps_si512(half))));
    _mm256_storeu_si256((__m256i *)lo, _mm512_cvtsepi32_epi16(_mm512_cvttps_epi32(ra)));
    _mm256_storeu_si256((__m256i *)hi, _mm512_cvtsepi32_epi16(_mm512_cvttps_epi32(rb)));
    return d;
}
#endif

/* x [B, K] → int16 per block of 32 in `steps` steps (16383: the row kernels, whose madd
 * pairs of products must not overflow; 32767: the b_groups), eight at a time with the
 * scalar loop's arithmetic in pn_quantize_x; xd the steps, xs the exact block sums. */
static inline void quantize_x16(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd,
                                float *xs, float steps) {
    const int64_t nx = K / 32;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 half = _mm256_set1_ps(0.5f);
    for (int64_t b = 0; b < B; b++)
        for (int64_t blk = 0; blk < nx; blk++) {
            const float *v = x + b * K + blk * 32;
            int16_t *q = xq + b * K + blk * 32;
            __m256 a[4], m = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
            for (int h = 0; h < 4; h++) {
                a[h] = _mm256_loadu_ps(v + 8 * h);
                m = _mm256_max_ps(m, _mm256_and_ps(a[h], absmask));
                sum = _mm256_add_ps(sum, a[h]);
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float d = _mm_cvtss_f32(m4) / steps, inv = d > 0 ? 1.0f / d : 0.0f;
            const __m256 vinv = _mm256_set1_ps(inv);
            __m256i iv[4];
            for (int h = 0; h < 4; h++) {
                __m256 r = _mm256_mul_ps(a[h], vinv);
                iv[h] = _mm256_cvttps_epi32(_mm256_add_ps(r, _mm256_or_ps(_mm256_and_ps(r, sign), half)));
            }
            _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[0], iv[1]), 0xD8));
            _mm256_storeu_si256((__m256i *)(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[2], iv[3]), 0xD8));
            xd[b * nx + blk] = d;
            xs[b * nx + blk] = hsum(sum);
        }
}

void pn_quantize_x(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd, float *xs,
                   int paired) {
    int64_t nx = K / 32;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int64_t b = 0; b < B; b++)
        for (int64_t blk = 0; blk < nx; blk++) {
            int16_t *q = xq + b * K + blk * 32;
            int16_t *lo = q, *hi = q + 16;
            if (paired && (blk | 1) < nx) {     /* a0..15 b0..15 a16..31 b16..31 */
                int16_t *base = xq + b * K + (blk & ~(int64_t)1) * 32 + (blk & 1) * 16;
                lo = base;
                hi = base + 32;
            }
            xd[b * nx + blk] = quantize32(x + b * K + blk * 32, 16383.0f, lo, hi, &xs[b * nx + blk]);
        }
#else
    if (!paired) {              /* AVX2: eight at a time, the arithmetic of the loop below */
        quantize_x16(x, B, K, xq, xd, xs, 16383.0f);
        return;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t blk = 0; blk < nx; blk++) {
            const float *v = x + b * K + blk * 32;
            float amax = 0.0f, sum = 0.0f;
            for (int i = 0; i < 32; i++) {
                float a = v[i] < 0 ? -v[i] : v[i];
                amax = a > amax ? a : amax;
                sum += v[i];
            }
            /* 16383, not 32767: a madd pair of two full-range products would overflow */
            float d = amax / 16383.0f, inv = d > 0 ? 1.0f / d : 0.0f;
            int16_t *q = xq + b * K + blk * 32;
            const int pair = paired && (blk | 1) < nx, second = blk & 1;
            for (int i = 0; i < 32; i++) {
                float r = v[i] * inv;
                int16_t qv = (int16_t)(r < 0 ? r - 0.5f : r + 0.5f);
                if (pair)       /* within the pair's 64: halves of a, b interleaved */
                    xq[b * K + (blk & ~(int64_t)1) * 32 + (i / 16) * 32 + second * 16 + i % 16] = qv;
                else
                    q[i] = qv;
            }
            xd[b * nx + blk] = d;
            xs[b * nx + blk] = sum;
        }
#endif
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PN_ZMM_I8 1
/* AVX-512 for q4 and q8 (bs 32): two blocks a, b of a row widen into two vectors of 32
 * int16, [a0..15 b0..15] and [a16..31 b16..31], which meet x stored in that order
 * (pn_quantize_x, paired) in two dpwssd; lanes 0..7 then hold a's partial sums and
 * 8..15 b's, converted and scaled in one multiply-add. Against the 256-bit path this
 * is about a third of the instructions per block. */
static inline void load_pair(int code, const uint8_t *restrict row, int64_t k,
                             __m512i *lo, __m512i *hi) {
    if (code == Q4) {           /* 32 bytes: a's 16 then b's; nibbles low = i, high = 16 + i */
        __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + 32 * k)));
        *lo = _mm512_and_si512(raw, _mm512_set1_epi16(15));
        *hi = _mm512_srli_epi16(raw, 4);
        return;
    }
    if (code == IQ4NL) {        /* q4's layout; the levels (twice: 32 int16) looked up */
        const __m512i lut = _mm512_cvtepi8_epi16(_mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)IQ4_LEVELS)));
        __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + 32 * k)));
        *lo = _mm512_permutexvar_epi16(_mm512_and_si512(raw, _mm512_set1_epi16(15)), lut);
        *hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4), lut);
        return;
    }
    __m256i a = _mm256_loadu_si256((const __m256i *)(row + 64 * k));
    __m256i b = _mm256_loadu_si256((const __m256i *)(row + 64 * k + 32));
    *lo = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, b, 0x20));
    *hi = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, b, 0x31));
}

/* One row of W (its scales sf, mins mf as floats) against G rows of x from xq0 / xd0 /
 * xs0 (paired layout), G a constant at each call: the accumulators stay in registers. */
static inline __attribute__((always_inline)) void pair_rows(
        int code, const uint8_t *restrict row, const float *restrict sf,
        const float *restrict mf, int with_min, int64_t K, const int16_t *restrict xq0,
        const float *restrict xd0, const float *restrict xs0, float *restrict out,
        int64_t N, const int G) {
    const int64_t nx = K / 32, np2 = nx / 2;
    const __m512i half = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[GROUP];
    for (int b = 0; b < G; b++) acc[b] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < np2; k0 += 8) {         /* 8 pairs: 16 scales per load */
        const int64_t k1 = k0 + 8 < np2 ? k0 + 8 : np2;
        const __mmask16 live = (__mmask16)((1u << (2 * (k1 - k0))) - 1);
        const __m512 w16 = _mm512_maskz_loadu_ps(live, sf + 2 * k0);
        __m512 s16[GROUP];
        for (int b = 0; b < G; b++)
            s16[b] = _mm512_mul_ps(w16, _mm512_maskz_loadu_ps(live, xd0 + b * nx + 2 * k0));
        __m512i idx = half;
        for (int64_t k = k0; k < k1; k++) {
            __m512i lo, hi;
            load_pair(code, row, k, &lo, &hi);
            for (int b = 0; b < G; b++) {
                const int16_t *x = xq0 + b * K + 64 * k;
                __m512i c = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo,
                                                _mm512_loadu_si512((const void *)x));
                c = _mm512_dpwssd_epi32(c, hi, _mm512_loadu_si512((const void *)(x + 32)));
                acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c),
                                         _mm512_permutexvar_ps(idx, s16[b]), acc[b]);
            }
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2));
        }
    }
    for (int b = 0; b < G; b++) {
        float t = _mm512_reduce_add_ps(acc[b]);
        if (nx & 1) {                           /* an odd last block, as stored */
            __m256i w0, w1;
            load_block(code, row, nx - 1, &w0, &w1);
            t += hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(dot16(w0, w1, xq0 + b * K + K - 32)),
                                    _mm256_set1_ps(sf[nx - 1] * xd0[b * nx + nx - 1])));
        }
        out[b * N] = t + (with_min ? dot(mf, xs0 + b * nx, nx) : 0.0f);
    }
}

/* Rows [n0, n1) of a q4 / q8 (bs 32) matrix against B rows of x (paired layout). */
static void gemv_i8_rows512(int code, const uint8_t *restrict qs, const uint16_t *restrict sc,
                            const uint16_t *restrict mn, int64_t K, int64_t N,
                            const int16_t *restrict xq, const float *restrict xd,
                            const float *restrict xs, int64_t B, float *restrict out,
                            int64_t n0, int64_t n1) {
    const int64_t nx = K / 32, row_bytes = code == Q4 || code == IQ4NL ? K / 2 : K;
    const int with_min = code == Q4 || code == Q8M;
    float sf[MAX_RUNS], mf[MAX_RUNS];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = qs + n * row_bytes;
        row_scales(row, row_bytes, sc + n * nx, mn + n * nx, nx, with_min, sf, mf);
        for (int64_t b0 = 0; b0 < B;) {
            const int64_t left = B - b0;
            const int G = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const int16_t *x0 = xq + b0 * K;
            const float *d0 = xd + b0 * nx, *s0 = xs + b0 * nx;
            float *o = out + b0 * N + n;
            if (G == 8) pair_rows(code, row, sf, mf, with_min, K, x0, d0, s0, o, N, 8);
            else if (G == 4) pair_rows(code, row, sf, mf, with_min, K, x0, d0, s0, o, N, 4);
            else if (G == 2) pair_rows(code, row, sf, mf, with_min, K, x0, d0, s0, o, N, 2);
            else pair_rows(code, row, sf, mf, with_min, K, x0, d0, s0, o, N, 1);
            b0 += G;
        }
    }
}
/* Whether x goes in pairs of blocks for these weights and rows (the pairs win at every
 * batch: one core, a [1536, 576] q4 matrix, variants alternated in one process, ns per
 * block and row at 1 / 4 / 8 / 16 rows: 1.74 / 1.02 / 0.93 / 0.91 against 1.93 / 1.30 /
 * 1.58 / 1.13 with 256-bit vectors). */
int pn_pairs_x(int code, int64_t bs, int64_t B) {
    (void)B;
    return (code == Q4 || code == Q8 || code == Q8M || code == IQ4NL) && bs == 32;
}
#else
int pn_pairs_x(int code, int64_t bs, int64_t B) { return 0; }
#endif

typedef struct {
    int code; const uint8_t *qs; const uint16_t *sc, *mn; int64_t N, K, bs;
    const int16_t *xq; const float *xd, *xs; int64_t B; float *out; int64_t rows;
} I8Args;

static void i8_chunk(const void *p, int64_t c) {
    const I8Args *a = p;
    int64_t n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
#if defined(PN_ZMM_I8)
    if (pn_pairs_x(a->code, a->bs, a->B)) {
        gemv_i8_rows512(a->code, a->qs, a->sc, a->mn, a->K, a->N, a->xq, a->xd, a->xs,
                        a->B, a->out, n0, n1);
        return;
    }
#endif
    gemv_i8_rows(a->code, a->qs, a->sc, a->mn, a->K, a->bs, a->N, a->xq, a->xd, a->xs,
                 a->B, a->out, n0, n1);
}

/* out[B, N] = W @ x with x given quantized (pn_quantize_x): q4 and q8 kinds only. */
void pn_gemv_i8(int code, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                int64_t N, int64_t K, int64_t bs, const int16_t *xq, const float *xd,
                const float *xs, int64_t B, float *out) {
    I8Args a = {code, qs, sc, mn, N, K, bs, xq, xd, xs, B, out, piece_rows(N)};
    pool_run(i8_chunk, &a, (N + a.rows - 1) / a.rows);
}

/* -- K-quant products: x per super-block of 256 as int16 with one float scale (a step of
 * 1/16000 of the block's largest |x|) and exact sums per 32 (xs, for Q4_K's mins). A
 * super-block's weights are widened to int16 once, with their integer sub-scale already
 * multiplied in (q * sc: |.| <= 945 for Q4_K, (q - 32) * sc: <= 4096 for Q6_K), so every
 * row of x meets them in 16 int16 pair products (madd, or VNNI's dpwssd) summed in
 * int32, and one float multiply per 256 weights and row. (int8 activations, llama.cpp's
 * q8_K, would take half the work but measured here a mean KL of 0.004-0.017 nats and
 * top-1 agreement of 92-95 % on tiny models against their fp32 forward; int16: 0.0000
 * and 100 %.) The same products serve a prefill chunk: sub-pieces of W's rows stay in
 * cache while every group of 8 rows of x passes (measured on Zen 4, one core: 5.5 ns per
 * super-block and row at 128 rows, where dequantized tiles and OpenBLAS took ~9). */

#define XK_MAX 16000.0f   /* |x| in steps: keeps every int32 sum of a super-block in range */

/* x [B, K] → int16 (xq), a scale per 256 (xd), the sums of xq per 32 times that scale
 * (xs: what the Q4_K mins meet). */
void pn_quantize_xk(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd,
                    float *xs) {
    const int64_t nb = K / 256;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int64_t b = 0; b < B; b++)
        for (int64_t blk = 0; blk < nb; blk++) {
            const float *v = x + b * K + blk * 256;
            int16_t *q = xq + b * K + blk * 256;
            __m512 m = _mm512_setzero_ps();
            for (int i = 0; i < 256; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
            const float d = _mm512_reduce_max_ps(m) / XK_MAX, inv = d > 0 ? 1.0f / d : 0.0f;
            const __m512 vinv = _mm512_set1_ps(inv), half = _mm512_set1_ps(0.5f);
            const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
            for (int j = 0; j < 8; j++) {
                __m512i tot = _mm512_setzero_si512();
                for (int h = 0; h < 2; h++) {
                    __m512 r = _mm512_mul_ps(_mm512_loadu_ps(v + 32 * j + 16 * h), vinv);
                    r = _mm512_add_ps(r, _mm512_castsi512_ps(_mm512_or_si512(
                        _mm512_and_si512(_mm512_castps_si512(r), sign), _mm512_castps_si512(half))));
                    const __m512i iv = _mm512_cvttps_epi32(r);
                    tot = _mm512_add_epi32(tot, iv);
                    _mm256_storeu_si256((__m256i *)(q + 32 * j + 16 * h), _mm512_cvtsepi32_epi16(iv));
                }
                xs[(b * nb + blk) * 8 + j] = (float)_mm512_reduce_add_epi32(tot) * d;
            }
            xd[b * nb + blk] = d;
        }
#else           /* AVX2 */
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 half = _mm256_set1_ps(0.5f);
    for (int64_t b = 0; b < B; b++)
        for (int64_t blk = 0; blk < nb; blk++) {
            const float *v = x + b * K + blk * 256;
            int16_t *q = xq + b * K + blk * 256;
            __m256 m = _mm256_setzero_ps();
            for (int i = 0; i < 256; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(v + i), absmask));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float d = _mm_cvtss_f32(m4) / XK_MAX, inv = d > 0 ? 1.0f / d : 0.0f;
            const __m256 vinv = _mm256_set1_ps(inv);
            for (int j = 0; j < 8; j++) {       /* r = v * inv, plus copysign(0.5, r), truncated */
                __m256i iv[4], tot = _mm256_setzero_si256();
                for (int h = 0; h < 4; h++) {
                    __m256 r = _mm256_mul_ps(_mm256_loadu_ps(v + 32 * j + 8 * h), vinv);
                    r = _mm256_add_ps(r, _mm256_or_ps(_mm256_and_ps(r, sign), half));
                    iv[h] = _mm256_cvttps_epi32(r);
                    tot = _mm256_add_epi32(tot, iv[h]);
                }
                _mm256_storeu_si256((__m256i *)(q + 32 * j), _mm256_permute4x64_epi64(
                    _mm256_packs_epi32(iv[0], iv[1]), 0xD8));
                _mm256_storeu_si256((__m256i *)(q + 32 * j + 16), _mm256_permute4x64_epi64(
                    _mm256_packs_epi32(iv[2], iv[3]), 0xD8));
                __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(tot), _mm256_extracti128_si256(tot, 1));
                t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
                t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
                xs[(b * nb + blk) * 8 + j] = (float)_mm_cvtsi128_si32(t4) * d;
            }
            xd[b * nb + blk] = d;
        }
#endif
}

/* One super-block's weights as 16 vectors of 16 int16 (elements 16k..16k+15), each
 * times its integer sub-scale; Q4_K's mins per 32 as floats (mf) and the factors
 * d and -dmin (Q6_K: no offset term, the 32 is taken off the values). The tiles'
 * decoding (dequant_superblock_avx2) reads it; the products take 64 values at a time
 * (k_quad below). */
typedef struct {
    __m256i w[16];
    __m256 mf;
    float d, off_d;
    float m16[16];          /* Q2_K: its mins per 16 times -dmin */
} Super;

/* Q4_K's 12 bytes of 6-bit sub-scales and mins → sc[0..7], m[0..7] (bytes), in 32-bit
 * lanes: sc[j], m[j] for j < 4 are the low 6 bits of bytes j, j + 4; for j >= 4 the
 * low (sc) or high (m) nibble of byte j + 4 carries the low bits and the top 2 bits of
 * bytes j - 4 (sc) or j (m) the high ones. */
static inline void k_scales_fast(const uint8_t *s, uint8_t out[16]) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    const uint32_t six = 0x3F3F3F3Fu, four = 0x0F0F0F0Fu, two = 0x03030303u;
    uint32_t sc_lo = u0 & six, m_lo = u1 & six;
    uint32_t sc_hi = (u2 & four) | (((u0 >> 6) & two) << 4);
    uint32_t m_hi = ((u2 >> 4) & four) | (((u1 >> 6) & two) << 4);
    memcpy(out, &sc_lo, 4);
    memcpy(out + 4, &sc_hi, 4);
    memcpy(out + 8, &m_lo, 4);
    memcpy(out + 12, &m_hi, 4);
}

/* 32 bytes (one run of 32 values, u8) → two vectors of 16 int16, times scales s0, s1. */
static inline void widen_run(__m256i run, __m256i s0, __m256i s1, __m256i off,
                             __m256i *w0, __m256i *w1) {
    __m256i a = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(run)), off);
    __m256i b = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(run, 1)), off);
    *w0 = _mm256_mullo_epi16(a, s0);
    *w1 = _mm256_mullo_epi16(b, s1);
}

static inline void load_super(int code, const uint8_t *restrict b, Super *S) {
    const __m256i low4 = _mm256_set1_epi8(15), zero = _mm256_setzero_si256();
    if (code == Q4K || code == Q5K) {
        uint8_t sm[16];
        S->d = half_to_float(load_u16(b));
        S->off_d = -half_to_float(load_u16(b + 2));
        k_scales_fast(b + 4, sm);
        const int five = code == Q5K;
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), one = _mm256_set1_epi8(1);
        for (int g = 0; g < 4; g++) {         /* group g: runs 2g (low nibbles), 2g + 1 */
            __m256i raw = _mm256_loadu_si256((const __m256i *)(b + (five ? Q5K_QS : 16) + 32 * g));
            __m256i s0 = _mm256_set1_epi16(sm[2 * g]), s1 = _mm256_set1_epi16(sm[2 * g + 1]);
            __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            if (five) {                       /* Q5_K: bits 2g, 2g + 1 of qh[i] are the 16s */
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(
                    _mm256_srli_epi16(qh, 2 * g), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(
                    _mm256_srli_epi16(qh, 2 * g + 1), one), 4));
            }
            widen_run(lo, s0, s0, zero, &S->w[4 * g], &S->w[4 * g + 1]);
            widen_run(hi, s1, s1, zero, &S->w[4 * g + 2], &S->w[4 * g + 3]);
        }
        S->mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8))));
        return;
    }
    S->mf = _mm256_setzero_ps();
    if (code == IQ4XS) {                /* run j: bytes 16j.., low nibbles then high */
        uint8_t ls[8];
        iq4xs_scales(b, ls);
        S->d = half_to_float(load_u16(b));
        S->off_d = 0.0f;
        const __m128i low4 = _mm_set1_epi8(15), lut = _mm_loadu_si128((const __m128i *)IQ4_LEVELS);
        for (int j = 0; j < 8; j++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 8 + 16 * j));
            const __m256i s = _mm256_set1_epi16((int16_t)(ls[j] - 32));
            S->w[2 * j] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(
                _mm_shuffle_epi8(lut, _mm_and_si128(raw, low4))), s);
            S->w[2 * j + 1] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(
                _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), low4))), s);
        }
        return;
    }
    if (code == Q3K || code == Q2K) {   /* run 4h + j of 32 values, a scale per 16 */
        const int three = code == Q3K;
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b), three2 = _mm256_set1_epi8(3);
        const __m256i one = _mm256_set1_epi8(1);
        uint8_t sc[16];
        if (three) q3k_scales(b + 96, sc);
        else memcpy(sc, b, 16);
        S->d = half_to_float(load_u16(b + (three ? 108 : 80)));
        S->off_d = three ? 0.0f : -half_to_float(load_u16(b + 82));
        for (int i = 0; i < 16; i++) S->m16[i] = three ? 0.0f : S->off_d * (float)(sc[i] >> 4);
        for (int h = 0; h < 2; h++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(b + (three ? 32 : 16) + 32 * h));
            for (int j = 0; j < 4; j++) {
                const int r = 4 * h + j;
                __m256i u = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * j), three2);
                if (three)
                    u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(
                        _mm256_srli_epi16(hm, 4 * h + j), one), 2));
                widen_run(u, _mm256_set1_epi16(three ? sc[2 * r] - 32 : sc[2 * r] & 15),
                          _mm256_set1_epi16(three ? sc[2 * r + 1] - 32 : sc[2 * r + 1] & 15),
                          _mm256_set1_epi16(three ? 4 : 0), &S->w[2 * r], &S->w[2 * r + 1]);
            }
        }
        return;
    }
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    S->d = half_to_float(load_u16(b + 208));
    S->off_d = 0.0f;
    const __m256i two = _mm256_set1_epi8(3), off = _mm256_set1_epi16(32);
    for (int h = 0; h < 2; h++) {
        __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
        __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        __m256i bits = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        __m256i runs[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, low4),
                            _mm256_slli_epi16(_mm256_and_si256(bits, two), 4)),
            _mm256_or_si256(_mm256_and_si256(l1, low4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 2), two), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 4), two), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 6), two), 4))};
        for (int k = 0; k < 4; k++) {         /* run 4h + k: scales 8h + 2k, 8h + 2k + 1 */
            const int j = 4 * h + k;
            widen_run(runs[k], _mm256_set1_epi16(sc[2 * j]), _mm256_set1_epi16(sc[2 * j + 1]),
                      off, &S->w[2 * j], &S->w[2 * j + 1]);
        }
    }
}

/* The tile path's decoding: the kernel's widened weights (q * sc) as floats, d * that
 * (- dmin * m for Q4_K): the same values as dequant_superblock. */
static void dequant_superblock_avx2(int code, const uint8_t *restrict b, float *restrict w) {
    Super S;
    load_super(code, b, &S);
    float mins[8];
    _mm256_storeu_ps(mins, _mm256_mul_ps(S.mf, _mm256_set1_ps(S.off_d)));
    const __m256 d = _mm256_set1_ps(S.d);
    for (int k = 0; k < 16; k++) {
        const __m256 m = _mm256_set1_ps(code == Q2K ? S.m16[k] : mins[k / 2]);
        __m256i v = S.w[k];
        __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)));
        __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)));
        _mm256_storeu_ps(w + 16 * k, _mm256_fmadd_ps(lo, d, m));
        _mm256_storeu_ps(w + 16 * k + 8, _mm256_fmadd_ps(hi, d, m));
    }
}


#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* AVX-512 (VNNI, BW): a super-block's 256 weights widen to 8 vectors of 32 int16 (one
 * sub-block of 32 each), zero-extended straight from memory; each meets 32 int16 of x
 * in one dpwssd. Measured on Zen 4 (one core, a [8960, 1536] matrix in cache, batch 1):
 * Q4_K 8.6 ns per super-block against 11.2 with 256-bit vectors, Q6_K 11.1 against
 * 15.0; the multiply port is the limit (16 ymm-equivalent multiplies per super-block
 * and row of x: the sub-scale and the products). */
#define PN_ZMM 1
typedef struct {
    __m512i w[8];           /* sub-block j: elements 32j .. 32j + 31, times sc[j] */
    __m256 mf;              /* Q4_K: its 8 mins times -dmin, as floats (Q6_K: 0) */
    __m512 mf16;            /* Q2_K: its 16 mins (per 16) times -dmin */
    float d, off_d;
} Super512;

static inline void load_super512(int code, const uint8_t *restrict b, Super512 *S) {
    const __m512i low4 = _mm512_set1_epi16(15);
    if (code == Q4K || code == Q5K) {
        uint8_t sm[16];
        S->d = half_to_float(load_u16(b));
        S->off_d = -half_to_float(load_u16(b + 2));
        k_scales_fast(b + 4, sm);
        const int five = code == Q5K;
        const __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)));
        const __m512i one = _mm512_set1_epi16(1);
        for (int g = 0; g < 4; g++) {   /* bytes 32g..: low nibbles 64g + i, high 64g + 32 + i */
            __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                (const __m256i *)(b + (five ? Q5K_QS : 16) + 32 * g)));
            __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_srli_epi16(raw, 4);
            if (five) {                 /* Q5_K: bits 2g, 2g + 1 of qh[i] are the 16s */
                lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * g), one), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * g + 1), one), 4));
            }
            S->w[2 * g] = _mm512_mullo_epi16(lo, _mm512_set1_epi16(sm[2 * g]));
            S->w[2 * g + 1] = _mm512_mullo_epi16(hi, _mm512_set1_epi16(sm[2 * g + 1]));
        }
        S->mf = _mm256_mul_ps(_mm256_set1_ps(S->off_d), _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8)))));
        return;
    }
    const __m512i half = _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                          0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    S->mf = _mm256_setzero_ps();
    S->mf16 = _mm512_setzero_ps();
    if (code == IQ4XS) {    /* sub-block j: 16 bytes, low nibbles (elements 0..15), high */
        uint8_t ls[8];
        iq4xs_scales(b, ls);
        S->d = half_to_float(load_u16(b));
        S->off_d = 0.0f;
        const __m512i lut = _mm512_cvtepi8_epi16(_mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)IQ4_LEVELS)));
        const __m256i low4w = _mm256_set1_epi16(15);
        for (int j = 0; j < 8; j++) {
            const __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 8 + 16 * j)));
            const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, low4w)),
                                                   _mm256_srli_epi16(raw, 4), 1);
            S->w[j] = _mm512_mullo_epi16(_mm512_permutexvar_epi16(idx, lut),
                                         _mm512_set1_epi16((int16_t)(ls[j] - 32)));
        }
        return;
    }
    if (code == Q3K || code == Q2K) {   /* vector 4h + j: run j of half h, a scale per 16 */
        const int three = code == Q3K;
        uint8_t sc[16];
        if (three) q3k_scales(b + 96, sc);
        else memcpy(sc, b, 16);
        __m512i scw = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)sc)));
        S->d = half_to_float(load_u16(b + (three ? 108 : 80)));
        S->off_d = three ? 0.0f : -half_to_float(load_u16(b + 82));
        if (three) scw = _mm512_sub_epi16(scw, _mm512_set1_epi16(32));
        else {
            S->mf16 = _mm512_mul_ps(_mm512_set1_ps(S->off_d), _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_srli_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)sc),
                                                                  _mm_set1_epi8((char)0xF0)), 4))));
            scw = _mm512_and_si512(scw, _mm512_set1_epi16(15));
        }
        const __m512i hm = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)b));
        const __m512i three2 = _mm512_set1_epi16(3), one = _mm512_set1_epi16(1);
        for (int h = 0; h < 2; h++) {
            const __m512i qv = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                (const __m256i *)(b + (three ? 32 : 16) + 32 * h)));
            for (int j = 0; j < 4; j++) {
                const int r = 4 * h + j;
                __m512i u = _mm512_and_si512(_mm512_srli_epi16(qv, 2 * j), three2);
                if (three)
                    u = _mm512_sub_epi16(_mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(
                        _mm512_srli_epi16(hm, 4 * h + j), one), 2)), _mm512_set1_epi16(4));
                S->w[r] = _mm512_mullo_epi16(u, _mm512_permutexvar_epi16(
                    _mm512_add_epi16(half, _mm512_set1_epi16(2 * r)), scw));
            }
        }
        return;
    }
    const uint8_t *ql = b, *qh = b + 128;
    S->d = half_to_float(load_u16(b + 208));
    S->off_d = 0.0f;
    /* 16 int8 scales as int16; vector j takes sc[2j] (its first 16) and sc[2j + 1] */
    const __m512i scw = _mm512_cvtepi8_epi16(_mm256_castsi128_si256(
        _mm_loadu_si128((const __m128i *)(b + 192))));
    const __m512i two = _mm512_set1_epi16(0x30), off = _mm512_set1_epi16(32);
    for (int h = 0; h < 2; h++) {
        __m512i l0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 64 * h)));
        __m512i l1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32)));
        __m512i bits = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)));
        __m512i r[4] = {        /* elements 128h + 32k + l, l < 32 */
            _mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_and_si512(_mm512_slli_epi16(bits, 4), two)),
            _mm512_or_si512(_mm512_and_si512(l1, low4), _mm512_and_si512(_mm512_slli_epi16(bits, 2), two)),
            _mm512_or_si512(_mm512_srli_epi16(l0, 4), _mm512_and_si512(bits, two)),
            _mm512_or_si512(_mm512_srli_epi16(l1, 4), _mm512_and_si512(_mm512_srli_epi16(bits, 2), two))};
        for (int k = 0; k < 4; k++) {
            const int j = 4 * h + k;
            __m512i s = _mm512_permutexvar_epi16(_mm512_add_epi16(half, _mm512_set1_epi16(2 * j)), scw);
            S->w[j] = _mm512_mullo_epi16(_mm512_sub_epi16(r[k], off), s);
        }
    }
}

#endif

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
/* bytes of a group's int16 x per pass, so that it stays in L1 (0: whole rows; tests
 * compare the two) */
static int64_t XSPAN[1] = {24 << 10};
void pn_set_xspan(int64_t bytes) { XSPAN[0] = bytes; }

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

#if defined(PN_ZMM)
/* -- K-quant products of many rows of x, tokens across the vector lanes ------------------
 * gemv_k_rows puts K along a vector's lanes, so every row of x pays its own scale step
 * and horizontal sum per super-block and row of W. Here a vector holds one pair of K
 * positions for 16 rows of x (tokens), the weights' pair (int16, sub-scale multiplied in,
 * as load_super512 widens it) is broadcast from memory, and one `vpdpwssd` gives 32
 * products for 16 tokens; the sums are flushed to floats once per sub-block of 32 and
 * row of W for all 16 tokens together (16 pair products per lane: Q6_K's |q * sc| <= 4096
 * times 16000, twice, 16 times stays below 2^31), and the mins meet x's sums per 32 the
 * same way. W's super-blocks are widened once per chunk of x (not once per group of
 * tokens); x is laid out once per product: xt[group][block][pair][token]. From 13 rows
 * of x (KTILE_MIN below; a last group short of 16 tokens is padded with zeros). */
#define TT 16               /* tokens per vector */
#define TR 8                /* rows of W per pass (their sums in registers) */

typedef struct {
    int code; const uint8_t *qs; int64_t N, K, M, G; const int32_t *xt; const float *dx, *xs;
    float *out; int64_t rows;
} TileArgs;

static __thread float *kt_fa;
static __thread int64_t kt_fa_cap;

static void ktile_chunk(const void *p, int64_t c) {
    const TileArgs *a = p;
    const int64_t nb = a->K / 256, bytes = k_bytes(a->code), G = a->G;
    const int64_t n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    int16_t wbuf[TR][256] __attribute__((aligned(64)));
    float dr[TR], mins[TR][8];
    float facc[TR * TT] __attribute__((aligned(64)));
    if (G > kt_fa_cap) {    /* per group of tokens: TR x TT running sums */
        free(kt_fa);
        kt_fa = aligned_alloc(64, sizeof(float) * (size_t)(G * TR * TT));
        if (!kt_fa) abort();                /* a few KiB */
        kt_fa_cap = G;
    }
    float *fa = kt_fa;
    for (int64_t r0 = n0; r0 < n1; r0 += TR) {
        const int nr = n1 - r0 < TR ? (int)(n1 - r0) : TR;
        memset(fa, 0, sizeof(float) * (size_t)(G * TR * TT));
        for (int64_t blk = 0; blk < nb; blk++) {
            for (int r = 0; r < TR; r++) {
                if (r >= nr) {
                    memset(wbuf[r], 0, sizeof wbuf[r]);
                    dr[r] = 0.0f;
                    memset(mins[r], 0, sizeof mins[r]);
                    continue;
                }
                const uint8_t *b = a->qs + ((r0 + r) * nb + blk) * bytes;
                if (r0 + TR < n1)   /* the next pass's rows, the same block: W streams from memory */
                    for (int64_t l = 0; l < bytes; l += 64)
                        _mm_prefetch((const char *)b + TR * nb * bytes + l, _MM_HINT_T0);
                Super512 S;
                load_super512(a->code, b, &S);
                for (int j = 0; j < 8; j++) _mm512_store_si512((void *)(wbuf[r] + 32 * j), S.w[j]);
                dr[r] = S.d;
                _mm256_storeu_ps(mins[r], S.mf);
            }
            const int has_min = a->code == Q4K || a->code == Q5K;
            for (int64_t g = 0; g < G; g++) {
                const int32_t *xt = a->xt + (g * nb + blk) * 128 * TT;
                const __m512 dxv = _mm512_loadu_ps(a->dx + (g * nb + blk) * TT);
                __m512 f[TR];       /* this block's sum of d * (each sub-block's int sums) */
                for (int r = 0; r < TR; r++) f[r] = _mm512_setzero_ps();
                for (int j = 0; j < 8; j++) {
                    __m512i acc[TR];
                    for (int r = 0; r < TR; r++) acc[r] = _mm512_setzero_si512();
                    const int32_t *w32 = (const int32_t *)wbuf[0] + 16 * j;   /* row r: + 128 r */
                    const int32_t *xj = xt + 16 * j * TT;
#pragma GCC unroll 2
                    for (int q = 0; q < 16; q++) {
                        const __m512i xv = _mm512_load_si512((const void *)(xj + q * TT));
#pragma GCC unroll 8
                        for (int r = 0; r < TR; r++)
                            acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_set1_epi32(w32[128 * r + q]), xv);
                    }
#pragma GCC unroll 8
                    for (int r = 0; r < TR; r++)
                        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(dr[r]), f[r]);
                }
                for (int r = 0; r < TR; r++) {      /* times x's scale per token */
                    __m512 t = _mm512_fmadd_ps(f[r], dxv, _mm512_load_ps(fa + (g * TR + r) * TT));
                    if (has_min)
                        for (int j = 0; j < 8; j++)
                            t = _mm512_fmadd_ps(_mm512_set1_ps(mins[r][j]),
                                                _mm512_loadu_ps(a->xs + ((g * nb + blk) * 8 + j) * TT), t);
                    _mm512_store_ps(fa + (g * TR + r) * TT, t);
                }
            }
        }
        for (int64_t g = 0; g < G; g++) {      /* out[token][row] */
            memcpy(facc, fa + g * TR * TT, sizeof facc);
            for (int t = 0; t < TT && g * TT + t < a->M; t++)
                for (int r = 0; r < nr; r++) a->out[(g * TT + t) * a->N + r0 + r] = facc[r * TT + t];
        }
    }
}

static __thread int32_t *tile_xt;
static __thread float *tile_dx, *tile_xs;
static __thread int64_t tile_cap;

/* x laid out for `need` int32 pairs (G groups x 16 tokens x K / 2), with a scale and a sum
 * per token and 32 values at most (need / 16 floats each: per 256 and per 32 fit) */
static void tile_scratch(int64_t need) {
    if (need <= tile_cap) return;
    free(tile_xt), free(tile_dx), free(tile_xs);
    tile_xt = aligned_alloc(64, (size_t)need * 4);
    tile_dx = aligned_alloc(64, (size_t)(need / 16 + 16) * 4);
    tile_xs = aligned_alloc(64, (size_t)(need / 16 + 16) * 4);
    if (!tile_xt || !tile_dx || !tile_xs) abort();      /* the host is out of memory */
    tile_cap = need;
}

/* x quantized (xq int16 [M, K], a scale per block of `per` values, `S` sums per block)
 * laid out for the lanes: xt[group][block][pair][token], dx[group][block][token],
 * xs[group][block][sum][token]; tokens past M are zeros, never stored back. */
static int64_t tile_layout(const int16_t *xq, const float *xd, const float *xs, int64_t M,
                           int64_t K, int64_t per, int S) {
    const int64_t nb = K / per, P = per / 2, G = (M + TT - 1) / TT;
    tile_scratch(G * TT * K / 2);
    const int32_t *x32 = (const int32_t *)xq;          /* pairs of int16 */
    for (int64_t g = 0; g < G; g++)
        for (int64_t blk = 0; blk < nb; blk++) {
            int32_t *xt = tile_xt + (g * nb + blk) * P * TT;
            float *dx = tile_dx + (g * nb + blk) * TT, *xsv = tile_xs + (g * nb + blk) * S * TT;
            for (int t = 0; t < TT; t++) {
                const int64_t m = g * TT + t;
                const int in = m < M;
                for (int64_t pp = 0; pp < P; pp++) xt[pp * TT + t] = in ? x32[m * (K / 2) + blk * P + pp] : 0;
                dx[t] = in ? xd[m * nb + blk] : 0.0f;
                for (int j = 0; j < S; j++) xsv[j * TT + t] = in ? xs[(m * nb + blk) * S + j] : 0.0f;
            }
        }
    return G;
}

/* Rows of x from which pn_matmul_int takes the token-lane products: [0] K-quants, [1] q4 /
 * q8. Below 16 the last group is part zeros; one core, alternated, on Qwen2.5-1.5B's Q4_K /
 * Q6_K and SmolLM2's Q4_1 matrices the lanes overtake the row kernels from 13 (Q4_K's
 * gate / up: 2.51 against 2.79 ns per super-block, row and token; at 12: 2.59 against
 * 2.18) and 10-11 (Q4_1) rows. pn_set_ktile(0) turns them off, n > 0 starts both at n,
 * n < 0 restores these (tests). */
#define KTILE_K 13
#define KTILE_B 11
static int64_t KTILE_MIN[2] = {KTILE_K, KTILE_B};
void pn_set_ktile(int64_t min_rows) {
    KTILE_MIN[0] = min_rows < 0 ? KTILE_K : min_rows;
    KTILE_MIN[1] = min_rows < 0 ? KTILE_B : min_rows;
}

/* out[M, N] = x @ W.T for a K-quant W (not Q2_K) through ktile_chunk; x already quantized
 * by pn_quantize_xk into xq, xd, xs. */
static void gemm_k_tiled(int code, const uint8_t *qs, int64_t N, int64_t K, const int16_t *xq,
                         const float *xd, const float *xs, int64_t M, float *out) {
    const int64_t G = tile_layout(xq, xd, xs, M, K, 256, 8), rows = piece_rows(N);
    TileArgs a = {code, qs, N, K, M, G, tile_xt, tile_dx, tile_xs, out, rows};
    pool_run(ktile_chunk, &a, (N + rows - 1) / rows);
}

/* The same turn for q4 and q8 (blocks of 32, an fp16 scale and maybe a min each), from
 * 11 rows of x (SmolLM2 batch 16, alternated: 398 -> 557 tok/s; at 8 rows, half the
 * lanes empty, the row kernels win: 332 against 280): each block's int sums take the row's
 * scale times x's scale per token (16 pair products per lane: 128 x 16383, twice, 16
 * times, far below 2^31), the mins x's float sums per block. A pass widens its TR rows
 * of W whole (int16 [TR][K]) and meets every group of 16 tokens with them; beyond the
 * row kernels' 16 rows the tiles of dequantized floats and OpenBLAS took these before. */
typedef struct {
    const PnMat *m; int64_t M, G; const int32_t *xt; const float *dx, *xs; float *out;
    int64_t rows;
} BTileArgs;
#define XB_MAX 32767.0f    /* x's steps per block of 32 here */

static __thread int16_t *bt_w;
static __thread float *bt_sc;
static __thread int64_t bt_cap;

static void btile_chunk(const void *p, int64_t c) {
    const BTileArgs *a = p;
    const PnMat *m = a->m;
    const int64_t K = m->K, N = m->N, nb = K / 32, G = a->G;
    const int64_t n0 = c * a->rows, n1 = n0 + a->rows < N ? n0 + a->rows : N;
    const int with_min = m->code == Q4 || m->code == Q8M;
    if (bt_cap < K) {
        free(bt_w), free(bt_sc);
        bt_w = aligned_alloc(64, (size_t)(TR * K) * 2);
        bt_sc = aligned_alloc(64, (size_t)(2 * TR * nb) * 4 + 64);
        if (!bt_w || !bt_sc) abort();
        bt_cap = K;
    }
    float *scf = bt_sc, *mnf = bt_sc + TR * nb;
    float facc[TR * TT] __attribute__((aligned(64)));
    for (int64_t r0 = n0; r0 < n1; r0 += TR) {
        const int nr = n1 - r0 < TR ? (int)(n1 - r0) : TR;
        for (int r = 0; r < TR; r++) {
            int16_t *w = bt_w + r * K;
            if (r >= nr) {
                memset(w, 0, (size_t)K * 2);
                for (int64_t blk = 0; blk < nb; blk++) scf[r * nb + blk] = mnf[r * nb + blk] = 0.0f;
                continue;
            }
            const int64_t row = r0 + r;
            if (m->code == Q4) {            /* byte i of a block: element i (low), i + 16 (high) */
                const __m128i low4 = _mm_set1_epi8(15);
                for (int64_t blk = 0; blk < nb; blk++) {
                    const __m128i raw = _mm_loadu_si128((const __m128i *)(m->qs + row * (K / 2) + 16 * blk));
                    _mm256_store_si256((__m256i *)(w + 32 * blk), _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4)));
                    _mm256_store_si256((__m256i *)(w + 32 * blk + 16),
                                       _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
                }
            } else if (m->code == IQ4NL) {  /* q4's layout, the levels looked up */
                const __m128i low4 = _mm_set1_epi8(15), lut = _mm_loadu_si128((const __m128i *)IQ4_LEVELS);
                for (int64_t blk = 0; blk < nb; blk++) {
                    const __m128i raw = _mm_loadu_si128((const __m128i *)(m->qs + row * (K / 2) + 16 * blk));
                    _mm256_store_si256((__m256i *)(w + 32 * blk), _mm256_cvtepi8_epi16(
                        _mm_shuffle_epi8(lut, _mm_and_si128(raw, low4))));
                    _mm256_store_si256((__m256i *)(w + 32 * blk + 16), _mm256_cvtepi8_epi16(
                        _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), low4))));
                }
            } else {
                for (int64_t k = 0; k < K; k += 32)
                    _mm512_store_si512((void *)(w + k), _mm512_cvtepi8_epi16(
                        _mm256_loadu_si256((const __m256i *)((const int8_t *)m->qs + row * K + k))));
            }
            for (int64_t blk = 0; blk < nb; blk++) {
                scf[r * nb + blk] = half_to_float(m->sc[row * nb + blk]);
                mnf[r * nb + blk] = with_min ? half_to_float(m->mn[row * nb + blk]) : 0.0f;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            __m512 f[TR];
            for (int r = 0; r < TR; r++) f[r] = _mm512_setzero_ps();
            for (int64_t blk = 0; blk < nb; blk++) {
                __m512i acc[TR];
                for (int r = 0; r < TR; r++) acc[r] = _mm512_setzero_si512();
                const int32_t *xj = a->xt + (g * nb + blk) * 16 * TT;
                const int32_t *w32 = (const int32_t *)bt_w + 16 * blk;     /* row r: + K / 2 r */
#pragma GCC unroll 2
                for (int q = 0; q < 16; q++) {
                    const __m512i xv = _mm512_load_si512((const void *)(xj + q * TT));
#pragma GCC unroll 8
                    for (int r = 0; r < TR; r++)
                        acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_set1_epi32(w32[(K / 2) * r + q]), xv);
                }
                const __m512 dxv = _mm512_load_ps(a->dx + (g * nb + blk) * TT);
                const __m512 xsv = _mm512_load_ps(a->xs + (g * nb + blk) * TT);
#pragma GCC unroll 8
                for (int r = 0; r < TR; r++) {
                    f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]),
                                           _mm512_mul_ps(_mm512_set1_ps(scf[r * nb + blk]), dxv), f[r]);
                    if (with_min) f[r] = _mm512_fmadd_ps(_mm512_set1_ps(mnf[r * nb + blk]), xsv, f[r]);
                }
            }
            for (int r = 0; r < TR; r++) _mm512_store_ps(facc + r * TT, f[r]);
            for (int t = 0; t < TT && g * TT + t < a->M; t++)
                for (int r = 0; r < nr; r++) a->out[(g * TT + t) * N + r0 + r] = facc[r * TT + t];
        }
    }
}

/* out[M, N] = x @ W.T for q4 / q8 (bs 32) through btile_chunk: x quantized per 32
 * (pn_quantize_x, not paired) into the scratch, then laid out tokens across lanes */
static void gemm_b_tiled(const PnMat *m, const float *x, int64_t M, const PnScratch *s, float *out) {
    const int64_t K = m->K, nb = K / 32;
    for (int64_t b = 0; b < M; b++)         /* the full int16 range: no pair of products */
        for (int64_t blk = 0; blk < nb; blk++)      /* here can overflow (see above) */
            s->xd[b * nb + blk] = quantize32(x + b * K + blk * 32, XB_MAX, s->xq + b * K + blk * 32,
                                             s->xq + b * K + blk * 32 + 16, &s->xs[b * nb + blk]);
    const int64_t G = tile_layout(s->xq, s->xd, s->xs, M, K, 32, 1), rows = piece_rows(m->N);
    BTileArgs a = {m, M, G, tile_xt, tile_dx, tile_xs, out, rows};
    pool_run(btile_chunk, &a, (m->N + rows - 1) / rows);
}
int pn_has_lanes(void) { return 1; }
#else
void pn_set_ktile(int64_t min_rows) { (void)min_rows; }    /* 256-bit builds: the row kernels */
int pn_has_lanes(void) { return 0; }
#endif

#if defined(PN_ZMM)
/* -- Q4_K at batch 1 with int8 products: each int16 activation q is two int8 digits,
 * q = 256 h + l (l in [-128, 127], h in [-63, 63]), so `vpdpbusd` (unsigned nibbles times
 * signed digits, 64 products an instruction) gives the same integer sums as the int16
 * path in half the widening work: per super-block 8 dpbusd and 4 int32 sub-scale
 * multiplies against 8 mullw and 8 dpwssd. The nibbles stay bytes: a 64-byte load holds
 * two groups, whose low nibbles are sub-blocks 2g and 2g + 2 in the vector's two halves,
 * so the digits are stored per super-block in the order 0-31, 64-95, 32-63, 96-127,
 * 128-159, 192-223, 160-191, 224-255 (high digits first, then low: 2 x 256 bytes). */
static const int DIGIT_ORDER[8] = {0, 2, 1, 3, 4, 6, 5, 7};   /* 32-chunks of a super-block */

static const int NATURAL_ORDER[8] = {0, 1, 2, 3, 4, 5, 6, 7};    /* Q6_K's */

/* x [1, K] → digits (per super-block: 256 high, then 256 low, 32-chunks in `order`), xd,
 * xs as pn_quantize_xk; sums16 (if not NULL): each 16 values' int16 sum (Q6_K's -32). */
static void quantize_digits(const float *x, int64_t K, int8_t *dg, float *xd, float *xs,
                            const int *order, int32_t *sums16) {
    const int64_t nb = K / 256;
    int16_t q[256];
    for (int64_t blk = 0; blk < nb; blk++) {
        pn_quantize_xk(x + blk * 256, 1, 256, q, xd + blk, xs + blk * 8);
        if (sums16)
            for (int j = 0; j < 16; j++)
                sums16[blk * 16 + j] = _mm512_reduce_add_epi32(
                    _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(q + 16 * j))));
        int8_t *hi = dg + blk * 512, *lo = hi + 256;
        for (int c = 0; c < 8; c++) {
            const __m512i v = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(q + 32 * order[c])));
            const __m512i v2 = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(q + 32 * order[c] + 16)));
            for (int h = 0; h < 2; h++) {
                const __m512i w = h ? v2 : v;
                /* l = ((q + 128) & 255) - 128, h = (q - l) >> 8 */
                const __m512i l = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(w, _mm512_set1_epi32(128)),
                                                                    _mm512_set1_epi32(255)), _mm512_set1_epi32(128));
                const __m512i hh = _mm512_srai_epi32(_mm512_sub_epi32(w, l), 8);
                _mm_storeu_si128((__m128i *)(lo + 32 * c + 16 * h), _mm512_cvtepi32_epi8(l));
                _mm_storeu_si128((__m128i *)(hi + 32 * c + 16 * h), _mm512_cvtepi32_epi8(hh));
            }
        }
    }
}

typedef struct {
    const uint8_t *qs; int64_t N, K; const int8_t *dg; const float *xd, *xs; float *out;
    int64_t rows; const int32_t *s16;
} DgArgs;

/* The int sums of 64 byte values v (4 a lane) against one group's digits, times each
 * lane's sub-scale: (256 v.hi + v.lo) * scale (the batch-1 digit kernels' one step) */
static inline __m512i digits_dot(__m512i v, const int8_t *hi, const int8_t *lo, __m512i scale) {
    const __m512i t = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), v,
        _mm512_loadu_si512((const void *)hi)), 8);
    return _mm512_mullo_epi32(_mm512_dpbusd_epi32(t, v, _mm512_loadu_si512((const void *)lo)), scale);
}

/* Q4_K (five = 0) or Q5_K (five = 1: each nibble takes its bit of qh as its 16, so the
 * values are 0 .. 31, still bytes, and the same digits meet them) */
static inline __attribute__((always_inline)) void k45_digits_rows(const DgArgs *a, int64_t c,
                                                                 const int five) {
    const int64_t bytes = five ? Q5K_BYTES : Q4K_BYTES, qs_at = five ? Q5K_QS : 16;
    const int64_t nb = a->K / 256, n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    const __m512i low4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    /* Q5_K: the 64 bytes at 64 g hold groups 2g, 2g + 1 in their halves, whose low
     * nibbles take bits 4g, 4g + 2 of qh (a shift per 16-bit lane), the high ones + 1 */
    const __m512i halves = _mm512_set_epi64(0x0002000200020002LL, 0x0002000200020002LL,
                                            0x0002000200020002LL, 0x0002000200020002LL, 0, 0, 0, 0);
    /* lanes 0-7 take sub-scale j0, lanes 8-15 j1, for the vectors of sub-blocks (0,2) (1,3) (4,6) (5,7) */
    const __m512i pick[4] = {
        _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4),
        _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5)};
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->qs + n * nb * bytes;
        __m512 acc = _mm512_setzero_ps();
        __m256 accm = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * bytes;
            for (int64_t l = 0; l < bytes; l += 64)
                _mm_prefetch((const char *)b + PF_AHEAD + l, _MM_HINT_T0);
            uint8_t sm[16];
            k_scales_fast(b + 4, sm);
            const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sm)));
            const int8_t *hi = a->dg + blk * 512, *lo = hi + 256;
            __m512i tot = _mm512_setzero_si512();
            const __m512i qh = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)))
                                    : _mm512_setzero_si512();
            for (int g = 0; g < 2; g++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(b + qs_at + 64 * g));
                __m512i v[2] = {_mm512_and_si512(raw, low4),
                                _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4)};
                if (five)
                    for (int k = 0; k < 2; k++)
                        v[k] = _mm512_or_si512(v[k], _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(
                            qh, _mm512_add_epi16(halves, _mm512_set1_epi16(4 * g + k))), one), 4));
                for (int k = 0; k < 2; k++) {
                    const int c = 2 * g + k;          /* 64 digits at 64 c */
                    tot = _mm512_add_epi32(tot, digits_dot(v[k], hi + 64 * c, lo + 64 * c,
                                                           _mm512_permutexvar_epi32(pick[c], sc)));
                }
            }
            const float d = half_to_float(load_u16(b)) * a->xd[blk];
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_set1_ps(d), acc);
            const __m256 mf = _mm256_mul_ps(_mm256_set1_ps(-half_to_float(load_u16(b + 2))), _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8)))));
            accm = _mm256_fmadd_ps(mf, _mm256_loadu_ps(a->xs + blk * 8), accm);
        }
        a->out[n] = _mm512_reduce_add_ps(acc) + hsum(accm);
    }
}

static void q4k_digits_chunk(const void *p, int64_t c) { k45_digits_rows(p, c, 0); }
static void q5k_digits_chunk(const void *p, int64_t c) { k45_digits_rows(p, c, 1); }

/* Scales per 16 values against the int32 lanes of a vpdpbusd over 64 values (4 a lane):
 * lane i of the 64 values at 64 c takes sub-scale 4 c + i / 4. */
static inline void per16_picks(__m512i pick[4]) {
    for (int k = 0; k < 4; k++)
        pick[k] = _mm512_add_epi32(_mm512_set1_epi32(4 * k), _mm512_srli_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2));
}

/* Q6_K at batch 1 with int8 products: the 6-bit values (0 .. 63, still bytes) meet the
 * digits in `vpdpbusd`; the file's -32 offset is taken off once per 16 values through
 * the activations' sums (sum (q - 32) x = sum q x - 32 sum x). The two halves of a
 * super-block accumulate apart (their int32 sums stay below 2^30). */
static void q6k_digits_chunk(const void *p, int64_t c) {
    const DgArgs *a = p;
    const int64_t nb = a->K / 256, n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    const __m512i low4 = _mm512_set1_epi8(15), low2 = _mm512_set1_epi8(3);
    const __m512i shiftA = _mm512_set_epi64(0x0002000200020002LL, 0x0002000200020002LL, 0x0002000200020002LL,
                                            0x0002000200020002LL, 0, 0, 0, 0);
    const __m512i shiftB = _mm512_add_epi16(shiftA, _mm512_set1_epi16(4));
    __m512i pick[4];
    per16_picks(pick);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->qs + n * nb * Q6K_BYTES;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * Q6K_BYTES;
            for (int64_t l = 0; l < Q6K_BYTES; l += 64)
                _mm_prefetch((const char *)b + PF_AHEAD + l, _MM_HINT_T0);
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)));
            const int8_t *hi = a->dg + blk * 512, *lo = hi + 256;
            __m512i tot[2];
            for (int h = 0; h < 2; h++) {
                const __m512i L = _mm512_loadu_si512((const void *)(b + 64 * h));
                const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
                const __m512i q[2] = {
                    _mm512_or_si512(_mm512_and_si512(L, low4), _mm512_slli_epi16(
                        _mm512_and_si512(_mm512_srlv_epi16(H, shiftA), low2), 4)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), low4), _mm512_slli_epi16(
                        _mm512_and_si512(_mm512_srlv_epi16(H, shiftB), low2), 4))};
                tot[h] = _mm512_setzero_si512();
                for (int k = 0; k < 2; k++) {
                    const int cc = 2 * h + k;      /* values 64 cc .. 64 cc + 63 */
                    tot[h] = _mm512_add_epi32(tot[h], digits_dot(q[k], hi + 64 * cc, lo + 64 * cc,
                                                                 _mm512_permutexvar_epi32(pick[cc], sc)));
                }
            }
            const __m512i off = _mm512_mullo_epi32(sc, _mm512_loadu_si512((const void *)(a->s16 + blk * 16)));
            const __m512 t = _mm512_sub_ps(_mm512_add_ps(_mm512_cvtepi32_ps(tot[0]), _mm512_cvtepi32_ps(tot[1])),
                                           _mm512_mul_ps(_mm512_cvtepi32_ps(off), _mm512_set1_ps(32.0f)));
            acc = _mm512_fmadd_ps(t, _mm512_set1_ps(half_to_float(load_u16(b + 208)) * a->xd[blk]), acc);
        }
        a->out[n] = _mm512_reduce_add_ps(acc);
    }
}

/* Q3_K (three = 1) and Q2_K at batch 1 with int8 products, as Q6_K: their 2-bit values
 * (Q3_K: with its hmask bit as the 4, 0 .. 7) stay bytes and meet the digits in
 * `vpdpbusd`; Q3_K's -4 offset comes off through the activations' sums per 16, and so
 * do Q2_K's mins (integers times the same sums). The 64 values at 64 cc are runs 2k,
 * 2k + 1 of half h (cc = 2h + k): bits 4k, 4k + 2 of qs[32h + l] in the vector's two
 * halves (a shift per 16-bit lane), bits 4h + 2k, + 1 of hmask[l]. */
static inline __attribute__((always_inline)) void k23_digits_rows(const DgArgs *a, int64_t c,
                                                                 const int three) {
    const int64_t bytes = three ? Q3K_BYTES : Q2K_BYTES;
    const int64_t nb = a->K / 256, n0 = c * a->rows, n1 = n0 + a->rows < a->N ? n0 + a->rows : a->N;
    const __m512i low2 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    const __m512i up2 = _mm512_set_epi64(0x0002000200020002LL, 0x0002000200020002LL, 0x0002000200020002LL,
                                         0x0002000200020002LL, 0, 0, 0, 0);
    const __m512i up1 = _mm512_srli_epi16(up2, 1);
    __m512i pick[4];
    per16_picks(pick);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->qs + n * nb * bytes;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * bytes;
            for (int64_t l = 0; l < bytes; l += 64)
                _mm_prefetch((const char *)b + PF_AHEAD + l, _MM_HINT_T0);
            uint8_t sm[16];
            if (three) q3k_scales(b + 96, sm);
            const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(three ? sm : b)));
            const __m512i sc = three ? _mm512_sub_epi32(raw, _mm512_set1_epi32(32))
                                     : _mm512_and_si512(raw, _mm512_set1_epi32(15));
            const __m512i hm = three ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)b))
                                     : _mm512_setzero_si512();
            const int8_t *hi = a->dg + blk * 512, *lo = hi + 256;
            __m512i tot = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    (const __m256i *)(b + (three ? 32 : 16) + 32 * h)));
                for (int k = 0; k < 2; k++) {
                    const int cc = 2 * h + k;
                    __m512i v = _mm512_and_si512(_mm512_srlv_epi16(q, _mm512_add_epi16(up2, _mm512_set1_epi16(4 * k))), low2);
                    if (three)
                        v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(
                            hm, _mm512_add_epi16(up1, _mm512_set1_epi16(4 * h + 2 * k))), one), 2));
                    tot = _mm512_add_epi32(tot, digits_dot(v, hi + 64 * cc, lo + 64 * cc,
                                                           _mm512_permutexvar_epi32(pick[cc], sc)));
                }
            }
            const __m512i s16 = _mm512_loadu_si512((const void *)(a->s16 + blk * 16));
            const float dx = a->xd[blk];
            if (three) {
                const __m512i off = _mm512_mullo_epi32(sc, s16);
                acc = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(
                    _mm512_cvtepi32_ps(off), _mm512_set1_ps(4.0f))),
                    _mm512_set1_ps(half_to_float(load_u16(b + 108)) * dx), acc);
            } else {
                const __m512i mins = _mm512_mullo_epi32(_mm512_srli_epi32(raw, 4), s16);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_set1_ps(half_to_float(load_u16(b + 80)) * dx), acc);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins),
                                      _mm512_set1_ps(-half_to_float(load_u16(b + 82)) * dx), acc);
            }
        }
        a->out[n] = _mm512_reduce_add_ps(acc);
    }
}

static void q3k_digits_chunk(const void *p, int64_t c) { k23_digits_rows(p, c, 1); }
static void q2k_digits_chunk(const void *p, int64_t c) { k23_digits_rows(p, c, 0); }

static __thread int32_t *dg_sums;   /* a Q6_K / Q3_K / Q2_K product's per-16 activation sums */
static __thread int64_t dg_sums_cap;
#endif

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

/* -- one call per product (kernels_cpu.matmul): a matrix's fixed arguments travel as one
 * struct, its scratch as another, so a decode step's hundred-odd products cost one
 * ctypes call each instead of three (12.9 -> 5 us per call measured on a tiny q4 matrix,
 * most of it argument conversion) */

#define NEXT_BYTES (512 << 10)      /* of the next matrix, fetched between products */

/* Q4_K at batch 1 through int8 digits (0: the int16 path, which tests compare it with) */
static int DIGITS[1] = {1};
void pn_set_digits(int on) { DIGITS[0] = on; }

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

#if defined(PN_AMX) && defined(PN_ZMM)
static void super_bf16(int code, const uint8_t *b, uint16_t *hi, uint16_t *lo) {
    Super512 S;
    load_super512(code, b, &S);
    float mins[8];
    _mm256_storeu_ps(mins, S.mf);
    const __m512 d = _mm512_set1_ps(S.d);
    for (int j = 0; j < 8; j++) {
        const __m512 mj = _mm512_set1_ps(mins[j]);
        __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(S.w[j])));
        __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(S.w[j], 1)));
        store_split(hi + 32 * j, lo + 32 * j, _mm512_fmadd_ps(a, d, mj), _mm512_fmadd_ps(c, d, mj));
    }
}

/* -- decode steps on AMX tiles: the weights' own codes, exact in bf16 --------------------
 * For 16 rows of x or fewer, decoding every weight into float halves costs more than the
 * integer products (above). Here a weight's code (q4: 0 .. 15, q8: -128 .. 127, Q6_K's
 * q - 32) is already an exact bf16, so one tile of codes meets x's hi and lo halves in two
 * tile products per run (32 values; Q6_K's runs of 16), and each run's sums take their
 * scale (and min, times x's sum over the run) in the vector registers: 16 rows of W, one
 * accumulator per row, the run's products summed exactly as a float product would be, to
 * x's hi + lo (~2^-17). */
static uint16_t lut_codes[96];      /* bf16 of 0 .. 15 (q4), then of -32 .. 31 (Q6_K) */

static int amx_codes_ok(const PnMat *m) {
    if (!lut_codes[1]) {
        for (int i = 0; i < 96; i++) {
            float f = i < 32 ? (float)(i & 15) : (float)(i - 64);
            uint32_t u;
            memcpy(&u, &f, 4);
            __atomic_store_n(&lut_codes[i], (uint16_t)(u >> 16), __ATOMIC_RELAXED);
        }
    }
    return m->code == Q4K || m->code == Q6K || m->code == Q4
           || ((m->code == Q8 || m->code == Q8M) && m->bs == 32);
}

#define UNIT 256                    /* values of a row decoded at a time (a super-block) */

/* Codes of row r, values [k0, k0 + n) (n <= UNIT, k0 on a super-block for K-quants),
 * into codes[0 ..), with each run's scale and min (the min multiplies x's sum over it). */
static void row_codes(const PnMat *m, int64_t r, int64_t k0, int64_t n, uint16_t *codes,
                      float *sc, float *mn) {
    const int64_t K = m->K;
    if (m->code == Q4K) {
        const uint8_t *b = m->qs + (r * (K / 256) + k0 / 256) * Q4K_BYTES;
        const __m512i lut = _mm512_loadu_si512((const void *)lut_codes);
        const __m256i low4 = _mm256_set1_epi8(15);
        uint8_t sm[16];
        k_scales_fast(b + 4, sm);
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)sm))), _mm512_mask_blend_ps(0xFF00,
            _mm512_set1_ps(half_to_float(load_u16(b))), _mm512_set1_ps(-half_to_float(load_u16(b + 2)))));
        _mm256_storeu_ps(sc, _mm512_castps512_ps256(f));             /* d * sc[j] */
        _mm256_storeu_ps(mn, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
        for (int g = 0; g < 4; g++) {  /* bytes 32g..: low nibbles 64g + i, high 64g + 32 + i */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * g));
            _mm512_storeu_si512(codes + 64 * g, _mm512_permutexvar_epi16(
                _mm512_cvtepu8_epi16(_mm256_and_si256(raw, low4)), lut));
            _mm512_storeu_si512(codes + 64 * g + 32, _mm512_permutexvar_epi16(
                _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4)), lut));
        }
        return;
    }
    if (m->code == Q6K) {
        const uint8_t *b = m->qs + (r * (K / 256) + k0 / 256) * Q6K_BYTES;
        const uint8_t *ql = b, *qh = b + 128;
        const __m512i lo = _mm512_loadu_si512((const void *)(lut_codes + 32));
        const __m512i hi = _mm512_loadu_si512((const void *)(lut_codes + 64));
        const __m512i low4 = _mm512_set1_epi16(15), two = _mm512_set1_epi16(0x30);
        _mm512_storeu_ps(sc, _mm512_mul_ps(_mm512_set1_ps(half_to_float(load_u16(b + 208))),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))))));
        (void)mn;                   /* no mins */
        for (int h = 0; h < 2; h++) {   /* as load_super512: elements 128h + 32k + l */
            __m512i l0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 64 * h)));
            __m512i l1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32)));
            __m512i bits = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)));
            __m512i q[4] = {
                _mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_and_si512(_mm512_slli_epi16(bits, 4), two)),
                _mm512_or_si512(_mm512_and_si512(l1, low4), _mm512_and_si512(_mm512_slli_epi16(bits, 2), two)),
                _mm512_or_si512(_mm512_srli_epi16(l0, 4), _mm512_and_si512(bits, two)),
                _mm512_or_si512(_mm512_srli_epi16(l1, 4), _mm512_and_si512(_mm512_srli_epi16(bits, 2), two))};
            for (int k = 0; k < 4; k++)
                _mm512_storeu_si512(codes + 128 * h + 32 * k, _mm512_permutex2var_epi16(lo, q[k], hi));
        }
        return;
    }
    const int64_t nb = K / 32;
    for (int64_t blk = k0 / 32, j = 0; j < n / 32; blk++, j++) {
        sc[j] = half_to_float(m->sc[r * nb + blk]);
        mn[j] = m->code == Q8 ? 0.0f : half_to_float(m->mn[r * nb + blk]);
        __m512i v;
        if (m->code == Q4) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(m->qs + r * (K / 2) + 16 * blk));
            const __m128i low4 = _mm_set1_epi8(15);
            const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(
                _mm_and_si128(raw, low4)), _mm_and_si128(_mm_srli_epi16(raw, 4), low4), 1);
            v = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(both),
                                         _mm512_loadu_si512((const void *)lut_codes));
        } else {
            const int8_t *q = (const int8_t *)m->qs + r * K + 32 * blk;
            __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
            __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
            v = (__m512i)_mm512_cvtne2ps_pbh(b, a);       /* integers of 8 bits: exact */
        }
        _mm512_storeu_si512(codes + 32 * j, v);
    }
}

static void amx_codes_config(int run, int side) {
    TileCfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    if (side) {                     /* sums 0-3, codes 4-5, x 6-7 */
        for (int t = 0; t < 4; t++) c.colsb[t] = 64, c.rows[t] = 16;
        for (int t = 4; t < 6; t++) c.colsb[t] = (uint16_t)(2 * run), c.rows[t] = 16;
        for (int t = 6; t < 8; t++) c.colsb[t] = 64, c.rows[t] = (uint8_t)(run / 2);
        _tile_loadconfig(&c);
        return;
    }
    for (int t = 0; t < 2; t++) {   /* two runs in flight: tiles t, 2 + t, 4 + 2t, 5 + 2t */
        c.colsb[t] = 64, c.rows[t] = 16;                        /* sums: rows of W x 16 of x */
        c.colsb[2 + t] = (uint16_t)(2 * run), c.rows[2 + t] = 16;   /* codes: rows of W x run */
        c.colsb[4 + 2 * t] = c.colsb[5 + 2 * t] = 64;               /* x's hi and lo halves */
        c.rows[4 + 2 * t] = c.rows[5 + 2 * t] = (uint8_t)(run / 2);
    }
    _tile_loadconfig(&c);
}

static __thread uint16_t *amx_codes;   /* a thread's 16 rows of codes, UNIT each */

/* acc[i] += run j's sums of row i times its scale (+ its min times x's sums xs) */
static inline void codes_scale(__m512 acc[16], float sums[16][16], float sc[16][16],
                               float mn[16][16], int64_t j, const float *xs) {
    if (xs) {
        const __m512 s = _mm512_load_ps(xs);
        #pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            acc[i] = _mm512_fmadd_ps(s, _mm512_set1_ps(mn[i][j]), _mm512_fmadd_ps(
                _mm512_loadu_ps(sums[i]), _mm512_set1_ps(sc[i][j]), acc[i]));
        return;
    }
    #pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(sums[i]), _mm512_set1_ps(sc[i][j]), acc[i]);
}

/* run j of the codes (tile A) against x's halves side by side (tile X) into sums tile C */
#define CODES_RUN1(C, A, X, j) do {                                                        \
        const int64_t k_ = k0 + (j) * run;                                                 \
        _tile_zero(C);                                                                     \
        _tile_loadd(A, amx_codes + (j) * run, UNIT * 2);                                   \
        _tile_loadd(X, a->xp + 2 * (k_ / 32) * 256 + (k_ % 32) / 2 * 16, 64);              \
        _tile_dpbf16ps(C, A, X);                                                           \
    } while (0)

/* run j of the codes (tile A) against x's halves (tiles XH, XL) into sums tile C */
#define CODES_RUN(C, A, XH, XL, j) do {                                                   \
        const int64_t k_ = k0 + (j) * run;                                                 \
        const uint32_t *xh_ = a->xp + 2 * (k_ / 32) * 256 + (k_ % 32) / 2 * 16;            \
        _tile_zero(C);                                                                     \
        _tile_loadd(A, amx_codes + (j) * run, UNIT * 2);                                   \
        _tile_loadd(XH, xh_, 64);                                                          \
        _tile_loadd(XL, xh_ + 256, 64);                                                    \
        _tile_dpbf16ps(C, A, XH);                                                          \
        _tile_dpbf16ps(C, A, XL);                                                          \
    } while (0)

static void amx_codes_chunk(const void *p, int64_t c) {
    const AmxArgs *a = p;
    const PnMat *m = a->m;
    const int64_t K = m->K, N = m->N;
    const int run = m->code == Q6K ? 16 : 32;
    const int has_min = m->code == Q4K || m->code == Q4 || m->code == Q8M;
    if (!amx_codes && !(amx_codes = aligned_alloc(64, 16 * UNIT * 2))) abort();
    float sc[16][16], mn[16][16], sums[16][16];
    const int64_t rowb = is_k(m->code) ? K / 256 * k_bytes(m->code) : m->code == Q4 ? K / 2 : K,
                  tile_b = 16 * rowb;   /* bytes of 16 rows of W */
    amx_codes_config(run, a->side);
    const int64_t first = AMX_CODES_ROWS * c;
    for (int64_t o = 0; o < tile_b; o += 64)    /* this piece's first 16 rows, all at once */
        _mm_prefetch((const char *)m->qs + first * rowb + o, _MM_HINT_T0);
    for (int64_t n0 = first; n0 < first + AMX_CODES_ROWS && n0 < N; n0 += 16) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < K; k0 += UNIT) {
            const int64_t n = K - k0 < UNIT ? K - k0 : UNIT;
            if (n0 + 16 < N && n0 + 16 < first + AMX_CODES_ROWS) {
                /* the next 16 rows' part (one stream, not 16 sparse ones) */
                const char *nx = (const char *)m->qs + (n0 + 16) * rowb;
                for (int64_t o = k0 * tile_b / K; o < (k0 + n) * tile_b / K; o += 64)
                    _mm_prefetch(nx + o, _MM_HINT_T0);
            }
            for (int i = 0; i < 16; i++)
                if (n0 + i < N) row_codes(m, n0 + i, k0, n, amx_codes + i * UNIT, sc[i], mn[i]);
                else {
                    memset(amx_codes + i * UNIT, 0, UNIT * 2);
                    memset(sc[i], 0, sizeof sc[i]), memset(mn[i], 0, sizeof mn[i]);
                }
            /* runs in pairs: the second's products run on the tiles while the first's
             * sums take their scales */
            const int64_t nr = n / run;
            if (a->side) {
                /* one product per run (x's hi and lo halves side by side), four runs' sums
                 * tiles in turn: a run's sums take their scales two runs after its product
                 * was issued, while the next ones run on the tiles */
#define CODES_FIX(C, j) do {                                                               \
        _tile_stored(C, sums, 64);                                                         \
        codes_scale(acc, sums, sc, mn, j, has_min ? a->xs + 16 * ((k0 + (j) * run) / 32) : NULL); \
    } while (0)
                if (nr > 0) CODES_RUN1(0, 4, 6, 0);
                if (nr > 1) CODES_RUN1(1, 5, 7, 1);
                for (int64_t j = 0; j < nr; j += 4) {
                    if (j + 2 < nr) CODES_RUN1(2, 4, 6, j + 2);
                    CODES_FIX(0, j);
                    if (j + 3 < nr) CODES_RUN1(3, 5, 7, j + 3);
                    if (j + 1 < nr) CODES_FIX(1, j + 1);
                    if (j + 4 < nr) CODES_RUN1(0, 4, 6, j + 4);
                    if (j + 2 < nr) CODES_FIX(2, j + 2);
                    if (j + 5 < nr) CODES_RUN1(1, 5, 7, j + 5);
                    if (j + 3 < nr) CODES_FIX(3, j + 3);
                }
#undef CODES_FIX
                continue;
            }
            for (int64_t j = 0; j < nr; j += 2) {
                CODES_RUN(0, 2, 4, 5, j);
                if (j + 1 < nr) CODES_RUN(1, 3, 6, 7, j + 1);
                _tile_stored(0, sums, 64);
                codes_scale(acc, sums, sc, mn, j, has_min ? a->xs + 16 * ((k0 + j * run) / 32) : NULL);
                if (j + 1 < nr) {
                    _tile_stored(1, sums, 64);
                    codes_scale(acc, sums, sc, mn, j + 1,
                                has_min ? a->xs + 16 * ((k0 + (j + 1) * run) / 32) : NULL);
                }
            }
        }
        for (int i = 0; i < 16; i++)    /* side by side: lanes 8-15 hold the lo halves' sums */
            _mm512_storeu_ps(sums[i], a->side ? _mm512_add_ps(acc[i], _mm512_shuffle_f32x4(
                acc[i], acc[i], 0x4E)) : acc[i]);
        for (int64_t r = 0; r < a->M; r++)
            for (int i = 0; i < 16 && n0 + i < N; i++) a->out[r * N + n0 + i] = sums[i][r];
    }
}
#endif

#if !defined(PN_ZMM)
/* -- Q4_K and Q5_K at batch 1 on 256-bit vectors (AVX2 hosts): x's int16 steps q (|q| <=
 * 16000, pn_quantize_xk) as two int8 digits, q = 128 h + l (h in -125 .. 124, l in
 * 0 .. 127), which meet the weights' bytes (0 .. 15, Q5_K 0 .. 31) in `vpmaddubsw`; the
 * two digits' pair sums (at most 2 x 31 x 127) take the sub-scale (times 128 for h) in
 * `vpmaddwd`. The same integer sums as the int16 row kernel (k_row_avx2) without its
 * widening: no byte is unpacked to int16, no sub-scale multiplied into the weights, so
 * a super-block costs 16 multiplies, 8 loads of x and no lane shuffles. Each int32 lane
 * sums 32 values per super-block (32 x 31 x 63 x 16000 < 2^31). */
static __thread int8_t *dg2_buf;
static __thread int64_t dg2_cap;

/* int16 steps → digits: hi[i] = q >> 7, lo[i] = q & 127 (K a multiple of 16) */
static void split_digits(const int16_t *q, int64_t K, int8_t *hi, int8_t *lo) {
    const __m256i low7 = _mm256_set1_epi16(127);
    for (int64_t i = 0; i < K; i += 16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + i));
        const __m256i h = _mm256_srai_epi16(v, 7), l = _mm256_and_si256(v, low7);
        _mm_storeu_si128((__m128i *)(hi + i), _mm_packs_epi16(_mm256_castsi256_si128(h),
                                                             _mm256_extracti128_si256(h, 1)));
        _mm_storeu_si128((__m128i *)(lo + i), _mm_packs_epi16(_mm256_castsi256_si128(l),
                                                             _mm256_extracti128_si256(l, 1)));
    }
}

typedef struct {
    int code; const uint8_t *qs; int64_t N, K; const int8_t *xh, *xl; const float *xd, *xs;
    float *out; int64_t rows;
} Dg2Args;

/* w's 32 values (u8) against 32 digits of x, all under one int16 scale (in every lane of sl) */
static inline __m256i digit_pair(__m256i w, const int8_t *xh, const int8_t *xl, __m256i sl) {
    const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)xh)),
                                        _mm256_slli_epi16(sl, 7));
    const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)xl)), sl);
    return _mm256_add_epi32(a, b);
}

/* scale j of S (8 int16 scales in each lane) in every lane: one byte shuffle */
static inline __m256i one_scale(__m256i S, int j) {
    return _mm256_shuffle_epi8(S, _mm256_set1_epi16((int16_t)((2 * j) | ((2 * j + 1) << 8))));
}

/* A Q4_K (Q5_K) super-block's values 64t .. 64t + 31 (lo) and 64t + 32 .. + 63 (hi) as
 * bytes 0 .. 15 (0 .. 31): low and high nibbles of bytes 32t.., Q5_K's 16s from bits
 * 2t, 2t + 1 of qh */
static inline void k45_values(const uint8_t *b, int five, __m256i qh, int t, __m256i *lo,
                              __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + (five ? Q5K_QS : 16) + 32 * t));
    *lo = _mm256_and_si256(raw, low4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
    if (five) {
        *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), one), 4));
        *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t + 1), one), 4));
    }
}

/* A Q6_K super-block's values 64t .. 64t + 31 (r0) and 64t + 32 .. + 63 (r1) as bytes
 * 0 .. 63 (the file's -32 not taken off): quad t = 2h + up of the half h (low nibbles of
 * ql for up 0, high for 1, two bits each of qh) */
static inline void q6k_values(const uint8_t *b, int t, __m256i *r0, __m256i *r1) {
    const __m256i low4 = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
    const int h = t / 2, up = t % 2;
    const __m256i q0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
    const __m256i q1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
    const __m256i qb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    const __m256i l0 = up ? _mm256_srli_epi16(q0, 4) : q0;
    const __m256i l1 = up ? _mm256_srli_epi16(q1, 4) : q1;
    const __m256i bits = up ? _mm256_srli_epi16(qb, 4) : qb;
    *r0 = _mm256_or_si256(_mm256_and_si256(l0, low4),
                          _mm256_slli_epi16(_mm256_and_si256(bits, two), 4));
    *r1 = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_slli_epi16(
        _mm256_and_si256(_mm256_srli_epi16(bits, 2), two), 4));
}

static void k45_digits2_chunk(const void *p, int64_t c) {
    const Dg2Args *a = p;
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
            const int8_t *xh = a->xh + blk * 256, *xl = a->xl + blk * 256;
            const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
            const __m256i S = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sm)));
            __m256i ci = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {   /* bytes 32t..: low nibbles 64t + i, high 64t + 32 + i */
                __m256i lo, hi;
                k45_values(b, five, qh, t, &lo, &hi);
                ci = _mm256_add_epi32(ci, _mm256_add_epi32(
                    digit_pair(lo, xh + 64 * t, xl + 64 * t, one_scale(S, 2 * t)),
                    digit_pair(hi, xh + 64 * t + 32, xl + 64 * t + 32, one_scale(S, 2 * t + 1))));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ci), _mm256_set1_ps(half_to_float(load_u16(b)) * a->xd[blk]), acc);
            accm = _mm256_fmadd_ps(mf, _mm256_loadu_ps(a->xs + blk * 8), accm);
        }
        a->out[n] = hsum(_mm256_add_ps(acc, accm));
    }
}

/* Q6_K at batch 1 the same way: its 6-bit values (0 .. 63, the -32 not taken off) meet
 * the digits in `vpmaddubsw` (pairs at most 2 x 63 x 125), each run of 16 its int8
 * scale (times 128 for h) in `vpmaddwd`; the file's -32 comes off once per run through
 * x's sums per 16 (xs16: -32 times the run's sum, as a float). Each half of the
 * super-block's int32 sums is flushed to floats on its own: a lane then sums 16 values
 * (16 x 63 x 128 x 16000 < 2^31). */
static __thread float *xs16_dg;
static __thread int64_t xs16_dg_cap;

typedef struct {
    const uint8_t *qs; int64_t N, K; const int8_t *xh, *xl; const float *xd, *xs16;
    float *out; int64_t rows;
} Dg6Args;

/* vector v (values 32v ..) of a Q6_K super-block wants scales 2v (its first 16) and 2v + 1:
 * from S (the 16 scales as int16, both lanes holding scales 8 (v / 4) .. + 7), one byte
 * shuffle picks element 2v % 8 for the low lane and 2v % 8 + 1 for the high one */
static inline __m256i run_scales(__m256i S, int v) {
    const int e0 = (2 * v) & 7, e1 = e0 + 1;
    const __m256i ctrl = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_set1_epi16((int16_t)((2 * e0) | ((2 * e0 + 1) << 8)))),
        _mm_set1_epi16((int16_t)((2 * e1) | ((2 * e1 + 1) << 8))), 1);
    return _mm256_shuffle_epi8(S, ctrl);
}

static void q6k_digits2_chunk(const void *p, int64_t c) {
    const Dg6Args *a = p;
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
            const int8_t *xh = a->xh + blk * 256, *xl = a->xl + blk * 256;
            const __m128i s8 = _mm_loadu_si128((const __m128i *)sc);
            const __m256i S16 = _mm256_cvtepi8_epi16(s8);
            const __m256i Sh[2] = {_mm256_permute2x128_si256(S16, S16, 0x00),
                                   _mm256_permute2x128_si256(S16, S16, 0x11)};
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {   /* values 128h..: quads t = 2h (low nibbles), 2h + 1 */
                __m256i ci = _mm256_setzero_si256();
#pragma GCC unroll 2
                for (int up = 0; up < 2; up++) {
                    const int t = 2 * h + up;
                    __m256i r0, r1;
                    q6k_values(b, t, &r0, &r1);
                    ci = _mm256_add_epi32(ci, _mm256_add_epi32(
                        digit_pair(r0, xh + 64 * t, xl + 64 * t, run_scales(Sh[h], 2 * t)),
                        digit_pair(r1, xh + 64 * t + 32, xl + 64 * t + 32, run_scales(Sh[h], 2 * t + 1))));
                }
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ci), _mm256_set1_ps(d * a->xd[blk]), acc);
            }
            const __m256 dv = _mm256_set1_ps(d);
            accm = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), dv),
                                   _mm256_loadu_ps(a->xs16 + blk * 16), accm);
            accm = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), dv),
                                   _mm256_loadu_ps(a->xs16 + blk * 16 + 8), accm);
        }
        a->out[n] = hsum(_mm256_add_ps(acc, accm));
    }
}

static int q6k_digits2(const PnMat *m, const float *x, const PnScratch *s, float *out) {
    const int64_t K = m->K;
    if (2 * K > dg2_cap) {
        int8_t *nbuf = aligned_alloc(64, (size_t)(2 * K + 63) / 64 * 64);
        if (!nbuf) return 0;
        free(dg2_buf), dg2_buf = nbuf, dg2_cap = 2 * K;
    }
    if (K / 16 > xs16_dg_cap) {
        float *nbuf = aligned_alloc(64, (size_t)(K / 16 + 15) / 16 * 16 * sizeof(float));
        if (!nbuf) return 0;
        free(xs16_dg), xs16_dg = nbuf, xs16_dg_cap = K / 16;
    }
    pn_quantize_xk(x, 1, K, s->xq, s->xd, s->xs);
    split_digits(s->xq, K, dg2_buf, dg2_buf + K);
    for (int64_t r = 0; r < K / 16; r++) {          /* -32 x each run's sum, in x's steps */
        int32_t t = 0;
        for (int i = 0; i < 16; i++) t += s->xq[16 * r + i];
        xs16_dg[r] = -32.0f * (float)t * s->xd[r / 16];
    }
    Dg6Args a = {m->qs, m->N, K, dg2_buf, dg2_buf + K, s->xd, xs16_dg, out, piece_rows(m->N)};
    pool_run(q6k_digits2_chunk, &a, (m->N + a.rows - 1) / a.rows);
    return 1;
}

/* Q4_K / Q5_K at batch 1 through the digits; 0 where the buffer cannot be had */
static int k45_digits2(const PnMat *m, const float *x, const PnScratch *s, float *out) {
    if (2 * m->K > dg2_cap) {
        int8_t *nbuf = aligned_alloc(64, (size_t)(2 * m->K + 63) / 64 * 64);
        if (!nbuf) return 0;
        free(dg2_buf), dg2_buf = nbuf, dg2_cap = 2 * m->K;
    }
    pn_quantize_xk(x, 1, m->K, s->xq, s->xd, s->xs);
    split_digits(s->xq, m->K, dg2_buf, dg2_buf + m->K);
    Dg2Args a = {m->code, m->qs, m->N, m->K, dg2_buf, dg2_buf + m->K, s->xd, s->xs, out,
                 piece_rows(m->N)};
    pool_run(k45_digits2_chunk, &a, (m->N + a.rows - 1) / a.rows);
    return 1;
}

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

/* the kinds of runs with an fp16 scale (and maybe a min) each: q4, iq4nl, q8 */
static inline int i8_kind(int code) {
    return code == Q4 || code == Q8 || code == Q8M || code == IQ4NL;
}
static inline int blocks32(const PnMat *m) { return i8_kind(m->code) && m->bs == 32; }

/* -- blocks of 32, many rows of x, 256-bit builds: weight rows across the lanes --------
 * A prefill chunk (more rows than the row kernels' MAXB) multiplied by a q4 / q8 / iq4nl
 * matrix with blocks of 32. Each thread widens a group of 8 rows of W to int16 once per
 * call, interleaved so that one vector holds one pair of K positions of all 8 rows
 * (lanes 2i, 2i + 1: row i), into its own buffer (8 x K x 2 bytes: L1 or L2); 6 rows of
 * x then pass the group at a time: a pair of x's int16 values is broadcast and meets the
 * 8 rows in one `vpmaddwd`, so a block's 16 products of a row of x leave its 8 rows'
 * sums in one int32 vector, scaled by the 8 rows' block scales times x's in one
 * multiply-add (and the mins by x's exact block sums in another). The row kernels pay a
 * conversion, a scale and a horizontal sum per block, row of W and row of x; here one per
 * 8 rows of W. x stays int16 per block of 32 in the full range (bg_quantize, as the
 * AVX-512 token lanes). W keeps the file's layout: nothing is repacked at load. */
#if !defined(PN_ZMM)
#define BG_X 6              /* rows of x a pass (4: 0.84x, 5: 0.95x, 8: 0.80x of 6, alternated) */

static __thread int16_t *bg_w;      /* a thread's group of 8 rows, widened and interleaved */
static __thread float *bg_s;        /* their block scales then mins, [K/32][8] each */
static __thread int64_t bg_cap;

/* 8 vectors of 8 int32 → their transpose (r[i] lane j ← r[j] lane i) */
static inline void transpose8(__m256i r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_castsi256_ps(_mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]));
        t[2 * i + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]));
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) {
            u[4 * i + h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0x44);
            u[4 * i + 2 + h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0xEE);
        }
    /* u[0]: lanes 0,1 of rows 0-3 at (0,4),(1,5)...: u[0] = rows 0..3 col 0 | col 4 */
    const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    __m256 v[8];
    for (int i = 0; i < 8; i++) v[i] = u[order[i]];
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_castps_si256(_mm256_permute2f128_ps(v[i], v[i + 4], 0x20));
        r[i + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
    }
}

/* rows n0 .. n0+7 of W (rows past N: zeros) → bg_w [K/32][16 pairs][8 rows x 2] and their
 * scales and mins as floats → bg_s [K/32][8], bg_s + K/4 [K/32][8] */
static void bg_widen(const PnMat *m, int64_t n0) {
    const int64_t nx = m->K / 32, row_bytes = m->code == Q4 || m->code == IQ4NL ? m->K / 2 : m->K;
    const int with_min = m->code == Q4 || m->code == Q8M;
    float *sw = bg_s, *mw = bg_s + nx * 8;
    for (int64_t blk = 0; blk < nx; blk++) {
        __m256i lo[8], hi[8];                   /* row i's pairs 0..7, 8..15 as int32 */
        for (int i = 0; i < 8; i++) {
            const int64_t n = n0 + i;
            if (n < m->N) {
                load_block(m->code, m->qs + n * row_bytes, blk, &lo[i], &hi[i]);
                sw[blk * 8 + i] = half_to_float(m->sc[n * nx + blk]);
                mw[blk * 8 + i] = with_min ? half_to_float(m->mn[n * nx + blk]) : 0.0f;
            } else {
                lo[i] = hi[i] = _mm256_setzero_si256();
                sw[blk * 8 + i] = mw[blk * 8 + i] = 0.0f;
            }
        }
        transpose8(lo);
        transpose8(hi);
        __m256i *dst = (__m256i *)(bg_w + blk * 256);
        for (int j = 0; j < 8; j++) {
            _mm256_store_si256(dst + j, lo[j]);
            _mm256_store_si256(dst + 8 + j, hi[j]);
        }
    }
}

static inline __m256i pair_of(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* BG_X rows of x (xr[r]: its int16 values; rows past the last repeat it) against the
 * widened group: out rows get the group's 8 sums each */
static inline __attribute__((always_inline)) void bg_tile(
        int64_t nx, int with_min, const int16_t *const xr[BG_X], const float *const dr[BG_X],
        const float *const sr[BG_X], __m256 res[BG_X]) {
    const float *sw = bg_s, *mw = bg_s + nx * 8;
    __m256 f[BG_X];
    for (int r = 0; r < BG_X; r++) f[r] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nx; blk++) {
        const __m256i *w = (const __m256i *)(bg_w + blk * 256);
        __m256i acc[BG_X];
        for (int r = 0; r < BG_X; r++) acc[r] = _mm256_setzero_si256();
        for (int j = 0; j < 16; j++) {
            const __m256i wj = _mm256_load_si256(w + j);
            for (int r = 0; r < BG_X; r++)
                acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(wj, pair_of(xr[r] + blk * 32 + 2 * j)));
        }
        const __m256 s = _mm256_loadu_ps(sw + blk * 8);
        for (int r = 0; r < BG_X; r++)
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]),
                                   _mm256_mul_ps(s, _mm256_broadcast_ss(dr[r] + blk)), f[r]);
        if (with_min) {
            const __m256 mn = _mm256_loadu_ps(mw + blk * 8);
            for (int r = 0; r < BG_X; r++)
                f[r] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(sr[r] + blk), f[r]);
        }
    }
    for (int r = 0; r < BG_X; r++) res[r] = f[r];
}

typedef struct {
    const PnMat *m; const int16_t *xq; const float *xd, *xs; int64_t B; float *out;
} BgArgs;

static void bg_chunk(const void *p, int64_t g) {        /* group g: rows 8g .. 8g+7 */
    const BgArgs *a = p;
    const PnMat *m = a->m;
    const int64_t K = m->K, nx = K / 32, N = m->N, n0 = 8 * g;
    if (K * 8 > bg_cap) {
        int16_t *nw = aligned_alloc(64, sizeof(int16_t) * (size_t)K * 8);
        float *ns = aligned_alloc(64, sizeof(float) * (size_t)(nx * 16 + 16));
        if (!nw || !ns) { free(nw); free(ns); abort(); }
        free(bg_w), free(bg_s);
        bg_w = nw, bg_s = ns, bg_cap = K * 8;
    }
    bg_widen(m, n0);
    const int with_min = m->code == Q4 || m->code == Q8M;
    const int whole = n0 + 8 <= N;
    for (int64_t b0 = 0; b0 < a->B; b0 += BG_X) {
        const int16_t *xr[BG_X];
        const float *dr[BG_X], *sr[BG_X];
        for (int r = 0; r < BG_X; r++) {
            const int64_t b = b0 + r < a->B ? b0 + r : a->B - 1;
            xr[r] = a->xq + b * K, dr[r] = a->xd + b * nx, sr[r] = a->xs + b * nx;
        }
        __m256 res[BG_X];
        if (with_min) bg_tile(nx, 1, xr, dr, sr, res);
        else bg_tile(nx, 0, xr, dr, sr, res);
        for (int r = 0; r < BG_X && b0 + r < a->B; r++) {
            float *o = a->out + (b0 + r) * N + n0;
            if (whole) _mm256_storeu_ps(o, res[r]);
            else {
                float t[8];
                _mm256_storeu_ps(t, res[r]);
                for (int i = 0; n0 + i < N; i++) o[i] = t[i];
            }
        }
    }
}

/* x [B, K] → int16 per block of 32 in the full range (32767 steps: the weights here are
 * at most 127 in size, so no pair of products comes near int32's limits; with the row
 * kernels' 16383 one near-tied position of a tiny Qwen3.5 model flipped), its step and
 * its exact block sums: pn_quantize_x's arithmetic otherwise. */
static void bg_quantize(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd, float *xs) {
    quantize_x16(x, B, K, xq, xd, xs, 32767.0f);
}

static void gemm_b_groups(const PnMat *m, const float *x, int64_t B, const PnScratch *s,
                          float *out) {
    bg_quantize(x, B, m->K, s->xq, s->xd, s->xs);
    BgArgs a = {m, s->xq, s->xd, s->xs, B, out};
    pool_run(bg_chunk, &a, (m->N + 7) / 8);
}
#endif

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
    PLAN_B_GROUPS,      /* blocks of 32, BG_MIN+ rows, 256-bit builds: W's rows across lanes */
};

/* from how many rows of x a blocks-of-32 product takes the groups (256-bit builds; 0:
 * never, for comparisons; negative: the default) */
static int64_t BG_MIN[1] = {MAXB + 1};
void pn_set_bgroups(int64_t min_rows) { BG_MIN[0] = min_rows < 0 ? MAXB + 1 : min_rows; }

int pn_plan(const PnMat *m, int64_t B) {
#if defined(PN_AMX)
    if (amx_takes(m, B)) return PLAN_AMX;
#endif
#if defined(PN_ZMM)
    if (B == 1 && DIGITS[0] && (m->code == Q4K || m->code == Q5K || m->code == Q6K ||
                                m->code == Q3K || m->code == Q2K))
        return PLAN_DIGITS;
#else
    if (B == 1 && m->act8 && (m->code == Q4K || m->code == Q5K || m->code == Q6K))
        return PLAN_X8;
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
int pn_has_x8(void) { return 0; }
int pn_int_ok(const PnMat *m, int64_t B) { return 0; }
int pn_plan(const PnMat *m, int64_t B) { (void)m; (void)B; return 0; }
int pn_matmul_int(const PnMat *m, const float *x, int64_t B, const PnScratch *s, float *out) { return 0; }
void pn_set_digits(int on) { (void)on; }
void pn_set_xspan(int64_t bytes) { (void)bytes; }
void pn_set_ktile(int64_t min_rows) { (void)min_rows; }
void pn_set_bgroups(int64_t min_rows) { (void)min_rows; }
int pn_has_lanes(void) { return 0; }
void pn_quantize_xk(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd,
                    float *xs) {}
void pn_gemv_k(int code, const uint8_t *qs, int64_t N, int64_t K, const int16_t *xq,
               const float *xd, const float *xs, int64_t B, float *out) {}
void pn_quantize_x(const float *x, int64_t B, int64_t K, int16_t *xq, float *xd, float *xs,
                   int paired) {}
int pn_pairs_x(int code, int64_t bs, int64_t B) { return 0; }
void pn_gemv_i8(int code, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                int64_t N, int64_t K, int64_t bs, const int16_t *xq, const float *xd,
                const float *xs, int64_t B, float *out) {}
#endif

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

/* -- attention of a step's single-token queries over their slots' fp32 caches ----------
 * One work item per (query, kv head): its group of query heads meets the keys of
 * positions [first, last] (contiguous rows of the cache), a softmax, and the values.
 * numpy took ~15 calls and two batched products per layer for this (65 us at 8 queries
 * of 100 positions, SmolLM2's shape); one call reads each key and value row once. */
#if defined(__AVX512F__)
/* e^x for x <= 0 (softmax after the max is taken off): 2^n * p(r), |r| <= ln2 / 2, a
 * degree-6 polynomial; relative error below 2e-7; x < -87 gives 0. */
static inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    p = _mm512_scalef_ps(p, n);
    return _mm512_maskz_mov_ps(~tiny, p);
}
#endif

/* a query as two int8 digits (query_digits) */
typedef struct { int8_t *qi, *qi2; float *dq; int32_t *qs, *qs2; } QDigits;

typedef struct {
    const float *q; int64_t q_stride, Hq, Hkv, hd; const void *K, *V; int64_t ctx;
    const int64_t *slots, *first, *last; float *out; int64_t out_stride; int kv;
} AttnArgs;

/* -- KV cache element types (common/kv_cache.py): kv = k type | v type << 2, each
 * 0 f32, 1 f16, 2 q8_0, 3 q4_0. A quantized row is head_dim / 32 blocks of llama.cpp's
 * layout: an fp16 scale d, then q8_0 32 int8 (x = d q), q4_0 16 bytes (element j in the
 * low nibble of byte j, j + 16 in its high nibble; x = d (nibble - 8)). Rows are
 * quantized once when stored and read a row at a time: no dequantized copy of a cache. */
static inline int64_t kv_row_bytes(int t, int64_t hd) {
    return t == 0 ? 4 * hd : t == 1 ? 2 * hd : t == 2 ? hd / 32 * 34 : hd / 32 * 18;
}

static float f32_of_half(uint16_t h);

/* x [hd] → one stored row of type t (the reference quantizers of llama.cpp's ggml) */
static void kv_store_row(int t, void *restrict dst, const float *restrict x, int64_t hd);

/* one stored row of type t → y [hd] floats */
static inline void kv_load_row(int t, const void *restrict src, float *restrict y, int64_t hd) {
    if (t == 0) { memcpy(y, src, sizeof(float) * hd); return; }
    if (t == 1) {
        for (int64_t i = 0; i < hd; i++) y[i] = f32_of_half(((const uint16_t *)src)[i]);
        return;
    }
    const uint8_t *b = src;
    for (int64_t blk = 0; blk < hd / 32; blk++, y += 32) {
        uint16_t dh;
        memcpy(&dh, b, 2);
        const float d = f32_of_half(dh);
        if (t == 2) {
            const int8_t *qs = (const int8_t *)(b + 2);
            for (int i = 0; i < 32; i++) y[i] = d * (float)qs[i];
            b += 34;
        } else {
            const uint8_t *qs = b + 2;
            for (int i = 0; i < 16; i++) {
                y[i] = d * (float)((qs[i] & 15) - 8);
                y[i + 16] = d * (float)((qs[i] >> 4) - 8);
            }
            b += 18;
        }
    }
}

static __thread float *attn_buf;
static __thread int64_t attn_cap;
static __thread float *attn_wide;      /* one key or value row, widened */
static __thread int64_t attn_wide_cap;

/* float -> fp16, round to nearest even (NumPy's astype), overflow to infinity */
static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return (uint16_t)(sign | 0x7C00 | (ax > 0x7F800000u ? 0x200 : 0));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);       /* rounds past 65504 */
    if (ax < 0x38800000u) {                          /* below 2^-14: a subnormal half */
        float v;
        memcpy(&v, &ax, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(v * 16777216.0f));
    }
    const uint32_t e = ax - 0x38000000u;             /* exponent rebiased by 127 - 15 */
    return (uint16_t)(sign | ((e + 0xFFF + ((e >> 13) & 1)) >> 13));
#endif
}

static float f32_of_half(uint16_t h) { return half_to_float(h); }

static void kv_store_row(int t, void *restrict dst, const float *restrict x, int64_t hd) {
    if (t == 0) { memcpy(dst, x, sizeof(float) * hd); return; }
    if (t == 1) {
        for (int64_t i = 0; i < hd; i++) ((uint16_t *)dst)[i] = f32_to_f16(x[i]);
        return;
    }
    uint8_t *b = dst;
    for (int64_t blk = 0; blk < hd / 32; blk++, x += 32) {
        if (t == 2) {                                   /* quantize_row_q8_0_ref */
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const uint16_t dh = f32_to_f16(d);
            memcpy(b, &dh, 2);
            for (int i = 0; i < 32; i++) ((int8_t *)(b + 2))[i] = (int8_t)roundf(x[i] * id);
            b += 34;
        } else {                                        /* quantize_row_q4_0_ref */
            float amax = 0.0f, max = 0.0f;
            for (int i = 0; i < 32; i++)
                if (amax < fabsf(x[i])) { amax = fabsf(x[i]); max = x[i]; }
            const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const uint16_t dh = f32_to_f16(d);
            memcpy(b, &dh, 2);
            for (int i = 0; i < 16; i++) {
                const int8_t a0 = (int8_t)(x[i] * id + 8.5f), a1 = (int8_t)(x[i + 16] * id + 8.5f);
                const uint8_t q0 = a0 < 15 ? (uint8_t)a0 : 15, q1 = a1 < 15 ? (uint8_t)a1 : 15;
                b[2 + i] = (uint8_t)(q0 | (q1 << 4));
            }
            b += 18;
        }
    }
}

static inline float dotf(const float *restrict a, const float *restrict b, int64_t n) {
    int64_t i = 0;
    float t = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    t = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    /* two chains, 16 lanes as the 512-bit build: half the rounding steps per lane */
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc2);
    }
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    t = hsum(_mm256_add_ps(acc, acc2));
#endif
    double tail = 0.0;          /* the portable build's whole sum: in double, as BLAS is close */
    for (; i < n; i++) tail += (double)a[i] * b[i];
    return t + (float)tail;
}

static int attn_generic;        /* tests: the portable loops for every head size */
void pn_set_attn_generic(int on) { attn_generic = on; }
#if defined(__AVX512F__)
/* r[i] = the sum of v[i]'s 16 lanes: a transposing tree of 45 shuffles and adds where
 * 16 separate reductions took 128 dependent steps. */
static inline __m512 reduce16(const __m512 *v) {
    __m512 t[8], u[4], x[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }   /* u[i], 128-bit lane k: v[4i .. 4i+3] summed over lane k's four floats */
    for (int i = 0; i < 2; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                         _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
}

/* One (query, kv head) item for head sizes of NC * 16 floats: scores 16 positions at a
 * time (rows past the last repeat it and are not stored), values with the group's
 * accumulators in registers, 16 / NC heads at a time, each value row read once. */
/* 16 cached values from p (floats, or fp16 widened) */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t at, const int T,
                                                            const int64_t hd) {
    if (T == 1) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at)));
    if (T == 0) return _mm512_loadu_ps((const float *)p + at);
    /* a block type: elements at .. at + 15 are half of one block of 32 (hd / 32 blocks a row) */
    const int64_t r = at / hd, c = at % hd, bb = T == 2 ? 34 : 18;
    const uint8_t *blk = (const uint8_t *)p + (r * (hd / 32) + c / 32) * bb;
    uint16_t dh;
    memcpy(&dh, blk, 2);
    const __m512 d = _mm512_set1_ps(half_to_float(dh));
    if (T == 2)
        return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(blk + 2 + (c & 31))))));
    __m128i b = _mm_loadu_si128((const __m128i *)(blk + 2));
    if (c & 16) b = _mm_srli_epi16(b, 4);
    b = _mm_and_si128(b, _mm_set1_epi8(15));
    return _mm512_mul_ps(d, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)),
                                          _mm512_set1_ps(8.0f)));
}

/* one stored row of block type T (2 q8_0, 3 q4_0; NC * 16 elements) → floats at y
 * (64-byte aligned): each block's fp16 scale converted once per 32 elements */
static inline __attribute__((always_inline)) void
deq_row16(const int T, const uint8_t *restrict b, float *restrict y, const int NC) {
    for (int blk = 0; blk < NC / 2; blk++, y += 32) {
        uint16_t dh;
        memcpy(&dh, b, 2);
        const __m512 d = _mm512_set1_ps(half_to_float(dh));
        if (T == 2) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 2));
            _mm512_store_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)))));
            _mm512_store_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))));
            b += 34;
        } else {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), m = _mm_set1_epi8(15),
                          e = _mm_set1_epi8(8);
            const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m), e),
                          hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m), e);
            _mm512_store_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo))));
            _mm512_store_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi))));
            b += 18;
        }
    }
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* dwords r[0..15] (16 rows of 16 dwords) → column c of them at out[c * 16] (16 rows) */
static inline __attribute__((always_inline)) void transpose16(__m512i *r, __m512i *out) {
    __m512i t[16], u[16], v[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int m = 0; m < 4; m++) {      /* u[4m + c], 128-bit lane k: column 4k + c, rows 4m.. */
        u[4 * m] = _mm512_unpacklo_epi64(t[4 * m], t[4 * m + 2]);
        u[4 * m + 1] = _mm512_unpackhi_epi64(t[4 * m], t[4 * m + 2]);
        u[4 * m + 2] = _mm512_unpacklo_epi64(t[4 * m + 1], t[4 * m + 3]);
        u[4 * m + 3] = _mm512_unpackhi_epi64(t[4 * m + 1], t[4 * m + 3]);
    }
    for (int c = 0; c < 4; c++) {
        v[c] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        v[4 + c] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        v[8 + c] = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        v[12 + c] = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    }
    for (int c = 0; c < 4; c++) {
        out[c] = _mm512_shuffle_i32x4(v[c], v[8 + c], 0x88);
        out[8 + c] = _mm512_shuffle_i32x4(v[c], v[8 + c], 0xDD);
        out[4 + c] = _mm512_shuffle_i32x4(v[4 + c], v[12 + c], 0x88);
        out[12 + c] = _mm512_shuffle_i32x4(v[4 + c], v[12 + c], 0xDD);
    }
}

/* Scores sc[j L + l] of block keys (KT 2 q8_0, 3 q4_0) against the group's queries as two
 * int8 digits (query_digits): integer dots with vpdpbusd, 16 positions a lane each. A
 * tile's keys are made unsigned bytes (q8_0 + 128; q4_0: its nibbles, 0..15) and
 * transposed once, so that a dword of a query digit broadcast against a vector of 16 keys'
 * dwords adds 4 products to each position's sum; each block's two sums less their offset
 * (128 or 8 times the digit's block sum) are scaled once, by the key's scale and the
 * query's (d, d / 254). Per head and 16 positions: hd / 2 vpdpbusd and hd / 16
 * conversions, where floats took hd fused multiply-adds (and the widening) and a
 * reduction. */
static inline __attribute__((always_inline)) void
attn_kscores_i8(const QDigits *restrict qr, const void *restrict Kh, int64_t L, int64_t g,
                float *restrict sc, const int NC, const int KT) {
    const float *dq = qr->dq;
    const int32_t *qs = qr->qs, *qs2 = qr->qs2;
    const int64_t hd = 16 * NC, nb = NC / 2, krb = kv_row_bytes(KT, hd);
    const int32_t off = KT == 2 ? 128 : 8;
    uint8_t rows[16 * 16 * NC] __attribute__((aligned(64)));     /* [16][hd] unsigned */
    uint16_t dk[8 * 16] __attribute__((aligned(64)));            /* [nb][16] key scales */
    __m512i kt[4 * NC];                                          /* [hd / 4] dwords x 16 */
    const int32_t *qd = (const int32_t *)qr->qi, *qd2 = (const int32_t *)qr->qi2;
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
        const int64_t n = L - l0 < 16 ? L - l0 : 16;
        for (int i = 0; i < 16; i++) {
            const uint8_t *b = (const uint8_t *)Kh + (l0 + (i < n ? i : n - 1)) * krb;
            uint8_t *y = rows + i * hd;
            for (int blk = 0; blk < nb; blk++, y += 32) {
                memcpy(dk + blk * 16 + i, b, 2);
                if (KT == 2) {
                    _mm256_store_si256((__m256i *)y, _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8(-128)));
                    b += 34;
                } else {
                    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)),
                                  m = _mm_set1_epi8(15);
                    _mm_store_si128((__m128i *)y, _mm_and_si128(q, m));
                    _mm_store_si128((__m128i *)(y + 16), _mm_and_si128(_mm_srli_epi16(q, 4), m));
                    b += 18;
                }
            }
        }
        for (int t = 0; t < NC / 4; t++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = _mm512_load_si512((const void *)(rows + i * hd + 64 * t));
            transpose16(r, kt + 16 * t);
        }
        __m512 dkv[8];
        for (int blk = 0; blk < nb; blk++)
            dkv[blk] = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(dk + blk * 16)));
        const __mmask16 keep = (__mmask16)((1u << n) - 1);
        for (int64_t j = 0; j < g; j++) {
            const int32_t *qj = qd + j * hd / 4, *qj2 = qd2 + j * hd / 4;
            __m512 s = _mm512_setzero_ps();
            for (int blk = 0; blk < nb; blk++) {
                __m512i a = _mm512_set1_epi32(-off * qs[j * nb + blk]),
                        b = _mm512_set1_epi32(-off * qs2[j * nb + blk]);
                for (int k = 0; k < 8; k++) {
                    a = _mm512_dpbusd_epi32(a, kt[blk * 8 + k], _mm512_set1_epi32(qj[blk * 8 + k]));
                    b = _mm512_dpbusd_epi32(b, kt[blk * 8 + k], _mm512_set1_epi32(qj2[blk * 8 + k]));
                }
                const __m512 d = _mm512_mul_ps(dkv[blk], _mm512_set1_ps(dq[j * nb + blk]));
                s = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(b),
                                                    _mm512_set1_ps(1.0f / 254.0f),
                                                    _mm512_cvtepi32_ps(a)), d, s);
            }
            _mm512_mask_storeu_ps(sc + j * L + l0, keep, s);
        }
    }
}
#endif

/* vectors c0 .. c0 + 3 (floats 16 c0 .. 16 c0 + 63) of value row l, as floats: fp16 widened,
 * blocks (two of 32) dequantized with each one's scale converted once */
static inline __attribute__((always_inline)) void
load_v4(const void *restrict Vh, int64_t l, int c0, __m512 *vr, const int VT, const int NC) {
    const int64_t hd = 16 * NC;
    if (VT == 0) {
        for (int c = 0; c < 4; c++) vr[c] = _mm512_loadu_ps((const float *)Vh + l * hd + 16 * (c0 + c));
        return;
    }
    if (VT == 1) {
        for (int c = 0; c < 4; c++)
            vr[c] = _mm512_cvtph_ps(_mm256_loadu_si256(
                (const __m256i *)((const uint16_t *)Vh + l * hd + 16 * (c0 + c))));
        return;
    }
    const uint8_t *b = (const uint8_t *)Vh + l * kv_row_bytes(VT, hd) + c0 / 2 * (VT == 2 ? 34 : 18);
    for (int k = 0; k < 2; k++) {
        uint16_t dh;
        memcpy(&dh, b, 2);
        const __m512 d = _mm512_set1_ps(half_to_float(dh));
        if (VT == 2) {
            vr[2 * k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(b + 2)))));
            vr[2 * k + 1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(b + 18)))));
            b += 34;
        } else {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), m = _mm_set1_epi8(15),
                          e = _mm_set1_epi8(8);
            vr[2 * k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_sub_epi8(_mm_and_si128(q, m), e))));
            vr[2 * k + 1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m), e))));
            b += 18;
        }
    }
}

static inline __attribute__((always_inline)) void
attn_fast(const float *restrict qb, const void *restrict Kh, const void *restrict Vh,
          int64_t L, int64_t g, float *restrict sc, float *restrict ob, const int NC,
          const int KT, const int VT, const int scored) {
    const int64_t hd = 16 * NC;
    for (int64_t l0 = 0; l0 < (scored ? 0 : L); l0 += 16) {
        const int64_t n = L - l0 < 16 ? L - l0 : 16;
        int64_t rows[16];
        for (int i = 0; i < 16; i++) rows[i] = (l0 + (i < n ? i : n - 1)) * hd;
        /* block keys: the tile's 16 rows widened once into scratch (16 rows x hd floats,
         * in L1), then read by each head of the group as float rows */
        float tile[KT >= 2 ? 16 * 16 * NC : 1] __attribute__((aligned(64)));
        const void *Kt = Kh;
        int T = KT;
        if (KT >= 2) {
            for (int i = 0; i < 16; i++) {
                deq_row16(KT, (const uint8_t *)Kh + rows[i] / hd * kv_row_bytes(KT, hd),
                          tile + i * hd, NC);
                rows[i] = i * hd;
            }
            Kt = tile, T = 0;
        }
        for (int64_t j = 0; j < g; j++) {
            const float *qj = qb + j * hd;
            __m512 p[16];
            for (int i = 0; i < 16; i++) {
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qj), load16(Kt, rows[i], T, hd));
                for (int c = 1; c < NC; c++)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * c),
                                          load16(Kt, rows[i] + 16 * c, T, hd), acc);
                p[i] = acc;
            }
            _mm512_mask_storeu_ps(sc + j * L + l0, (__mmask16)((1u << n) - 1), reduce16(p));
        }
    }
    for (int64_t j = 0; j < g; j++) {                    /* softmax of each head's row */
        float *s = sc + j * L;
        __m512 vm = _mm512_set1_ps(-INFINITY);
        int64_t l = 0;
        for (; l + 16 <= L; l += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + l));
        float m = _mm512_reduce_max_ps(vm);
        for (; l < L; l++) m = s[l] > m ? s[l] : m;
        vm = _mm512_set1_ps(m);
        __m512 vs = _mm512_setzero_ps();
        for (l = 0; l < L; l += 16) {
            const __mmask16 k = (__mmask16)(L - l >= 16 ? 0xFFFF : (1u << (L - l)) - 1);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + l), vm));
            e = _mm512_maskz_mov_ps(k, e);
            _mm512_mask_storeu_ps(s + l, k, e);
            vs = _mm512_add_ps(vs, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vs));
        for (l = 0; l < L; l += 16) {
            const __mmask16 k = (__mmask16)(L - l >= 16 ? 0xFFFF : (1u << (L - l)) - 1);
            _mm512_mask_storeu_ps(s + l, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + l), inv));
        }
    }
    /* values: a column pass of 64 floats (4 vectors) for up to 6 heads at a time (24
     * accumulators in registers), so that each value row's vectors are read, widened or
     * dequantized (a block's scale converted once) once per pass and used by every head */
    for (int c0 = 0; c0 < NC; c0 += 4) {
        for (int64_t j0 = 0; j0 < g; j0 += 6) {
            const int jn = g - j0 < 6 ? (int)(g - j0) : 6;
            __m512 acc[24];
            for (int i = 0; i < 24; i++) acc[i] = _mm512_setzero_ps();
            const float *w0 = sc + j0 * L;
            for (int64_t l = 0; l < L; l++) {
                __m512 vr[4];
                load_v4(Vh, l, c0, vr, VT, NC);
                for (int jj = 0; jj < 6; jj++) {
                    if (jj >= jn) break;
                    const __m512 w = _mm512_set1_ps(w0[jj * L + l]);
                    for (int c = 0; c < 4; c++)
                        acc[jj * 4 + c] = _mm512_fmadd_ps(w, vr[c], acc[jj * 4 + c]);
                }
            }
            for (int jj = 0; jj < jn; jj++)
                for (int c = 0; c < 4; c++)
                    _mm512_storeu_ps(ob + (j0 + jj) * hd + 16 * (c0 + c), acc[jj * 4 + c]);
        }
    }
}
#endif

/* A query of g heads as two int8 digits per element for the integer key dots: for each
 * block of 32, d = max |x| / 127, x / d = q1 + q2 / 254 with q1 = round(x / d) and q2 =
 * round(254 (x / d - q1)), both in [-127, 127]; x is then within d / 508 of d (q1 + q2 /
 * 254), finer than an fp16 query (one digit, llama.cpp's q8_0 query, moved a tiny
 * model's logits 3e-4 nats from the float path's). qi [g][hd] and qi2 the digits, dq [g][hd / 32]
 * the scales, qs and qs2 the blocks' sums of each digit. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
/* e^x for x <= 0 (the softmax's), 8 lanes: exp512's reduction and polynomial, 2^n built
 * in the exponent bits; x < -87 gives 0 */
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* one stored row of type T (0 f32, 1 f16, 2 q8_0, 3 q4_0; hd floats) → floats at y:
 * fp16 widened, each block's scale converted once per 32 elements */
static inline __attribute__((always_inline)) void
widen_row8(const int T, const void *restrict src, float *restrict y, const int64_t hd) {
    if (T == 0) { memcpy(y, src, sizeof(float) * hd); return; }
    if (T == 1) {
        for (int64_t c = 0; c < hd; c += 8)
            _mm256_store_ps(y + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + c))));
        return;
    }
    const uint8_t *b = src;
    for (int64_t blk = 0; blk < hd / 32; blk++, y += 32) {
        uint16_t dh;
        memcpy(&dh, b, 2);
        const __m256 d = _mm256_set1_ps(half_to_float(dh));
        __m128i q0, q1;                  /* elements 0..15, 16..31 as int8 */
        if (T == 2) {                    /* widened straight from memory, 8 at a time */
            for (int c = 0; c < 4; c++)
                _mm256_store_ps(y + 8 * c, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * c))))));
            b += 34;
            continue;
        } else {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), m = _mm_set1_epi8(15),
                          e = _mm_set1_epi8(8);
            q0 = _mm_sub_epi8(_mm_and_si128(q, m), e);
            q1 = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m), e);
            b += 18;
        }
        _mm256_store_ps(y, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0))));
        _mm256_store_ps(y + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8)))));
        _mm256_store_ps(y + 16, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1))));
        _mm256_store_ps(y + 24, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8)))));
    }
}

/* The 256-bit builds' attention item (head sizes of NC8 * 8 floats, NC8 a multiple of 4):
 * tiles of 16 positions whose keys, then values, are widened or dequantized once into
 * scratch (in L1) and read there by every head of the group. Scores: 8 positions a time
 * in 8 accumulators, reduced by a tree of horizontal adds; values: 6 heads x 16 floats a
 * pass (12 accumulators: 16 registers hold them, two value vectors and a weight), kept in
 * `ob` between tiles. */
static inline __attribute__((always_inline)) void
attn_fast8(const float *restrict qb, const void *restrict Kh, const void *restrict Vh,
           int64_t L, int64_t g, float *restrict sc, float *restrict ob, const int NC8,
           const int KT, const int VT) {
    const int64_t hd = 8 * NC8, krb = kv_row_bytes(KT, hd), vrb = kv_row_bytes(VT, hd);
    float tile[16 * 8 * NC8] __attribute__((aligned(32)));
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
        const int64_t n = L - l0 < 16 ? L - l0 : 16;
        const float *rows[16];
        for (int i = 0; i < 16; i++) {
            const int64_t l = l0 + (i < n ? i : n - 1);
            if (KT == 0) rows[i] = (const float *)((const char *)Kh + l * krb);
            else if (i < n) widen_row8(KT, (const char *)Kh + l * krb, tile + i * hd, hd), rows[i] = tile + i * hd;
            else rows[i] = rows[n - 1];
        }
        for (int64_t j = 0; j < g; j++) {
            const float *qj = qb + j * hd;
            for (int h = 0; h < 16 && h < n; h += 8) {
                __m256 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
                for (int c = 0; c < NC8; c++) {
                    const __m256 qv = _mm256_loadu_ps(qj + 8 * c);
                    for (int i = 0; i < 8; i++)
                        a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[h + i] + 8 * c), a[i]);
                }
                const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]),
                             t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
                const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
                const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                               _mm256_permute2f128_ps(u0, u1, 0x31));
                if (n - h >= 8) {
                    _mm256_storeu_ps(sc + j * L + l0 + h, r);
                } else {
                    float out8[8];
                    _mm256_storeu_ps(out8, r);
                    for (int i = 0; i < n - h; i++) sc[j * L + l0 + h + i] = out8[i];
                }
            }
        }
    }
    for (int64_t j = 0; j < g; j++) {                    /* softmax of each head's row */
        float *s = sc + j * L, m = s[0];
        int64_t l = 0;
        __m256 vm = _mm256_set1_ps(-INFINITY);
        for (; l + 8 <= L; l += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + l));
        float mm[8];
        _mm256_storeu_ps(mm, vm);
        for (int i = 0; i < 8; i++) m = mm[i] > m ? mm[i] : m;
        for (; l < L; l++) m = s[l] > m ? s[l] : m;
        vm = _mm256_set1_ps(m);
        __m256 vs = _mm256_setzero_ps();
        for (l = 0; l + 8 <= L; l += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + l), vm));
            _mm256_storeu_ps(s + l, e);
            vs = _mm256_add_ps(vs, e);
        }
        float sum = hsum(vs);
        for (; l < L; l++) { s[l] = expf(s[l] - m); sum += s[l]; }
        const __m256 inv = _mm256_set1_ps(1.0f / sum);
        for (l = 0; l + 8 <= L; l += 8) _mm256_storeu_ps(s + l, _mm256_mul_ps(_mm256_loadu_ps(s + l), inv));
        for (; l < L; l++) s[l] *= 1.0f / sum;
    }
    for (int64_t i = 0; i < g * hd; i += 8) _mm256_storeu_ps(ob + i, _mm256_setzero_ps());
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
        const int64_t n = L - l0 < 16 ? L - l0 : 16;
        const float *rows[16];
        for (int i = 0; i < n; i++) {
            if (VT == 0) rows[i] = (const float *)((const char *)Vh + (l0 + i) * vrb);
            else widen_row8(VT, (const char *)Vh + (l0 + i) * vrb, tile + i * hd, hd), rows[i] = tile + i * hd;
        }
        for (int c0 = 0; c0 < NC8; c0 += 2) {         /* 6 heads x 16 floats a pass */
            for (int64_t j0 = 0; j0 < g; j0 += 6) {
                const int jn = g - j0 < 6 ? (int)(g - j0) : 6;
                __m256 acc[12];
                for (int jj = 0; jj < 6; jj++) {
                    if (jj >= jn) break;
                    for (int c = 0; c < 2; c++)
                        acc[jj * 2 + c] = _mm256_loadu_ps(ob + (j0 + jj) * hd + 8 * (c0 + c));
                }
                const float *w0 = sc + j0 * L + l0;
                for (int64_t i = 0; i < n; i++) {
                    const __m256 v0 = _mm256_loadu_ps(rows[i] + 8 * c0),
                                 v1 = _mm256_loadu_ps(rows[i] + 8 * c0 + 8);
                    for (int jj = 0; jj < 6; jj++) {
                        if (jj >= jn) break;
                        const __m256 w = _mm256_set1_ps(w0[jj * L + i]);
                        acc[jj * 2] = _mm256_fmadd_ps(w, v0, acc[jj * 2]);
                        acc[jj * 2 + 1] = _mm256_fmadd_ps(w, v1, acc[jj * 2 + 1]);
                    }
                }
                for (int jj = 0; jj < jn; jj++)
                    for (int c = 0; c < 2; c++)
                        _mm256_storeu_ps(ob + (j0 + jj) * hd + 8 * (c0 + c), acc[jj * 2 + c]);
            }
        }
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static __thread void *qdigit_buf;
static __thread int64_t qdigit_cap;

static int query_digits(const float *q, int64_t g, int64_t hd, QDigits *r) {
    const int64_t n = g * hd, nb = n / 32;
    const int64_t need = 2 * n + nb * 12 + 64;
    if (need > qdigit_cap) {
        void *nbuf = NULL;
        if (posix_memalign(&nbuf, 64, (size_t)need)) return 0;
        free(qdigit_buf);
        qdigit_buf = nbuf;
        qdigit_cap = need;
    }
    r->qi = qdigit_buf;
    r->qi2 = r->qi + n;
    r->dq = (float *)(r->qi2 + n);
    r->qs = (int32_t *)(r->dq + nb);
    r->qs2 = r->qs + nb;
    for (int64_t b = 0; b < nb; b++) {
        const float *x = q + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t s1 = 0, s2 = 0;
        for (int i = 0; i < 32; i++) {
            const float y = x[i] * id, q1 = fminf(fmaxf(rintf(y), -127.0f), 127.0f);
            const float q2 = fminf(fmaxf(rintf((y - q1) * 254.0f), -127.0f), 127.0f);
            r->qi[32 * b + i] = (int8_t)q1;
            r->qi2[32 * b + i] = (int8_t)q2;
            s1 += (int32_t)q1;
            s2 += (int32_t)q2;
        }
        r->dq[b] = d;
        r->qs[b] = s1;
        r->qs2[b] = s2;
    }
    return 1;
}
#endif

static void attn_item(const void *p, int64_t it) {
    const AttnArgs *a = p;
    const int64_t b = it / a->Hkv, h = it % a->Hkv, g = a->Hq / a->Hkv, hd = a->hd;
    const int64_t lo = a->first[b], L = a->last[b] + 1 - lo;
    const int64_t base = (a->slots[b] * a->Hkv + h) * a->ctx + lo;
    const int kt = a->kv & 3, vt = a->kv >> 2;
    const int64_t krb = kv_row_bytes(kt, hd), vrb = kv_row_bytes(vt, hd);
    const char *Kh = (const char *)a->K + base * krb, *Vh = (const char *)a->V + base * vrb;
    const float *qb = a->q + b * a->q_stride + h * g * hd;
    float *ob = a->out + b * a->out_stride + h * g * hd;
    if (L * g > attn_cap) {
        float *nb = realloc(attn_buf, sizeof(float) * L * g);
        if (!nb) return;            /* cannot happen for a context that was allocated */
        attn_buf = nb;
        attn_cap = L * g;
    }
    float *sc = attn_buf;           /* [g][L] */
#if defined(__AVX512F__)
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    QDigits qr = {0};
    if (kt >= 2 && !attn_generic && (hd == 64 || hd == 128 || hd == 256)
        && !query_digits(qb, g, hd, &qr)) return;
#define KSCORES(KT, NC) (KT >= 2 ? (attn_kscores_i8(&qr, Kh, L, g, sc, NC, KT), 1) : 0)
#else
#define KSCORES(KT, NC) 0
#endif
#define ATTN_FAST(KT, VT) switch (attn_generic ? 0 : hd) { \
    case 64: attn_fast(qb, Kh, Vh, L, g, sc, ob, 4, KT, VT, KSCORES(KT, 4)); return; \
    case 128: attn_fast(qb, Kh, Vh, L, g, sc, ob, 8, KT, VT, KSCORES(KT, 8)); return; \
    case 256: attn_fast(qb, Kh, Vh, L, g, sc, ob, 16, KT, VT, KSCORES(KT, 16)); return; \
    default: break; }
    /* the cache types taken here (others: the row loops below) */
    switch (a->kv) {
    case 0: ATTN_FAST(0, 0) break;
    case 1 | 1 << 2: ATTN_FAST(1, 1) break;
    case 2 | 2 << 2: ATTN_FAST(2, 2) break;
    case 3 | 3 << 2: ATTN_FAST(3, 3) break;
    case 2 | 3 << 2: ATTN_FAST(2, 3) break;
    case 1 | 3 << 2: ATTN_FAST(1, 3) break;
    case 2 | 1 << 2: ATTN_FAST(2, 1) break;
    case 1 | 2 << 2: ATTN_FAST(1, 2) break;
    default: break;
    }
#undef ATTN_FAST
#undef KSCORES
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (!attn_generic && (hd == 64 || hd == 128 || hd == 256)) {
#define ATTN_FAST8(KT, VT) switch (hd) { \
    case 64: attn_fast8(qb, Kh, Vh, L, g, sc, ob, 8, KT, VT); return; \
    case 128: attn_fast8(qb, Kh, Vh, L, g, sc, ob, 16, KT, VT); return; \
    default: attn_fast8(qb, Kh, Vh, L, g, sc, ob, 32, KT, VT); return; }
        switch (a->kv) {
        case 0: ATTN_FAST8(0, 0) break;
        case 1 | 1 << 2: ATTN_FAST8(1, 1) break;
        case 2 | 2 << 2: ATTN_FAST8(2, 2) break;
        case 3 | 3 << 2: ATTN_FAST8(3, 3) break;
        case 2 | 3 << 2: ATTN_FAST8(2, 3) break;
        case 1 | 3 << 2: ATTN_FAST8(1, 3) break;
        case 2 | 1 << 2: ATTN_FAST8(2, 1) break;
        case 1 | 2 << 2: ATTN_FAST8(1, 2) break;
        default: break;
        }
#undef ATTN_FAST8
    }
#endif
    /* the portable loops read float rows: one key or value row at a time is widened
     * (fp16) or dequantized (q8_0, q4_0) into a row of scratch; f32 rows are read as
     * they are */
    if (hd > attn_wide_cap) {
        float *nb = realloc(attn_wide, sizeof(float) * hd);
        if (!nb) return;
        attn_wide = nb;
        attn_wide_cap = hd;
    }
    for (int64_t l = 0; l < L; l++) {
        const float *kr = (const float *)(Kh + l * krb);
        if (kt) kv_load_row(kt, Kh + l * krb, attn_wide, hd), kr = attn_wide;
        for (int64_t j = 0; j < g; j++) sc[j * L + l] = dotf(qb + j * hd, kr, hd);
    }
    for (int64_t j = 0; j < g; j++) {
        float *s = sc + j * L, m = s[0], sum = 0.0f;
        for (int64_t l = 1; l < L; l++) m = s[l] > m ? s[l] : m;
        int64_t l = 0;
#if defined(__AVX512F__)
        __m512 vs = _mm512_setzero_ps(), vm = _mm512_set1_ps(m);
        for (; l + 16 <= L; l += 16) {
            __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + l), vm));
            _mm512_storeu_ps(s + l, e);
            vs = _mm512_add_ps(vs, e);
        }
        sum = _mm512_reduce_add_ps(vs);
#endif
        for (; l < L; l++) { s[l] = expf(s[l] - m); sum += s[l]; }
        const float inv = 1.0f / sum;
        for (l = 0; l < L; l++) s[l] *= inv;
    }
    for (int64_t j = 0; j < g; j++) memset(ob + j * hd, 0, sizeof(float) * hd);
    for (int64_t l = 0; l < L; l++) {
        const float *vr = (const float *)(Vh + l * vrb);
        if (vt) kv_load_row(vt, Vh + l * vrb, attn_wide, hd), vr = attn_wide;
        for (int64_t j = 0; j < g; j++) {
            const float w = sc[j * L + l];
            float *o = ob + j * hd;
            int64_t d = 0;
#if defined(__AVX512F__)
            const __m512 vw = _mm512_set1_ps(w);
            for (; d + 16 <= hd; d += 16)
                _mm512_storeu_ps(o + d, _mm512_fmadd_ps(vw, _mm512_loadu_ps(vr + d), _mm512_loadu_ps(o + d)));
#endif
            for (; d < hd; d++) o[d] += w * vr[d];
        }
    }
}

/* The step's new keys and values (rows of Hkv * hd, strides apart) are stored at
 * (slots[b], last[b]) of K, V [slots, Hkv, ctx, hd]; then out (rows out_stride apart)
 * = attention of q [B, Hq, hd] (scaled; rows q_stride apart) over K, V: query b reads
 * slot slots[b], positions first[b] .. last[b]. */
void pn_attend_decodes(const float *q, int64_t q_stride, int64_t B, int64_t Hq, int64_t Hkv,
                       int64_t hd, void *K, void *V, int64_t ctx, const int64_t *slots,
                       const int64_t *first, const int64_t *last, const float *knew,
                       int64_t k_stride, const float *vnew, int64_t v_stride, float *out,
                       int64_t out_stride, int kv) {
    const int kt = kv & 3, vt = kv >> 2;
    const int64_t krb = kv_row_bytes(kt, hd), vrb = kv_row_bytes(vt, hd);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t at = (slots[b] * Hkv + h) * ctx + last[b];
            kv_store_row(kt, (char *)K + at * krb, knew + b * k_stride + h * hd, hd);
            kv_store_row(vt, (char *)V + at * vrb, vnew + b * v_stride + h * hd, hd);
        }
    AttnArgs a = {q, q_stride, Hq, Hkv, hd, K, V, ctx, slots, first, last, out, out_stride, kv};
    pool_run(attn_item, &a, B * Hkv);
}

/* -- element-wise layers of a step, one call each where NumPy took six to eight ------- */

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for rows of d (x rows `stride` apart):
 * the sum of squares in double, the rest in float in NumPy's order. */
void pn_rms_norm(const float *x, int64_t rows, int64_t d, int64_t stride, const float *w,
                 float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        float *o = out + r * d;
        double ss = 0.0;
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
        for (; i + 16 <= d; i += 16) {
            __m512 v = _mm512_loadu_ps(xr + i);
            __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
            __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
            a0 = _mm512_fmadd_pd(lo, lo, a0);
            a1 = _mm512_fmadd_pd(hi, hi, a1);
        }
        ss = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#endif
        for (; i < d; i++) ss += (double)xr[i] * xr[i];
        const float r_ = 1.0f / sqrtf((float)(ss / (double)d) + eps);
        for (i = 0; i < d; i++) o[i] = xr[i] * r_ * w[i];
    }
}

/* Rotate-half rotary embedding of x [T, H, hd] (rows of H * hd, `stride` apart), the
 * first 2 * half dims of each head, times `scale`: out [T, H, hd] contiguous;
 * cos, sin [T, half]. */
void pn_rope(const float *x, int64_t T, int64_t H, int64_t hd, int64_t stride,
             const float *cos_, const float *sin_, int64_t half, float scale, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * half, *s = sin_ + t * half;
        for (int64_t h = 0; h < H; h++) {
            const float *xh = x + t * stride + h * hd;
            float *o = out + (t * H + h) * hd;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = xh[i], x2 = xh[half + i];
                o[i] = (x1 * c[i] - x2 * s[i]) * scale;
                o[half + i] = (x2 * c[i] + x1 * s[i]) * scale;
            }
            for (int64_t i = 2 * half; i < hd; i++) o[i] = xh[i] * scale;
        }
    }
}

/* The same over [T, H, d] whose T rows of H * d are `stride` apart (each head's q or
 * k of a fused qkv product): out [T, H, d] contiguous. */
void pn_rms_norm_heads(const float *x, int64_t T, int64_t H, int64_t d, int64_t stride,
                       const float *w, float eps, float *out) {
    for (int64_t t = 0; t < T; t++) pn_rms_norm(x + t * stride, H, d, d, w, eps, out + t * H * d);
}

/* out[b, i] = silu(g[b, i]) * g[b, F + i] for g [B, 2F] (gate | up, fused): silu(x) =
 * x * sigmoid(x), sigmoid through e^-|x| (never overflows). */
void pn_silu_mul(const float *g, int64_t B, int64_t F, float *out) {
    for (int64_t b = 0; b < B; b++) {
        const float *gate = g + b * 2 * F, *up = gate + F;
        float *o = out + b * F;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= F; i += 16) {
            const __m512 x = _mm512_loadu_ps(gate + i);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
            const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
            const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 sig = _mm512_mask_mul_ps(r, neg, r, e);        /* x < 0: e / (1 + e) */
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_loadu_ps(up + i)));
        }
#endif
        for (; i < F; i++) {
            const float x = gate[i], e = expf(-fabsf(x)), r = 1.0f / (1.0f + e);
            o[i] = x * (x < 0.0f ? r * e : r) * up[i];
        }
    }
}

int pn_max_rows(void) { return MAXB; }

/* dst[0 .. n) = src[0 .. n) in 2 MiB pieces over the pool: a load's copies of weights out
 * of the file's pages, where the faults on both sides (not the bytes) cost the time */
typedef struct { char *dst; const char *src; int64_t n, piece; } CopyArgs;

static void copy_piece(const void *p, int64_t c) {
    const CopyArgs *a = p;
    const int64_t at = c * a->piece, len = a->n - at < a->piece ? a->n - at : a->piece;
    if (a->src) memcpy(a->dst + at, a->src + at, (size_t)len);
    else memset(a->dst + at, 0, (size_t)len);
}

/* (src NULL: zeros, as the KV caches are committed at load) */
void pn_copy(void *dst, const void *src, int64_t n) {
    CopyArgs a = {dst, src, n, 2 << 20};
    pool_run(copy_piece, &a, (n + a.piece - 1) / a.piece);
}

/* -- a decode step's layer in one call, built from the block's spec --------------------
 * (worker/layers/decode_cpu.py) Everything between two layers of a step whose spans are
 * all single tokens, in the order and with the kernels the Python layer calls one by one:
 * norm, the mixer, [post-norm], residual, norm, gate|up product, act(gate) * up, down
 * product, [post-norm], residual. The mixer is softmax attention (qkv product + bias,
 * q/k norms, rotary on the first 2 * half dims, the cache write and attention within the
 * query's window, [output * sigmoid(gate)], output product) or a Gated DeltaNet decode
 * update (in product, conv step, gated delta rule, gated norm, out product). A projection
 * is up to 3 matrices whose outputs are concatenated. The llama-shaped layer keeps the
 * Python layer's bits; the other features agree to float32 rounding (tanh, exp). */
typedef struct {
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

typedef struct {                  /* one step: its queries and scratch rows */
    int64_t B; const int64_t *slots, *last;
    float *h, *qkv, *part, *qn, *kn, *qr, *kr, *attn, *y, *gu, *act;
    PnScratch s;
    float *ba, *conv;                                      /* DeltaNet: [B, 2 nv], [B, C] */
} PnStep;

static int proj(const PnMat *const *parts, const float *x, int64_t B, const PnScratch *s,
                float *part, float *out) {
    if (!parts[1]) return pn_matmul_int(parts[0], x, B, s, out);
    int64_t N = 0, at = 0;
    for (int i = 0; i < 3 && parts[i]; i++) N += parts[i]->N;
    for (int i = 0; i < 3 && parts[i]; i++) {
        const int64_t n = parts[i]->N;
        if (!pn_matmul_int(parts[i], x, B, s, part)) return 0;
        for (int64_t b = 0; b < B; b++) memcpy(out + b * N + at, part + b * n, sizeof(float) * n);
        at += n;
    }
    return 1;
}

static void add_rows(float *restrict x, const float *restrict y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* sigmoid and SiLU as ops.py writes them (through tanh: no overflow) */
static inline float sigmoidf_(float x) { return 0.5f + 0.5f * tanhf(0.5f * x); }

/* over n floats: mode 0 o *= sigmoid(g) (an output gate), 1 o *= silu(g) (a gated norm),
 * 2 o = silu(g) (o may be g). AVX-512: sigmoid through e^-|g| (exp512, never overflows),
 * 16 at a time, where scalar tanhf took 14-16 ns a float (Gemma 3 270M's GELUs: 4-5 ms
 * of a 67 ms batch-8 step); the rest as ops.py writes it. */
static void mul_sigmoid(float *o, const float *g, int64_t n, int mode) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 e = exp512(_mm512_sub_ps(zero, _mm512_abs_ps(x)));
        const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
        const __mmask16 neg = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
        __m512 f = _mm512_mask_mul_ps(r, neg, r, e);                 /* sigmoid(x) */
        if (mode) f = _mm512_mul_ps(x, f);
        _mm512_storeu_ps(o + i, mode == 2 ? f : _mm512_mul_ps(_mm512_loadu_ps(o + i), f));
    }
#endif
    for (; i < n; i++) {
        const float x = g[i], f = mode ? x * sigmoidf_(x) : sigmoidf_(x);
        o[i] = mode == 2 ? f : o[i] * f;
    }
}

/* out[b, i] = gelu_tanh(g[b, i]) * g[b, F + i] (gate | up, fused): ops.py's
 * 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3); AVX-512 as x sigmoid(2u), equal in
 * exact arithmetic (and without 1 + tanh's cancellation for x << 0) */
void pn_gelu_mul(const float *g, int64_t B, int64_t F, float *out) {
    const float c = 0.7978845608028654f;
    for (int64_t b = 0; b < B; b++) {
        const float *gate = g + b * 2 * F, *up = gate + F;
        float *o = out + b * F;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
        const __m512 c2 = _mm512_set1_ps(2.0f * c), k = _mm512_set1_ps(0.044715f);
        for (; i + 16 <= F; i += 16) {
            const __m512 x = _mm512_loadu_ps(gate + i);
            const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
            const __m512 u2 = _mm512_mul_ps(c2, _mm512_fmadd_ps(k, x3, x));
            const __m512 e = exp512(_mm512_sub_ps(zero, _mm512_abs_ps(u2)));
            const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
            const __mmask16 neg = _mm512_cmp_ps_mask(u2, zero, _CMP_LT_OQ);
            const __m512 sig = _mm512_mask_mul_ps(r, neg, r, e);
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_loadu_ps(up + i)));
        }
#endif
        for (; i < F; i++) {
            const float x = gate[i];
            o[i] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * (x * x * x)))) * up[i];
        }
    }
}

/* y [B, D] (the mixer's or MLP's output) through the post-norm if any, into x */
static void residual(const PnLayer *L, const PnStep *S, const float *post, float *x) {
    const int64_t n = S->B * L->D;
    if (post) {
        pn_rms_norm(S->y, S->B, L->D, L->D, post, L->eps, S->h);
        add_rows(x, S->h, n);
    } else add_rows(x, S->y, n);
}

static int attention_mixer(const PnLayer *L, const PnStep *S, const int64_t *first,
                           const float *cos_, const float *sin_) {
    const int64_t B = S->B, hd = L->hd, qd = L->Hq * hd, kvd = L->Hkv * hd;
    const int64_t qw = L->gated ? 2 * qd : qd, N = qw + 2 * kvd;
    if (!proj(L->qkv, S->h, B, &S->s, S->part, S->qkv)) return 0;
    if (L->bqkv)
        for (int64_t b = 0; b < B; b++) add_rows(S->qkv + b * N, L->bqkv, N);
    const float *q = S->qkv, *k = S->qkv + qw;
    int64_t q_stride = N, k_stride = N;
    if (L->q_norm) {
        if (L->gated)           /* each head's query: hd floats of every 2 hd */
            for (int64_t b = 0; b < B; b++)
                pn_rms_norm(q + b * N, L->Hq, hd, 2 * hd, L->q_norm, L->eps, S->qn + b * qd);
        else pn_rms_norm_heads(q, B, L->Hq, hd, N, L->q_norm, L->eps, S->qn);
        pn_rms_norm_heads(k, B, L->Hkv, hd, N, L->k_norm, L->eps, S->kn);
        q = S->qn, k = S->kn, q_stride = qd, k_stride = kvd;
    }
    pn_rope(q, B, L->Hq, hd, q_stride, cos_, sin_, L->half, L->scale, S->qr);
    pn_rope(k, B, L->Hkv, hd, k_stride, cos_, sin_, L->half, 1.0f, S->kr);
    pn_attend_decodes(S->qr, qd, B, L->Hq, L->Hkv, hd, L->K, L->V, L->ctx, S->slots, first,
                      S->last, S->kr, kvd, S->qkv + qw + kvd, N, S->attn, qd, (int)L->kv16);
    if (L->gated)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < L->Hq; h++)
                mul_sigmoid(S->attn + b * qd + h * hd, S->qkv + b * N + h * 2 * hd + hd, hd, 0);
    return proj(L->o, S->attn, B, &S->s, S->part, S->y);
}

/* -- Gated DeltaNet's decode update (worker/layers/gated_deltanet.py) */
typedef struct { const PnLayer *L; const PnStep *S; } DeltaArgs;

/* one (query b, value head h): S_h = e^g S_h; u = beta (v - S_hᵀ k); S_h += k ⊗ u;
 * o = S_hᵀ q; then o = rms_norm(o, ssm_norm) * silu(z), written over the conv row's
 * place in S->attn [B, nv dv] */
static void delta_item(const void *p, int64_t it) {
    const DeltaArgs *d = p;
    const PnLayer *L = d->L;
    const PnStep *S = d->S;
    const int64_t nv = L->nv, dk = L->dk, dv = L->dv, b = it / nv, h = it % nv;
    const int64_t C = 2 * L->nk * dk + nv * dv, kh = L->tiled ? h % L->nk : h / (nv / L->nk);
    const float *c = S->conv + b * C, *q = c + kh * dk, *k = c + L->nk * dk + kh * dk;
    const float *v = c + 2 * L->nk * dk + h * dv;
    const float *z = S->qkv + b * (C + nv * dv) + C + h * dv;
    const float *ba = S->ba + b * 2 * nv;
    const float beta = sigmoidf_(ba[h]);
    const float xa = ba[nv + h] + L->dt[h];
    const float g = L->a[h] * (fmaxf(xa, 0.0f) + log1pf(expf(-fabsf(xa)))), e = expf(g);
    float *St = L->ssm_state + (S->slots[b] * nv + h) * dk * dv;
    float kv[dv], o[dv];
    for (int64_t j = 0; j < dv; j++) kv[j] = 0.0f, o[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *row = St + i * dv;
        const float ki = k[i];
        for (int64_t j = 0; j < dv; j++) { row[j] *= e; kv[j] += ki * row[j]; }
    }
    for (int64_t j = 0; j < dv; j++) kv[j] = (v[j] - kv[j]) * beta;     /* u */
    for (int64_t i = 0; i < dk; i++) {
        float *row = St + i * dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < dv; j++) { row[j] += ki * kv[j]; o[j] += qi * row[j]; }
    }
    float *out = S->attn + b * nv * dv + h * dv;
    pn_rms_norm(o, 1, dv, dv, L->ssm_norm, L->eps, out);
    mul_sigmoid(out, z, dv, 1);
}

static int deltanet_mixer(const PnLayer *L, const PnStep *S) {
    const int64_t B = S->B, nk = L->nk, nv = L->nv, dk = L->dk, dv = L->dv, K = L->kconv;
    const int64_t C = 2 * nk * dk + nv * dv, N = C + nv * dv;
    if (!proj(L->qkv, S->h, B, &S->s, S->part, S->qkv)) return 0;     /* mixed | z */
    if (L->ba_dense)            /* a small matrix a file keeps in floats */
        for (int64_t b = 0; b < B; b++) {
            float *o = S->ba + b * 2 * nv;
            const float *h = S->h + b * L->D;
            for (int64_t n = 0; n < 2 * nv; n++) o[n] = 0.0f;
            for (int64_t k = 0; k < L->D; k++)
                for (int64_t n = 0; n < 2 * nv; n++) o[n] += h[k] * L->ba_dense[k * 2 * nv + n];
        }
    else if (!proj(L->ba, S->h, B, &S->s, S->part, S->ba)) return 0;
    for (int64_t b = 0; b < B; b++) {           /* conv step: the tail, then this input */
        float *tail = L->conv_state + S->slots[b] * (K - 1) * C, *c = S->conv + b * C;
        const float *x = S->qkv + b * N;
        for (int64_t ch = 0; ch < C; ch++) {
            const float *w = L->conv + ch * K;
            float y = 0.0f;
            for (int64_t i = 0; i < K - 1; i++) y += tail[i * C + ch] * w[i];
            y += x[ch] * w[K - 1];
            c[ch] = y;
        }
        mul_sigmoid(c, c, C, 2);
        if (K > 1) {
            memmove(tail, tail + C, sizeof(float) * (K - 2) * C);
            memcpy(tail + (K - 2) * C, x, sizeof(float) * C);
        }
        const float qs = 1.0f / sqrtf((float)dk);
        for (int64_t h = 0; h < 2 * nk; h++) {   /* l2-normalize q, k per key head */
            float *r = c + h * dk, ss = 0.0f;
            for (int64_t i = 0; i < dk; i++) ss += r[i] * r[i];
            const float inv = 1.0f / sqrtf(ss + 1e-6f);
            for (int64_t i = 0; i < dk; i++) r[i] *= inv;
            if (h < nk) for (int64_t i = 0; i < dk; i++) r[i] *= qs;
        }
    }
    DeltaArgs a = {L, S};
    pool_run(delta_item, &a, B * nv);
    return proj(L->o, S->attn, B, &S->s, S->part, S->y);
}

/* x [B, D] updated in place; `first` [B]: each query's first key position (its window),
 * cos, sin [B, half] (attention). 0 where a product was not taken (pn_int_ok said it
 * would be). */
int pn_decode_layer(const PnLayer *L, const PnStep *S, const int64_t *first,
                    const float *cos_, const float *sin_, float *x) {
    const int64_t B = S->B, D = L->D;
    pn_rms_norm(x, B, D, D, L->norm1, L->eps, S->h);
    if (!(L->mixer == 1 ? deltanet_mixer(L, S) : attention_mixer(L, S, first, cos_, sin_)))
        return 0;
    residual(L, S, L->post1, x);
    pn_rms_norm(x, B, D, D, L->norm2, L->eps, S->h);
    if (!proj(L->gu, S->h, B, &S->s, S->part, S->gu)) return 0;
    if (L->gelu) pn_gelu_mul(S->gu, B, L->d_ff, S->act);
    else pn_silu_mul(S->gu, B, L->d_ff, S->act);
    if (!proj(L->down, S->act, B, &S->s, S->part, S->y)) return 0;
    residual(L, S, L->post2, x);
    return 1;
}

/* -- repacking at load (worker/qmatrix.py's fast path for the K-quants) -------------- */
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

#include "kernels_deltanet.c"
