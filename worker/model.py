"""The forward pass: one implementation over an array module `xp`, any layer stack.

A step runs a *mixed batch*: several sequences (each bound to a slot) at
different positions, each contributing one token (decode) or a chunk of
tokens (prefill). Their tokens are concatenated into one [T, D] activation so
that every weight matrix is read once per layer for all of them; only the
mixers, which depend on each sequence's own history (its slot's state), look
at sequences one by one or in groups. Logits are computed only for the
positions that will be sampled.

The layers come from the config's stack (common/arch/): each block is
x += [post-norm] mixer(norm(x)); x += [post-norm] mlp(norm(x)), its mixer built
by the kind's class in worker/layers/ around its own sequence state
(worker/sequence_state.py). This loop never names a family.

Activations stay float32 everywhere. Every projection goes through
worker/linear.py: dense weights (fp32, or fp16 on a GPU) are multiplied in
their own dtype, quantized ones (QMatrix) by the die's kernels; the result is
float32 either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..common.model_file import ModelConfig
from .layers import MIXERS, GatedMLP
from .layers.decode_cpu import DecodeLayers
from .layers.attention import attend, attend_decodes  # noqa: F401  (re-exported)
from .layers.ops import linear, rms_norm, rope, silu  # noqa: F401  (re-exported)
from . import kernels_cpu
from .linear import is_quantized
from .sequence_state import SequenceState
from .weights import Weights, rope_inv_freq

F32 = np.float32


@dataclass(frozen=True, slots=True)
class Span:
    """One sequence's share of a mixed batch."""

    slot: int            # slot the sequence lives in
    start: int           # positions already in the slot's state
    n: int               # tokens this step adds (1 for decode, a chunk for prefill)
    logits: bool = True  # whether the last of those positions needs logits
    pool: str = ""       # "mean": the sum of these positions' final hidden states is
                         # wanted; "last": the last one's (an embedding request)
    verify: int = 1      # with logits: how many of its last positions need them (a
                         # speculative chunk's last token and its proposals: all of them)


class RopeTable:
    """cos, sin [ctx, r/2] of one rotary spec: float32 angles, as the reference
    computes them (position * inv_freq)."""

    def __init__(self, inv_freq: np.ndarray, ctx: int, xp):
        angles = xp.arange(ctx, dtype=F32)[:, None] * xp.asarray(inv_freq)[None, :]
        self.cos, self.sin = xp.cos(angles), xp.sin(angles)


class Batch:
    """One step's spans, prepared once and read by every layer."""

    def __init__(self, spans: list[Span], xp, row_multiple: int):
        self.spans, self.xp = spans, xp
        positions = np.concatenate([np.arange(s.start, s.start + s.n) for s in spans])
        self.n = n = len(positions)
        # rows beyond n are padding (see Model.row_multiple): no span owns them
        self.T = n if n == 1 else -(-n // row_multiple) * row_multiple
        self.positions, self.pos = positions, xp.asarray(positions)
        rows = np.cumsum([0] + [s.n for s in spans])
        self.rows = rows                                   # span i owns rows[i]:rows[i+1]
        self.chunks = [(int(row), s) for row, s in zip(rows, spans) if s.n > 1]
        self._memo: dict = {}

    def memo(self, key, build):
        """A per-step preparation shared by the layers (`build(spans, xp)`, made once)."""
        if key not in self._memo:
            self._memo[key] = build(self.spans, self.xp)
        return self._memo[key]

    def rope(self, table: RopeTable):
        """cos, sin [n, 1, r/2] of this step's positions."""
        key = ("rope", id(table))
        if key not in self._memo:
            self._memo[key] = (table.cos[self.pos][:, None, :], table.sin[self.pos][:, None, :])
        return self._memo[key]

    def scratch(self, width: int):
        """A zeroed [T, width] float32 buffer shared by the layers of this step: each
        writes all its n rows before reading them, and the padding rows stay zero."""
        key = ("scratch", width)
        if key not in self._memo:
            self._memo[key] = self.xp.zeros((self.T, width), dtype=F32)
        return self._memo[key]


class Block:
    """One layer: norms, a mixer (with its sequence state) and an MLP."""

    def __init__(self, mixer, mlp, w, eps: float):
        self.mixer, self.mlp, self.eps = mixer, mlp, eps
        self.mixer_norm, self.mlp_norm = w.mixer_norm, w.mlp_norm
        self.post_mixer_norm, self.post_mlp_norm = w.post_mixer_norm, w.post_mlp_norm

    def __call__(self, x, batch) -> None:
        """x [T, D] updated in place."""
        h = self.mixer(rms_norm(x, self.mixer_norm, self.eps), batch)
        if self.post_mixer_norm is not None:
            h = rms_norm(h, self.post_mixer_norm, self.eps)
        x += h
        h = self.mlp(rms_norm(x, self.mlp_norm, self.eps))
        if self.post_mlp_norm is not None:
            h = rms_norm(h, self.post_mlp_norm, self.eps)
        x += h


class Model:
    """Weights, rotary tables and sequence state of one model replica on one die."""

    def __init__(self, cfg: ModelConfig, weights: Weights, xp, n_slots: int, ctx: int,
                 kv_dtype=F32, layers: tuple[int, int] | None = None):
        self.cfg, self.w, self.xp = cfg, weights, xp
        self.ctx = ctx
        # a stage of a replica split across dies holds layers [lo, hi) only
        self.layers = layers or (0, cfg.n_layers)
        tables: dict = {}
        self.blocks, states = [], []
        for spec, bw in zip(cfg.blocks[self.layers[0]:self.layers[1]], weights.blocks):
            kind = MIXERS[spec.mixer.kind]
            rope = getattr(spec.mixer, "rope", None)
            if rope is not None and rope not in tables:
                tables[rope] = RopeTable(rope_inv_freq(rope, weights.rope_factors), ctx, xp)
            state = kind.new_state(spec.mixer, n_slots, ctx, xp, kv_dtype)
            states.append(state)
            mixer = kind(spec.mixer, bw.mixer, state, tables.get(rope), cfg.rms_eps)
            self.blocks.append(Block(mixer, GatedMLP(spec.mlp, bw.mlp), bw, cfg.rms_eps))
        self.ropes = list(tables.values())
        self.state = SequenceState(states, n_slots, ctx)
        # OpenBLAS runs skinny products fastest at row counts that are multiples
        # of 8 (measured: 8 rows cost less than 2..7), so on the CPU a batch of
        # dense weights is padded with zero rows that no span owns; the quantized
        # kernels cost in proportion to the rows and get none.
        dense = not is_quantized(weights.blocks[0].mlp.w_gate_up) if weights.blocks else True
        self.row_multiple = 8 if xp is np and dense else 1
        self.pooled: list = []          # the last forward's (span index, [D] vector)
        self.decode_c = None
        if xp is np and not dense:      # each product tells the kernels what follows it
            kernels_cpu.chain(weights.forward_matrices())
            self.decode_c = DecodeLayers(self.blocks, cfg.d_model)   # decodes: a layer per call

    def forward(self, tokens, spans: list[Span]):
        """Run one mixed batch; returns logits [n_sampled, V] float32 (on the die): for each
        span that asks, rows of its last `verify` positions, in order.

        tokens: the spans' new token ids, concatenated in span order.
        """
        for s in spans:
            if s.n < 1 or s.start + s.n > self.ctx:
                raise ValueError(f"span {s} does not fit the context of {self.ctx}")
        x, batch = self.embed(tokens, spans)
        return self.finish(self.layers_forward(x, batch), batch)

    def embed(self, tokens, spans: list[Span]):
        """The embedded tokens x [T, D] (padded rows zero) and the step's Batch."""
        xp, cfg, w = self.xp, self.cfg, self.w
        tokens = xp.asarray(tokens, dtype=xp.int64)
        batch = Batch(spans, xp, self.row_multiple)
        if tokens.shape[0] != batch.n:
            raise ValueError(f"{tokens.shape[0]} tokens for spans covering {batch.n}")
        x = xp.zeros((batch.T, cfg.d_model), dtype=F32)                   # [T, D]
        x[:batch.n] = w.embed_rows(tokens)
        if cfg.embed_scale != 1.0:
            x *= cfg.embed_scale
        return x, batch

    def layers_forward(self, x, batch: Batch):
        """This model's layers over x [T, D], in place; returns x."""
        step = self.decode_c.step(batch) if self.decode_c is not None else None
        for i, block in enumerate(self.blocks):
            if step is None or not step.run(i, x):
                block(x, batch)
        assert x.dtype == F32, f"activations drifted to {x.dtype}"
        return x

    def finish(self, x, batch: Batch):
        """The output norm and head over the rows that need logits (and pooling)."""
        return self.head_logits(self.final_rows(x, batch))

    def final_rows(self, x, batch: Batch):
        """The rows that need logits, after the output norm [n_sampled, D]; the spans'
        pooled vectors go to self.pooled. (A split replica's second stage stops here and
        sends these back: the head matrix is the first stage's.)"""
        xp, cfg, w, spans = self.xp, self.cfg, self.w, batch.spans
        self.pooled = [(i, self.pool(x, batch, i, s.pool)) for i, s in enumerate(spans) if s.pool]
        rows = [r for i, s in enumerate(spans) if s.logits
                for r in range(int(batch.rows[i + 1]) - min(s.verify, s.n), int(batch.rows[i + 1]))]
        if not rows:
            return xp.empty((0, cfg.d_model), dtype=F32)
        return rms_norm(x[rows], w.out_norm, cfg.rms_eps)

    def head_logits(self, h):
        """Logits [n, V] of final rows h [n, D] (see final_rows)."""
        if h.shape[0] == 0:
            return self.xp.empty((0, self.cfg.vocab_size), dtype=F32)
        return linear(h, self.w.head)                                      # [n, V]

    def pool(self, x, batch: Batch, i: int, how: str):
        """Span i's final hidden states (after the output norm) pooled: their sum
        ("mean": the caller divides once the whole prompt has passed) or the last."""
        start, end = int(batch.rows[i]), int(batch.rows[i + 1])
        if how == "last":
            start = end - 1
        h = rms_norm(x[start:end], self.w.out_norm, self.cfg.rms_eps)     # [n, D]
        return h.sum(axis=0)                                               # [D]
