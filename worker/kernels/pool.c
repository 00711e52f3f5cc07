/* pool.c: the one thread pool every parallel loop of the kernels runs on (pool_run). It
 * exists because an OpenMP barrier waited for a preempted thread: up to 8x a kernel's time
 * with a busy core beside it on a shared host; here late threads simply claim nothing. */
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

/* Start the pool once (pn_init): `threads` in all, the caller included; spin before
 * sleeping. noipa: a call from pn_init that GCC analyses across functions changed the
 * order in which it compiles the others, and with it the register allocation of
 * gemv_k_rows (k_rows.c), whose eight inlined group sizes are at the edge of the register
 * file: 1.3x slower at 5 rows of x, 0.92x at 8, measured with the call analysed. */
__attribute__((noipa))
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
