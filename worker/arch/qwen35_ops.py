"""Qwen3.5 (`qwen35`; Qwen3-Next's layer types) as pure functions over `xp`.

A Qwen3.5 text model is a stack of decoder layers, each

    x += mixer(rms_norm(x, attn_norm))           mixer: Gated DeltaNet or gated attention
    x += mlp(rms_norm(x, post_attention_norm))   SwiGLU: down(silu(gate(h)) * up(h))

with `layer_types[i]` naming the mixer ("linear_attention" → Gated DeltaNet,
"full_attention" → gated attention; llama.cpp derives it from
`full_attention_interval`: layer i is full iff (i + 1) % interval == 0). Then
rms_norm(x, output_norm) and the head (tied to token_embd in the small models).
Weights are in llama.cpp's layout (worker/arch/qwen35_format.py says why and
converts Hugging Face checkpoints to it). Every projection goes through
worker/linear.py `matmul`, so a weight may be dense [in, out] or a QMatrix.

## Norms
Zero-centred RMSNorm: transformers stores w and computes x / rms(x) * (1 + w);
the GGUF converter folds the +1 in, so here every such norm weight is the
multiplier m = 1 + w and

    rms_norm(x, m) = x * rsqrt(mean(x²) + eps) * m           (eps = rms_norm_eps)

This covers attn_norm (input_layernorm), post_attention_norm, attn_q_norm,
attn_k_norm and output_norm. The gated norm of the DeltaNet (ssm_norm,
`linear_attn.norm`) is plain (its weight is not folded, starts at ones):

    gated_rms_norm(o, z, w) = o * rsqrt(mean(o²) + eps) * w * silu(z)   per head, over d_v

## Gated DeltaNet (linear attention), per token t of one sequence
Shapes: D = hidden, nk/nv = linear_num_key_heads/linear_num_value_heads
(nv % nk == 0, r = nv / nk), dk/dv = linear_key_head_dim/linear_value_head_dim,
K = linear_conv_kernel_dim (4), C = conv_dim = 2·nk·dk + nv·dv.

    mixed_t = x_t @ attn_qkv          [C]       (in_proj_qkv: q | k | v channels)
    z_t     = x_t @ attn_gate         [nv·dv]   (in_proj_z)
    beta_t  = sigmoid(x_t @ ssm_beta) [nv]      (in_proj_b)
    g_t     = ssm_a · softplus(x_t @ ssm_alpha + ssm_dt)   [nv], < 0
              (ssm_a = -exp(A_log), ssm_dt = dt_bias; in_proj_a)
    c_t     = silu(Σ_{i<K} ssm_conv1d[:, i] · mixed_{t-K+1+i})   [C], depthwise causal,
              mixed_{<0} = 0; the conv state is the last K-1 inputs  [K-1, C]
    q_t, k_t, v_t = split(c_t): [nk, dk], [nk, dk], [nv, dv]
    q_t = l2(q_t) / sqrt(dk),  k_t = l2(k_t),  l2(u) = u · rsqrt(Σu² + 1e-6)
    value head h reads key head h mod nk (llama.cpp's tiled order; transformers'
    grouped order reads h // r: the converter permutes the v heads, see qwen35_format)
    per head h, state S_h [dk, dv] (float32, zero at the start):
        S_h  = exp(g_t,h) · S_h
        u    = beta_t,h · (v_t,h - S_hᵀ k_t,h)                    [dv]
        S_h  = S_h + k_t,h ⊗ u                                    (the delta rule)
        o_t,h = S_hᵀ q_t,h                                        [dv]
    y_t = concat_h gated_rms_norm(o_t,h, z_t,h, ssm_norm) @ ssm_out      [D]

The per-sequence state is (conv tail [K-1, C], S [nv, dk, dv]): a fixed size,
whatever the position, so a decoded token costs O(1) in the context length.

Chunked form (what transformers' torch_chunk_gated_delta_rule computes; exact
in exact arithmetic): split the tokens into chunks of L (64); inside a chunk,
with S0 the state on entry and Γ_t = Σ_{s<=t} g_s (per head),

    A[t, s] = beta_t · exp(Γ_t - Γ_s) · k_tᵀ k_s    for s < t (strictly lower)
    U = (I + A)⁻¹ (beta·V - (beta·exp(Γ)·K) S0)      the corrected values  [L, dv]
    o_t = exp(Γ_t) q_tᵀ S0 + Σ_{s<=t} exp(Γ_t - Γ_s) (q_tᵀ k_s) u_s
    S_L = exp(Γ_L) S0 + Σ_s exp(Γ_L - Γ_s) k_s ⊗ u_s

(I + A)⁻¹ is unit lower triangular, inverted here by block doubling (log2 L
levels of batched matmuls: no LAPACK, same code on CuPy). Padding a chunk with
g = 0, beta = 0, k = v = q = 0 leaves S unchanged, so any split of a prompt
into chunks gives the same state, up to float32 rounding.

## Gated attention (full attention), per token
H = num_attention_heads, Hkv = num_key_value_heads, hd = head_dim,
R = rotary dim = head_dim · partial_rotary_factor (GGUF rope.dimension_count).

    qg = x @ attn_q  [H, 2·hd]: per head [query (hd) | gate (hd)], interleaved by head
    q = rms_norm(qg[:, :hd], attn_q_norm),  gate = qg[:, hd:]          [H, hd]
    k = rms_norm(x @ attn_k, attn_k_norm),  v = x @ attn_v             [Hkv, hd]
    q, k: rotate-half rope on the first R dims only, inv_freq = theta^(-2i/R)
          (Qwen3.5's mrope sections coincide for text: every section sees the
          same position)
    a = softmax(q kᵀ / sqrt(hd) + causal) v     (GQA: query head j reads kv head j // (H/Hkv))
    y = (a · sigmoid(gate)).reshape(H·hd) @ attn_output                 [D]
"""
from __future__ import annotations

import numpy as np

from ..linear import matmul

F32 = np.float32
CHUNK = 64          # transformers' chunk_size; the block inverse wants a power of two
L2_EPS = 1e-6       # transformers' l2norm eps (llama.cpp uses rms_norm_eps: 1e-6 as well)


def _xp(a):
    return np if isinstance(a, np.ndarray) else __import__("cupy").get_array_module(a)


# --- elementwise pieces -----------------------------------------------------------------

def silu(x):
    """x * sigmoid(x), written with tanh so large |x| never overflows exp."""
    return x * (0.5 + 0.5 * _xp(x).tanh(0.5 * x))


def sigmoid(x):
    return 0.5 + 0.5 * _xp(x).tanh(0.5 * x)


def softplus(x):
    """log(1 + exp(x)) without overflow."""
    xp = _xp(x)
    return xp.maximum(x, 0) + xp.log1p(xp.exp(-xp.abs(x)))


def rms_norm(x, w, eps: float):
    """x [..., d] over its root mean square, times w [d] (for a (1 + w) norm: w folded)."""
    xp = _xp(x)
    return x * (1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)) * w


def gated_rms_norm(o, z, w, eps: float):
    """The DeltaNet output norm: rms_norm(o, w) * silu(z). o, z [..., dv]; w [dv]."""
    return rms_norm(o, w, eps) * silu(z)


def l2_normalize(x, eps: float = L2_EPS):
    """x [..., d] · rsqrt(Σ x² + eps), as transformers' (and FLA's) l2norm."""
    xp = _xp(x)
    return x * (1.0 / xp.sqrt((x * x).sum(axis=-1, keepdims=True) + eps))


def mlp(x, w):
    """SwiGLU: x [T, D] → [T, D]."""
    return matmul(silu(matmul(x, w["ffn_gate"])) * matmul(x, w["ffn_up"]), w["ffn_down"])


# --- depthwise causal conv ----------------------------------------------------------------

def causal_conv1d_silu(x, kernel, tail):
    """Depthwise causal convolution + SiLU of one sequence's new inputs.

    x [n, C] the new inputs; kernel [C, K] (ssm_conv1d, squeezed); tail [K-1, C]
    the sequence's previous K-1 inputs (zeros at its start).
    → (silu(conv) [n, C], the new tail [K-1, C]).
    """
    xp = _xp(x)
    n, K = x.shape[0], kernel.shape[1]
    full = xp.concatenate([tail, x], axis=0)                    # [K-1+n, C]
    y = full[0:n] * kernel[:, 0]
    for i in range(1, K):
        y += full[i:i + n] * kernel[:, i]
    return silu(y), xp.ascontiguousarray(full[n:])


def causal_conv1d_silu_step(x, kernel, tails):
    """One new input for each of B sequences. x [B, C]; tails [B, K-1, C]
    → (silu(conv) [B, C], new tails [B, K-1, C])."""
    xp = _xp(x)
    full = xp.concatenate([tails, x[:, None, :]], axis=1)       # [B, K, C]
    y = (full * kernel.T[None]).sum(axis=1)
    return silu(y), xp.ascontiguousarray(full[:, 1:])


# --- the gated delta rule -----------------------------------------------------------------

def delta_rule_step(q, k, v, g, beta, state):
    """One token of the gated delta rule, for any leading batch dims.

    q, k [..., H, dk] (q/k l2-normalized, q scaled by dk^-0.5, heads already
    matched to v's); v [..., H, dv]; g, beta [..., H]; state [..., H, dk, dv].
    → (o [..., H, dv], new state). The input state is not modified.
    """
    s = state * _xp(g).exp(g)[..., None, None]
    kv = (k[..., None, :] @ s)[..., 0, :]                       # Sᵀk  [..., H, dv]
    u = (v - kv) * beta[..., None]
    s = s + k[..., :, None] * u[..., None, :]
    return (q[..., None, :] @ s)[..., 0, :], s


def gated_delta_rule_recurrent(q, k, v, g, beta, state):
    """Token by token over one sequence: q, k [n, H, dk]; v [n, H, dv]; g, beta [n, H];
    state [H, dk, dv] → (o [n, H, dv], state)."""
    xp = _xp(v)
    out = xp.empty(v.shape, dtype=F32)
    for t in range(v.shape[0]):
        out[t], state = delta_rule_step(q[t], k[t], v[t], g[t], beta[t], state)
    return out, state


def unit_lower_inverse(a):
    """(I + a)⁻¹ for a [..., L, L] strictly lower triangular, L a power of two.

    Block doubling: the inverse of [[X, 0], [B, Y]] is [[X⁻¹, 0], [-Y⁻¹ B X⁻¹, Y⁻¹]];
    starting from the 1x1 diagonal blocks (all ones), each level joins pairs.
    """
    xp = _xp(a)
    L = a.shape[-1]
    if L & (L - 1):
        raise ValueError(f"block size {L} is not a power of two")
    lead = a.shape[:-2]
    inv = xp.ones(lead + (L, 1, 1), dtype=a.dtype)              # diagonal blocks' inverses
    s = 1
    while s < L:
        nb = L // (2 * s)
        base = np.arange(nb)[:, None] * 2 * s + np.arange(s)[None, :]           # [nb, s]
        rows, cols = xp.asarray(base + s), xp.asarray(base)
        lower = a[..., rows[:, :, None], cols[:, None, :]]                     # [..., nb, s, s]
        x, y = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        joined = xp.zeros(lead + (nb, 2 * s, 2 * s), dtype=a.dtype)
        joined[..., :s, :s] = x
        joined[..., s:, s:] = y
        joined[..., s:, :s] = -(y @ lower @ x)
        inv, s = joined, 2 * s
    return inv[..., 0, :, :]


def gated_delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same recurrence over one sequence, `chunk` tokens at a time as matmuls.

    q, k [n, H, dk]; v [n, H, dv]; g, beta [n, H]; state [H, dk, dv]
    → (o [n, H, dv], state). Equal to gated_delta_rule_recurrent up to rounding.
    """
    xp = _xp(v)
    n, H, dk = k.shape
    dv = v.shape[-1]
    L = min(chunk, 1 << max(n - 1, 0).bit_length())             # a short prompt: a small block
    pad = -n % L
    if pad:
        q, k, v = (xp.concatenate([a, xp.zeros((pad,) + a.shape[1:], F32)]) for a in (q, k, v))
        g, beta = (xp.concatenate([a, xp.zeros((pad, H), F32)]) for a in (g, beta))
    N = (n + pad) // L
    # [N, L, H, d] → [H, N, L, d]: heads and chunks lead, so every product is batched.
    # Contiguous copies: NumPy multiplies a transposed strided view without BLAS
    # (measured: q @ kᵀ of one 64-token chunk at 16 heads, 390 ms as views, 0.3 ms copied).
    q, k, v = (xp.ascontiguousarray(a.reshape(N, L, H, -1).transpose(2, 0, 1, 3)) for a in (q, k, v))
    g, beta = (xp.ascontiguousarray(a.reshape(N, L, H).transpose(2, 0, 1)) for a in (g, beta))
    gam = xp.cumsum(g, axis=-1)                                  # Γ  [H, N, L]
    lower = xp.asarray(np.tril(np.ones((L, L), dtype=bool)))    # s <= t
    diff = gam[..., :, None] - gam[..., None, :]                 # Γ_t - Γ_s  [H, N, L, L]
    decay = xp.exp(xp.where(lower, diff, F32(-np.inf)))          # 0 above the diagonal
    kb = k * beta[..., None]
    a = (kb @ k.transpose(0, 1, 3, 2)) * decay
    a = a * xp.asarray(np.tril(np.ones((L, L), dtype=F32), -1))  # strictly lower
    t_inv = unit_lower_inverse(a)                                # [H, N, L, L]
    values = t_inv @ (v * beta[..., None])                       # [H, N, L, dv]
    keys_s0 = t_inv @ (kb * xp.exp(gam)[..., None])              # [H, N, L, dk]
    attn = (q @ k.transpose(0, 1, 3, 2)) * decay                 # [H, N, L, L]
    q_s0 = q * xp.exp(gam)[..., None]
    k_end = k * xp.exp(gam[..., -1:] - gam)[..., None]
    chunk_decay = xp.exp(gam[..., -1])[..., None, None]          # [H, N, 1, 1]
    out = xp.empty((H, N, L, dv), dtype=F32)
    for i in range(N):
        u = values[:, i] - keys_s0[:, i] @ state                 # [H, L, dv]
        out[:, i] = q_s0[:, i] @ state + attn[:, i] @ u
        state = state * chunk_decay[:, i] + k_end[:, i].transpose(0, 2, 1) @ u
    return out.transpose(1, 2, 0, 3).reshape(N * L, H, dv)[:n], state


def gated_delta_rule(q, k, v, g, beta, state):
    """One sequence's tokens through the rule: a chunked pass, or steps for a few tokens."""
    if v.shape[0] <= 2:
        return gated_delta_rule_recurrent(q, k, v, g, beta, state)
    return gated_delta_rule_chunked(q, k, v, g, beta, state)


# --- Gated DeltaNet mixer -----------------------------------------------------------------

def deltanet_project(x, w, cfg):
    """The input projections of every row of a step. x [T, D] →
    mixed [T, conv_dim], z [T, nv, dv], beta [T, nv], g [T, nv] (log decay, < 0)."""
    T = x.shape[0]
    mixed = matmul(x, w["attn_qkv"])                             # [T, 2 nk dk + nv dv]
    z = matmul(x, w["attn_gate"]).reshape(T, cfg.n_v_heads, cfg.d_v)
    beta = sigmoid(matmul(x, w["ssm_beta"]))                     # [T, nv]
    g = w["ssm_a"] * softplus(matmul(x, w["ssm_alpha"]) + w["ssm_dt"])
    return mixed, z, beta, g


def _split_heads(c, cfg):
    """Conv outputs [..., conv_dim] → q, k [..., nv, dk] (l2-normed, q scaled, key heads
    tiled to the value heads) and v [..., nv, dv]."""
    kd = cfg.n_k_heads * cfg.d_k
    lead = c.shape[:-1]
    q = l2_normalize(c[..., :kd].reshape(lead + (cfg.n_k_heads, cfg.d_k))) * (cfg.d_k ** -0.5)
    k = l2_normalize(c[..., kd:2 * kd].reshape(lead + (cfg.n_k_heads, cfg.d_k)))
    v = c[..., 2 * kd:].reshape(lead + (cfg.n_v_heads, cfg.d_v))
    r = cfg.n_v_heads // cfg.n_k_heads
    if r > 1:   # value head h reads key head h % nk (tiled)
        xp = _xp(c)
        reps = (1,) * len(lead) + (r, 1)
        q, k = xp.tile(q, reps), xp.tile(k, reps)
    return q, k, v


def deltanet_core(mixed, beta, g, w, cfg, tail, state):
    """One sequence's chunk: mixed [n, conv_dim], beta, g [n, nv]; tail [K-1, conv_dim];
    state [nv, dk, dv] → (o [n, nv, dv], new tail, new state)."""
    c, tail = causal_conv1d_silu(mixed, w["ssm_conv1d"], tail)
    q, k, v = _split_heads(c, cfg)
    o, state = gated_delta_rule(q, k, v, g, beta, state)
    return o, tail, state


def deltanet_core_decode(mixed, beta, g, w, cfg, tails, states):
    """B sequences, one token each: mixed [B, conv_dim], beta, g [B, nv];
    tails [B, K-1, conv_dim]; states [B, nv, dk, dv] → (o [B, nv, dv], tails, states)."""
    c, tails = causal_conv1d_silu_step(mixed, w["ssm_conv1d"], tails)
    q, k, v = _split_heads(c, cfg)
    o, states = delta_rule_step(q, k, v, g, beta, states)
    return o, tails, states


def deltanet_output(o, z, w, cfg):
    """o, z [T, nv, dv] → gated norm → ssm_out → [T, D]."""
    h = gated_rms_norm(o, z, w["ssm_norm"], cfg.rms_eps)
    return matmul(h.reshape(o.shape[0], cfg.n_v_heads * cfg.d_v), w["ssm_out"])


def gated_deltanet(x, w, cfg, tail, state):
    """The whole mixer for one sequence: x [n, D] (normed) → (y [n, D], tail, state)."""
    mixed, z, beta, g = deltanet_project(x, w, cfg)
    o, tail, state = deltanet_core(mixed, beta, g, w, cfg, tail, state)
    return deltanet_output(o, z, w, cfg), tail, state


def new_deltanet_state(cfg, xp=np, batch: tuple[int, ...] = ()):
    """A sequence's zero state: (conv tail [*batch, K-1, conv_dim], S [*batch, nv, dk, dv])."""
    return (xp.zeros(batch + (cfg.conv_kernel - 1, cfg.conv_dim), dtype=F32),
            xp.zeros(batch + (cfg.n_v_heads, cfg.d_k, cfg.d_v), dtype=F32))


# --- gated attention mixer ----------------------------------------------------------------

def rope_tables(positions, cfg, xp=np):
    """cos, sin [T, R/2] float32 for the rotary dims (float32 angles, as transformers)."""
    R = cfg.rotary_dim
    inv_freq = (1.0 / (cfg.rope_theta ** (np.arange(0, R, 2, dtype=np.float32) / R))).astype(F32)
    angles = xp.asarray(np.asarray(positions, dtype=F32)[:, None] * inv_freq[None, :])
    return xp.cos(angles), xp.sin(angles)


def partial_rope(x, cos, sin):
    """Rotate-half rope on the first R = 2·cos.shape[-1] dims of x [T, H, hd];
    cos, sin [T, R/2]. The other hd - R dims pass through."""
    xp = _xp(x)
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]], axis=-1)


def gated_attention_project(x, w, cfg, cos, sin):
    """x [T, D] → q [T, H, hd] (normed, roped, scaled by hd^-0.5), k [T, Hkv, hd]
    (normed, roped), v [T, Hkv, hd], gate [T, H·hd]."""
    T, H, hd = x.shape[0], cfg.n_heads, cfg.head_dim
    qg = matmul(x, w["attn_q"]).reshape(T, H, 2 * hd)           # per head [query | gate]
    gate = qg[..., hd:].reshape(T, H * hd)
    q = rms_norm(qg[..., :hd], w["attn_q_norm"], cfg.rms_eps)
    k = rms_norm(matmul(x, w["attn_k"]).reshape(T, cfg.n_kv_heads, hd), w["attn_k_norm"],
                 cfg.rms_eps)
    v = matmul(x, w["attn_v"]).reshape(T, cfg.n_kv_heads, hd)
    q = partial_rope(q, cos, sin) * (hd ** -0.5)
    return q, partial_rope(k, cos, sin), v, gate


def attend(q, k, v, start: int):
    """Causal GQA of one sequence: q [n, H, hd] (scaled) at positions [start, start+n);
    k, v [L, Hkv, hd] with L = start + n (its whole history) → [n, H·hd]."""
    xp = _xp(q)
    n, H, hd = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    # contiguous operands: NumPy multiplies transposed strided views without BLAS
    qg = xp.ascontiguousarray(q.reshape(n, Hkv, H // Hkv, hd).transpose(1, 2, 0, 3))  # [Hkv, g, n, hd]
    s = qg @ xp.ascontiguousarray(k.transpose(1, 2, 0))[:, None]                     # [Hkv, g, n, L]
    future = np.arange(L)[None, :] > (start + np.arange(n))[:, None]
    s = s + xp.asarray(np.where(future, -np.inf, 0.0).astype(F32))
    s = s - s.max(axis=-1, keepdims=True)
    p = xp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = p @ xp.ascontiguousarray(v.transpose(1, 0, 2))[:, None]                      # [Hkv, g, n, hd]
    return o.transpose(2, 0, 1, 3).reshape(n, H * hd)


def gated_attention_output(a, gate, w):
    """a, gate [T, H·hd] → (a · sigmoid(gate)) @ attn_output → [T, D]."""
    return matmul(a * sigmoid(gate), w["attn_output"])


def gated_attention(x, w, cfg, start: int, k_cache=None, v_cache=None):
    """The whole mixer for one sequence: x [n, D] (normed) at positions [start, start+n),
    k_cache, v_cache [start, Hkv, hd] its history (None when start is 0)
    → (y [n, D], k, v [start + n, Hkv, hd])."""
    xp = _xp(x)
    n = x.shape[0]
    cos, sin = rope_tables(np.arange(start, start + n), cfg, xp)
    q, k, v, gate = gated_attention_project(x, w, cfg, cos, sin)
    if k_cache is not None and k_cache.shape[0]:
        k, v = xp.concatenate([k_cache, k]), xp.concatenate([v_cache, v])
    return gated_attention_output(attend(q, k, v, start), gate, w), k, v
