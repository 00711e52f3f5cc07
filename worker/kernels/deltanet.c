/* Gated DeltaNet's prefill (Qwen3.5's linear attention) over one sequence's chunk.
 *
 * A part of pantheon.c after layer.c (it uses the pool, pn_rms_norm, mul_sigmoid and the
 * exp helpers); worker/layers/gated_deltanet.py holds the math and the NumPy reference:
 *
 *   1. conv:  c_t = silu(sum_i conv[:, i] * x_{t-K+1+i}), x_{<0} from the carried tail
 *             [K-1, C]; then q, k l2-normalized per key head (q also by dk^-1/2).
 *             Work items: blocks of tokens.
 *   2. rule:  per value head h (a work item), its state S_h [dk, dv] token by token:
 *             S = e^g S;  u = beta (v - Sᵀk);  S += k ⊗ u;  o = Sᵀq.
 *   3. out:   o = rms_norm(o, ssm_norm) * silu(z), per token and head.
 *
 * Why token by token and not the chunked (WY) form the NumPy and GPU paths use: per
 * token and head the recurrence is about 4 dk dv flops and the chunked form about
 * 3 dk dv + 4 L d (L = 64) — more, and spent in small matrix products. What makes the
 * recurrence fast here is its memory: every column of S evolves on its own (given k, q,
 * beta, g), so a head's state is swept in tiles of one vector's columns, [dk, 16] floats
 * with AVX-512 (8 KiB at dk = 128), [dk, 8] with AVX2, that stay in L1 across all the chunk's tokens. The state is float32 like the
 * reference's; the sums run in another order, so the result agrees to float32 rounding
 * (tests/test_deltanet_prefill.py). */

#if defined(__AVX512F__)        /* state columns per tile: one vector register (a wider */
#define DN_W 16                 /* vector type than the ISA's own spills on every use) */
#elif defined(__AVX__)
#define DN_W 8
#else
#define DN_W 4
#endif
#define DN_MAX_DK 512
#define DN_TOKENS 8             /* tokens per conv work item */
typedef float dn_vec __attribute__((vector_size(DN_W * 4)));

/* mul 0: o[i] = silu(g[i]) (o may be g); 1: o[i] *= silu(g[i]) (layer.c's, vectorized
 * with AVX-512 and AVX2) */
static inline void dn_silu(float *o, const float *g, int64_t n, int mul) {
    mul_sigmoid(o, g, n, mul ? 1 : 2);
}

typedef struct {
    const float *mixed, *z, *beta, *g, *conv_t, *tail, *norm;
    float *state, *c, *e, *out;
    int64_t n, ms, zs, os, nk, nv, dk, dv, K, tiled;
    float eps;
} DnArgs;

static inline dn_vec dn_load(const float *p) { dn_vec v; memcpy(&v, p, sizeof v); return v; }
static inline void dn_store(float *p, dn_vec v) { memcpy(p, &v, sizeof v); }

/* Σ x², in vector lanes (a float sum in one chain is not vectorized: its order is fixed) */
static inline float dn_sum_squares(const float *x, int64_t n) {
    dn_vec acc = {0};
    int64_t i = 0;
    for (; i + DN_W <= n; i += DN_W) { const dn_vec v = dn_load(x + i); acc += v * v; }
    float ss = 0.0f;
    for (int j = 0; j < DN_W; j++) ss += acc[j];
    for (; i < n; i++) ss += x[i] * x[i];
    return ss;
}

/* tokens [8 it, 8 it + 8): conv over the carried tail and the new inputs, SiLU, l2 norms */
static void dn_conv_item(const void *p, int64_t it) {
    const DnArgs *a = p;
    const int64_t C = 2 * a->nk * a->dk + a->nv * a->dv, K = a->K;
    const int64_t t1 = (it + 1) * DN_TOKENS < a->n ? (it + 1) * DN_TOKENS : a->n;
    const float qs = 1.0f / sqrtf((float)a->dk);
    for (int64_t t = it * DN_TOKENS; t < t1; t++) {
        float *restrict c = a->c + t * C;
        for (int64_t i = 0; i < K; i++) {        /* input t - K + 1 + i: the tail's or new */
            const int64_t s = t - K + 1 + i;
            const float *restrict x = s >= 0 ? a->mixed + s * a->ms : a->tail + (K - 1 + s) * C;
            const float *restrict w = a->conv_t + i * C;
            if (i == 0) for (int64_t ch = 0; ch < C; ch++) c[ch] = x[ch] * w[ch];
            else for (int64_t ch = 0; ch < C; ch++) c[ch] += x[ch] * w[ch];
        }
        dn_silu(c, c, C, 0);
        for (int64_t h = 0; h < 2 * a->nk; h++) {      /* q heads, then k heads */
            float *restrict r = c + h * a->dk;
            const float ss = dn_sum_squares(r, a->dk);
            float inv = 1.0f / sqrtf(ss + 1e-6f);
            if (h < a->nk) inv *= qs;
            for (int64_t i = 0; i < a->dk; i++) r[i] *= inv;
        }
    }
}


/* columns [j0, j0 + DN_W) of head h's state through all n tokens (o into out) */
static void dn_rule_tile(const DnArgs *a, int64_t h, int64_t j0, dn_vec *restrict St) {
    const int64_t nk = a->nk, nv = a->nv, dk = a->dk, dv = a->dv;
    const int64_t C = 2 * nk * dk + nv * dv, kh = a->tiled ? h % nk : h / (nv / nk);
    float *S = a->state + h * dk * dv + j0;
    for (int64_t i = 0; i < dk; i++) St[i] = dn_load(S + i * dv);
    for (int64_t t = 0; t < a->n; t++) {
        const float *restrict row = a->c + t * C;
        const float *restrict q = row + kh * dk, *restrict k = row + nk * dk + kh * dk;
        const float e = a->e[t * nv + h], b = a->beta[t * nv + h];
        dn_vec s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};         /* Sᵀk, four chains */
        int64_t i = 0;
        for (; i + 4 <= dk; i += 4) {
            s0 += k[i] * St[i]; s1 += k[i + 1] * St[i + 1];
            s2 += k[i + 2] * St[i + 2]; s3 += k[i + 3] * St[i + 3];
        }
        for (; i < dk; i++) s0 += k[i] * St[i];
        const dn_vec u = (dn_load(row + 2 * nk * dk + h * dv + j0) - e * ((s0 + s1) + (s2 + s3))) * b;
        dn_vec o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0};          /* Sᵀq, four chains */
        for (i = 0; i + 4 <= dk; i += 4) {
            St[i] = St[i] * e + k[i] * u;
            St[i + 1] = St[i + 1] * e + k[i + 1] * u;
            St[i + 2] = St[i + 2] * e + k[i + 2] * u;
            St[i + 3] = St[i + 3] * e + k[i + 3] * u;
            o0 += q[i] * St[i]; o1 += q[i + 1] * St[i + 1];
            o2 += q[i + 2] * St[i + 2]; o3 += q[i + 3] * St[i + 3];
        }
        for (; i < dk; i++) { St[i] = St[i] * e + k[i] * u; o0 += q[i] * St[i]; }
        dn_store(a->out + t * a->os + h * dv + j0, (o0 + o1) + (o2 + o3));
    }
    for (int64_t i = 0; i < dk; i++) dn_store(S + i * dv, St[i]);
}

/* the columns [j0, dv) left over by the tiles, one at a time */
static void dn_rule_columns(const DnArgs *a, int64_t h, int64_t j0) {
    const int64_t nk = a->nk, nv = a->nv, dk = a->dk, dv = a->dv;
    const int64_t C = 2 * nk * dk + nv * dv, kh = a->tiled ? h % nk : h / (nv / nk);
    float *S = a->state + h * dk * dv;
    for (int64_t j = j0; j < dv; j++)
        for (int64_t t = 0; t < a->n; t++) {
            const float *row = a->c + t * C, *q = row + kh * dk, *k = row + nk * dk + kh * dk;
            const float e = a->e[t * nv + h], b = a->beta[t * nv + h];
            float kv = 0.0f, o = 0.0f;
            for (int64_t i = 0; i < dk; i++) kv += k[i] * S[i * dv + j];
            const float u = (row[2 * nk * dk + h * dv + j] - e * kv) * b;
            for (int64_t i = 0; i < dk; i++) {
                S[i * dv + j] = S[i * dv + j] * e + k[i] * u;
                o += q[i] * S[i * dv + j];
            }
            a->out[t * a->os + h * dv + j] = o;
        }
}

/* value head h: the rule over every column, then each token's gated norm */
static void dn_head_item(const void *p, int64_t h) {
    const DnArgs *a = p;
    const int64_t dv = a->dv;
    dn_vec St[DN_MAX_DK] __attribute__((aligned(64)));
    int64_t j = 0;
    for (; j + DN_W <= dv; j += DN_W) dn_rule_tile(a, h, j, St);
    if (j < dv) dn_rule_columns(a, h, j);
    for (int64_t t = 0; t < a->n; t++) {
        float *o = a->out + t * a->os + h * dv;
        pn_rms_norm(o, 1, dv, dv, a->norm, a->eps, o);
        dn_silu(o, a->z + t * a->zs + h * dv, dv, 1);
    }
}

/* One sequence's n new tokens through a Gated DeltaNet layer's sequence part.
 * mixed [n, C] (row stride ms) the in-product's conv channels, z [n, nv dv] (stride zs)
 * its gate, beta and g [n, nv] (sigmoid(b) and the log decay, < 0); conv [C, K]; tail
 * [K-1, C] and state [nv, dk, dv] are read and advanced in place; ssm_norm [dv] →
 * out [n, nv dv] (row stride os): rms_norm(o) * silu(z), ready for the out product.
 * C = 2 nk dk + nv dv; tiled: value head h reads key head h % nk, else h / (nv / nk).
 * 0 (nothing done) where the shapes are out of its range: the caller takes NumPy's way. */
int pn_deltanet_prefill(const float *mixed, int64_t ms, const float *z, int64_t zs,
                        const float *beta, const float *g, const float *conv, float *tail,
                        float *state, const float *ssm_norm, float eps, int64_t n, int64_t nk,
                        int64_t nv, int64_t dk, int64_t dv, int64_t K, int64_t tiled,
                        float *out, int64_t os) {
    const int64_t C = 2 * nk * dk + nv * dv;
    if (n <= 0 || K < 1 || dk > DN_MAX_DK || nk <= 0 || nv % nk) return 0;
    float *conv_t = malloc(sizeof(float) * (K * C + n * C + n * nv));
    if (!conv_t) return 0;
    float *c = conv_t + K * C, *e = c + n * C;
    for (int64_t ch = 0; ch < C; ch++)               /* [C, K] → [K, C]: channels in a row */
        for (int64_t i = 0; i < K; i++) conv_t[i * C + ch] = conv[ch * K + i];
    for (int64_t i = 0; i < n * nv; i++) e[i] = expf(g[i]);
    DnArgs a = {mixed, z, beta, g, conv_t, tail, ssm_norm, state, c, e, out,
                n, ms, zs, os, nk, nv, dk, dv, K, tiled, eps};
    pool_run(dn_conv_item, &a, (n + DN_TOKENS - 1) / DN_TOKENS);
    for (int64_t r = 0; r < K - 1; r++) {   /* the new tail: inputs n .. n + K - 2 of */
        const int64_t src = n + r;            /* [tail; mixed], each row read before written */
        if (src < K - 1) memmove(tail + r * C, tail + src * C, sizeof(float) * C);
        else memcpy(tail + r * C, mixed + (src - (K - 1)) * ms, sizeof(float) * C);
    }
    pool_run(dn_head_item, &a, nv);
    free(conv_t);
    return 1;
}
