/* layer.c: a decode step's whole layer in one call (pn_decode_layer), attention or Gated
 * DeltaNet mixer: at batch 1 the Python calls between kernels took about a fifth of
 * SmolLM2's step (0.06 ms per layer against 0.2 ms of kernels). */
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
 * 2 o = silu(g) (o may be g). AVX-512 / AVX2: sigmoid through e^-|g| (exp512 / exp256,
 * never overflows), 16 / 8 at a time, where scalar tanhf took 14-16 ns a float (Gemma 3 270M's GELUs: 4-5 ms
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
#elif defined(PN_SIGMOID256)
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        __m256 f = sigmoid256(x);
        if (mode) f = _mm256_mul_ps(x, f);
        _mm256_storeu_ps(o + i, mode == 2 ? f : _mm256_mul_ps(_mm256_loadu_ps(o + i), f));
    }
#endif
    for (; i < n; i++) {
        const float x = g[i], f = mode ? x * sigmoidf_(x) : sigmoidf_(x);
        o[i] = mode == 2 ? f : o[i] * f;
    }
}

/* out[b, i] = gelu_tanh(g[b, i]) * g[b, F + i] (gate | up, fused): ops.py's
 * 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3); AVX-512 and AVX2 as x sigmoid(2u), equal
 * in exact arithmetic (and without 1 + tanh's cancellation for x << 0); AVX2 builds took
 * scalar tanhf before (Gemma 3 270M) */
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
#elif defined(PN_SIGMOID256)
        const __m256 c2 = _mm256_set1_ps(2.0f * c), k = _mm256_set1_ps(0.044715f);
        for (; i + 8 <= F; i += 8) {
            const __m256 x = _mm256_loadu_ps(gate + i);
            const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            const __m256 u2 = _mm256_mul_ps(c2, _mm256_fmadd_ps(k, x3, x));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid256(u2)),
                                                  _mm256_loadu_ps(up + i)));
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
