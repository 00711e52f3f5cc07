"""Gated DeltaNet (Qwen3.5's linear attention): a fixed-size recurrent state per slot.

Per token t of one sequence (spec: common/arch/stack.py GatedDeltaNet; nk/nv key
and value heads, r = nv / nk, dk/dv their sizes, K the conv kernel, C = conv_dim
= 2·nk·dk + nv·dv):

    mixed_t = x_t @ attn_qkv          [C]       (q | k | v channels)
    z_t     = x_t @ attn_gate         [nv·dv]
    beta_t  = sigmoid(x_t @ ssm_beta) [nv]
    g_t     = ssm_a · softplus(x_t @ ssm_alpha + ssm_dt)   [nv], < 0   (ssm_a = -exp(A_log))
    c_t     = silu(Σ_{i<K} ssm_conv1d[:, i] · mixed_{t-K+1+i})   depthwise causal,
              mixed_{<0} = 0; the conv state is the last K-1 inputs  [K-1, C]
    q_t, k_t, v_t = split(c_t): [nk, dk], [nk, dk], [nv, dv]
    q_t = l2(q_t) / sqrt(dk),  k_t = l2(k_t)
    value head h reads key head h mod nk (llama.cpp's tiled order, a GGUF) or
    h // r (transformers' grouped order, a Hugging Face checkpoint read as it is)
    per head h, state S_h [dk, dv] (float32, zero at the start):
        S_h  = exp(g_t,h) · S_h
        u    = beta_t,h · (v_t,h - S_hᵀ k_t,h)                    [dv]
        S_h  = S_h + k_t,h ⊗ u                                    (the delta rule)
        o_t,h = S_hᵀ q_t,h                                        [dv]
    y_t = concat_h gated_rms_norm(o_t,h, z_t,h, ssm_norm) @ ssm_out      [D]

The state (conv tail, S) has one size at every position, so a decoded token costs
O(1) in the context length; it is valid only at the exact length it absorbed
(worker/sequence_state.py RecurrentState).

Chunked form (transformers' torch_chunk_gated_delta_rule; exact in exact
arithmetic): split the tokens into chunks of L (64); inside a chunk, with S0 the
state on entry and Γ_t = Σ_{s<=t} g_s (per head),

    A[t, s] = beta_t · exp(Γ_t - Γ_s) · k_tᵀ k_s    for s < t (strictly lower)
    U = (I + A)⁻¹ (beta·V - (beta·exp(Γ)·K) S0)      the corrected values  [L, dv]
    o_t = exp(Γ_t) q_tᵀ S0 + Σ_{s<=t} exp(Γ_t - Γ_s) (q_tᵀ k_s) u_s
    S_L = exp(Γ_L) S0 + Σ_s exp(Γ_L - Γ_s) k_s ⊗ u_s

(I + A)⁻¹ is unit lower triangular, inverted by block doubling (log2 L levels of
batched matmuls: no LAPACK, the same code on CuPy). Padding a chunk with g = 0,
beta = 0, k = v = q = 0 leaves S unchanged, so any split of a prompt into chunks
gives the same state, up to float32 rounding.

In a step, the decode spans of every slot run the recurrence as one batched
update over their slots' states; each prefill chunk runs the chunked form alone. On the
CPU a prefill chunk's conv, rule and gated norm are one C call instead
(worker/kernels/deltanet.c: the recurrence with the state in L1-sized tiles); the NumPy
functions here stay the reference, and the path of a GPU or of a host without a compiler.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...common.arch.stack import GatedDeltaNet
from .. import kernels_cpu
from ..sequence_state import RecurrentState
from .attention import DecodeGroup
from .ops import F32, gated_rms_norm, l2_normalize, linear, sigmoid, silu, softplus, xp_of

CHUNK = 64          # transformers' chunk_size; the block inverse wants a power of two
# False: every prefill chunk takes the NumPy functions (tests compare the two ways)
C_PREFILL = [True]


# --- depthwise causal conv ----------------------------------------------------------------

def causal_conv1d_silu(x, kernel, tail):
    """Depthwise causal convolution + SiLU of one sequence's new inputs.

    x [n, C] the new inputs; kernel [C, K]; tail [K-1, C] the sequence's previous
    K-1 inputs (zeros at its start) → (silu(conv) [n, C], the new tail [K-1, C]).
    """
    xp = xp_of(x)
    n, K = x.shape[0], kernel.shape[1]
    full = xp.concatenate([tail, x], axis=0)                    # [K-1+n, C]
    y = full[0:n] * kernel[:, 0]
    for i in range(1, K):
        y += full[i:i + n] * kernel[:, i]
    return silu(y), xp.ascontiguousarray(full[n:])


def causal_conv1d_silu_step(x, kernel, tails):
    """One new input for each of B sequences. x [B, C]; tails [B, K-1, C]
    → (silu(conv) [B, C], new tails [B, K-1, C])."""
    xp = xp_of(x)
    full = xp.concatenate([tails, x[:, None, :]], axis=1)       # [B, K, C]
    y = (full * kernel.T[None]).sum(axis=1)
    return silu(y), xp.ascontiguousarray(full[:, 1:])


# --- the gated delta rule -----------------------------------------------------------------

def delta_rule_step(q, k, v, g, beta, state):
    """One token of the gated delta rule, for any leading batch dims.

    q, k [..., H, dk] (l2-normalized, q scaled by dk^-0.5, heads already matched to
    v's); v [..., H, dv]; g, beta [..., H]; state [..., H, dk, dv]
    → (o [..., H, dv], new state). The input state is not modified.
    """
    s = state * xp_of(g).exp(g)[..., None, None]
    kv = (k[..., None, :] @ s)[..., 0, :]                       # Sᵀk  [..., H, dv]
    u = (v - kv) * beta[..., None]
    s = s + k[..., :, None] * u[..., None, :]
    return (q[..., None, :] @ s)[..., 0, :], s


def gated_delta_rule_recurrent(q, k, v, g, beta, state):
    """Token by token over one sequence: q, k [n, H, dk]; v [n, H, dv]; g, beta [n, H];
    state [H, dk, dv] → (o [n, H, dv], state)."""
    out = xp_of(v).empty(v.shape, dtype=F32)
    for t in range(v.shape[0]):
        out[t], state = delta_rule_step(q[t], k[t], v[t], g[t], beta[t], state)
    return out, state


def unit_lower_inverse(a):
    """(I + a)⁻¹ for a [..., L, L] strictly lower triangular, L a power of two.

    Block doubling: the inverse of [[X, 0], [B, Y]] is [[X⁻¹, 0], [-Y⁻¹ B X⁻¹, Y⁻¹]];
    starting from the 1x1 diagonal blocks (all ones), each level joins pairs.
    """
    xp = xp_of(a)
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
    xp = xp_of(v)
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


# --- the mixer's pieces -------------------------------------------------------------------

def gates(b, a, ssm_a, dt):
    """b, a [T, nv] (x @ ssm_beta, x @ ssm_alpha) → beta [T, nv], g [T, nv] (log decay, < 0)."""
    return sigmoid(b), ssm_a * softplus(a + dt)


def split_heads(c, spec: GatedDeltaNet):
    """Conv outputs [..., conv_dim] → q, k [..., nv, dk] (l2-normed, q scaled, key heads
    matched to the value heads) and v [..., nv, dv]."""
    kd, lead = spec.key_dim, c.shape[:-1]
    q = l2_normalize(c[..., :kd].reshape(lead + (spec.n_k_heads, spec.d_k))) * (spec.d_k ** -0.5)
    k = l2_normalize(c[..., kd:2 * kd].reshape(lead + (spec.n_k_heads, spec.d_k)))
    v = c[..., 2 * kd:].reshape(lead + (spec.n_v_heads, spec.d_v))
    r = spec.n_v_heads // spec.n_k_heads
    if r > 1:
        xp = xp_of(c)
        if spec.hf_layout:      # grouped: value head h reads key head h // r
            q, k = xp.repeat(q, r, axis=-2), xp.repeat(k, r, axis=-2)
        else:                   # tiled: value head h reads key head h % nk
            reps = (1,) * len(lead) + (r, 1)
            q, k = xp.tile(q, reps), xp.tile(k, reps)
    return q, k, v


def deltanet_core(mixed, beta, g, kernel, spec: GatedDeltaNet, tail, state):
    """One sequence's chunk: mixed [n, conv_dim], beta, g [n, nv]; kernel [conv_dim, K];
    tail [K-1, conv_dim]; state [nv, dk, dv] → (o [n, nv, dv], new tail, new state)."""
    c, tail = causal_conv1d_silu(mixed, kernel, tail)
    q, k, v = split_heads(c, spec)
    o, state = gated_delta_rule(q, k, v, g, beta, state)
    return o, tail, state


def deltanet_core_decode(mixed, beta, g, kernel, spec: GatedDeltaNet, tails, states):
    """B sequences, one token each: mixed [B, conv_dim], beta, g [B, nv];
    tails [B, K-1, conv_dim]; states [B, nv, dk, dv] → (o [B, nv, dv], tails, states)."""
    c, tails = causal_conv1d_silu_step(mixed, kernel, tails)
    q, k, v = split_heads(c, spec)
    o, states = delta_rule_step(q, k, v, g, beta, states)
    return o, tails, states


def deltanet_output(o, z, norm, w_out, eps: float):
    """o, z [T, nv, dv] → gated norm → ssm_out → [T, D]."""
    h = gated_rms_norm(o, z, norm, eps)
    return linear(h.reshape(o.shape[0], -1), w_out)


def _f32_rows(a) -> bool:
    """a [n, d] float32 whose rows are each contiguous (a row stride of its own)."""
    return a.dtype == F32 and a.ndim == 2 and a.strides[1] == 4 and a.strides[0] % 4 == 0 \
        and a.strides[0] >= 4 * a.shape[1]


def deltanet_chunk_c(mixed, z, beta, g, w: DeltaNetWeights, spec: GatedDeltaNet, tail,
                     state, eps: float, out) -> bool:
    """One sequence's chunk through worker/kernels/deltanet.c: mixed [n, conv_dim], z [n, nv dv]
    (rows of the in-product), beta, g [n, nv] → out [n, nv dv] = the gated norm of the
    rule's output; tail [K-1, conv_dim] and state [nv, dk, dv] advanced in place. False
    (nothing done) where it cannot run: not the CPU, no compiler, another layout."""
    if not (C_PREFILL[0] and isinstance(mixed, np.ndarray) and mixed.shape[0]):
        return False
    try:
        lib = kernels_cpu.library()
    except (kernels_cpu.KernelBuildError, OSError):
        return False
    beta, g = np.ascontiguousarray(beta, F32), np.ascontiguousarray(g, F32)
    dense = (w.conv, w.norm, tail, state)
    if not (all(_f32_rows(a) for a in (mixed, z, out))
            and all(isinstance(a, np.ndarray) and a.dtype == F32 and a.flags.c_contiguous
                    for a in dense)):
        return False
    n, K = mixed.shape[0], spec.conv_kernel
    return bool(lib.pn_deltanet_prefill(
        mixed.ctypes.data, mixed.strides[0] // 4, z.ctypes.data, z.strides[0] // 4,
        beta.ctypes.data, g.ctypes.data, w.conv.ctypes.data, tail.ctypes.data,
        state.ctypes.data, w.norm.ctypes.data, eps, n, spec.n_k_heads, spec.n_v_heads,
        spec.d_k, spec.d_v, K, int(not spec.hf_layout), out.ctypes.data, out.strides[0] // 4))


# --- the layer ----------------------------------------------------------------------------

@dataclass
class DeltaNetWeights:
    w_in: object            # [D, conv_dim + nv dv] (attn_qkv | attn_gate, fused)
    w_ba: object            # [D, 2 nv] (ssm_beta | ssm_alpha)
    conv: object            # [conv_dim, K] ssm_conv1d
    dt: object              # [nv] ssm_dt.bias
    a: object               # [nv] ssm_a = -exp(A_log), < 0
    norm: object            # [dv] ssm_norm (plain w in every format)
    w_out: object           # [nv dv, D] ssm_out
    MATRICES = ("w_in", "w_ba", "w_out")


def load_deltanet(ld, p: str, spec: GatedDeltaNet, d_model: int) -> DeltaNetWeights:
    shapes = spec.tensors(p, d_model)
    nv, c = spec.n_v_heads, spec.conv_dim
    a = ld.array(p + "ssm_a", (nv,))
    if spec.hf_layout:                              # A_log, as transformers holds it
        a = -ld.device.xp.exp(a)
    names = [p + "attn_qkv.weight", p + "attn_gate.weight"]
    return DeltaNetWeights(
        w_in=ld.proj(names, [shapes[n] for n in names]),
        # apart from w_in: a small matrix in another format must not make it dense
        w_ba=ld.proj([p + "ssm_beta.weight", p + "ssm_alpha.weight"], [(nv, d_model)] * 2),
        conv=ld.device.xp.ascontiguousarray(
            ld.array(p + "ssm_conv1d.weight", shapes[p + "ssm_conv1d.weight"]).reshape(
                c, spec.conv_kernel)),
        dt=ld.array(p + "ssm_dt.bias", (nv,)), a=a,
        norm=ld.norm(p + "ssm_norm.weight", spec.d_v, family_norm=False),
        w_out=ld.proj([p + "ssm_out.weight"], [(d_model, spec.value_dim)]))


class GatedDeltaNetLayer:
    """One Gated DeltaNet layer: its weights, its recurrent state and its forward."""

    load = staticmethod(load_deltanet)

    def __init__(self, spec: GatedDeltaNet, w: DeltaNetWeights, state: RecurrentState,
                 rope_table, eps: float):
        self.spec, self.w, self.state, self.eps = spec, w, state, eps
        self.conv_state, self.ssm_state = state.arrays["conv"], state.arrays["ssm"]

    @staticmethod
    def new_state(spec: GatedDeltaNet, n_slots: int, ctx: int, xp, dtype) -> RecurrentState:
        """float32 whatever the KV dtype: the recurrence accumulates over the whole history."""
        return RecurrentState(n_slots, spec.state_shapes(), xp)

    def __call__(self, h, batch):
        """h [T, D] (normed) → [T, D], advancing the slots' states by this step's tokens."""
        spec, w, st, n = self.spec, self.w, self.state, batch.n
        c, nv, dv = spec.conv_dim, spec.n_v_heads, spec.d_v
        proj = linear(h, w.w_in)                                        # [T, C + nv dv]
        ba = linear(h[:n], w.w_ba)                                      # [n, 2 nv]
        beta, g = gates(ba[:, :nv], ba[:, nv:], w.a, w.dt)
        mixed = proj[:n, :c]
        z = proj[:, c:].reshape(-1, nv, dv)                             # padding rows: 0
        out = batch.scratch(nv * dv)                                    # [T, nv dv]
        hv = out.reshape(-1, nv, dv)            # the gated norm's rows; padding rows: 0
        conv, ssm = self.conv_state, self.ssm_state
        decodes = batch.memo("decodes", DecodeGroup)
        if decodes.size:
            for slot, pos in zip(decodes.host_slots, decodes.host_pos):
                st.begin(int(slot), int(pos))
            rows, slots = decodes.rows, decodes.slots
            o, conv[slots], ssm[slots] = deltanet_core_decode(
                mixed[rows], beta[rows], g[rows], w.conv, spec, conv[slots], ssm[slots])
            hv[rows] = gated_rms_norm(o, z[rows], w.norm, self.eps)
            for slot in decodes.host_slots:
                st.absorbed(int(slot), 1)
        for row, s in batch.chunks:
            end = row + s.n
            st.begin(s.slot, s.start)
            if not deltanet_chunk_c(mixed[row:end], proj[row:end, c:], beta[row:end],
                                    g[row:end], w, spec, conv[s.slot], ssm[s.slot], self.eps,
                                    out[row:end]):
                o, conv[s.slot], ssm[s.slot] = deltanet_core(
                    mixed[row:end], beta[row:end], g[row:end], w.conv, spec, conv[s.slot],
                    ssm[s.slot])
                hv[row:end] = gated_rms_norm(o, z[row:end], w.norm, self.eps)
            st.absorbed(s.slot, s.n)
        return linear(out, w.w_out)
