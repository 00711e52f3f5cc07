"""One model replica on one die: weights, sequence state, its sampler and its scheduler."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common.kv_cache import KVCacheTypes
from ..common.model_file import ModelConfig, ModelFileError, open_model_file
from ..common.weight_format import kv_types
from .activations import apply as choose_activations
from .activations import check as check_activations
from .device import Device, open_device
from .model import Model, Span
from .prefix_cache import PrefixCache
from .sampler import Sampler, SamplingParams, SequenceSampler
from .scheduler import Scheduler
from .spec import DraftProposer, SpecConfig
from .weights import load_weights

log = logging.getLogger(__name__)

DEFAULT_CTX = 4096


@dataclass
class Engine:
    cfg: ModelConfig
    device: Device
    model: Model
    scheduler: Scheduler
    load_seconds: float
    sampler: Sampler | None = None
    draft: Model | None = None       # speculation's draft model, on the same die
    activations: str = "int16"       # what its CPU products take (worker/activations.py)

    @property
    def weight_bytes(self) -> int:
        return self.model.w.nbytes() + (self.draft.w.nbytes() if self.draft else 0)

    @property
    def state_bytes(self) -> int:
        return self.model.state.nbytes + (self.draft.state.nbytes if self.draft else 0)

    def forward(self, tokens, spans: list[Span]) -> np.ndarray:
        """Host logits [n_sampled, V] float32, for tests and benchmarks: the scheduler's
        forward is `logits`, whose rows never leave the die."""
        return self.device.to_host(self.logits(tokens, spans))

    def logits(self, tokens, spans: list[Span]):
        """The scheduler's forward: logits [n_sampled, V] float32, left on the die."""
        return self.model.forward(tokens, spans)

    def pooled(self) -> list:
        """The last forward's pooled hidden states, on the host: [(span index, [D])]."""
        return [(i, self.device.to_host(v)) for i, v in self.model.pooled]

    def sample(self, logits, seqs: list[SequenceSampler]) -> list[tuple[int, list | None]]:
        """The scheduler's sampler: each row's token (and logprobs when its request asks),
        chosen on the die from `logits` (consumed); only those cross to the host."""
        return self.sampler.sample(logits, seqs)

    def warm_up(self) -> None:
        """A short prefill, one decode forward and a sample down every path, so the first
        request does not pay for lazy set-up (CuPy compiles each kernel on its first use;
        the CPU's many-row path allocates its tiles and wakes its BLAS threads)."""
        n = max(1, min(32, self.model.ctx - 1))        # a prefill's many-row path too
        self.logits(np.zeros(n, dtype=np.int64), [Span(0, 0, n)])
        logits = self.logits(np.zeros(1, dtype=np.int64), [Span(0, 0, 1)])
        if not bool(self.device.xp.isfinite(logits).all()):    # nothing loads that cannot serve
            raise ModelFileError("the model's first forward gives NaN or Inf logits: its "
                                 "weights are corrupt (or overflow this die's precision)")
        rows = [SequenceSampler(SamplingParams(temperature=0, logit_bias={0: 1.0},
                                               repetition_penalty=1.1, presence_penalty=0.1),
                                [0], OpenGrammar(self.cfg.vocab_size), logprobs=2),
                SequenceSampler(SamplingParams(min_p=0.1, seed=0), [0]),
                SequenceSampler(SamplingParams(top_k=4, top_p=0.9, seed=0), [0])]
        for seq in rows:                                   # penalties have a history
            seq.accept(0)
        self.sample(self.device.xp.repeat(logits, len(rows), axis=0), rows)


def load_draft(path: str, target: ModelConfig, device: Device, n_slots: int, ctx: int,
               quantize: str, activations: str = "int16",
               kv_cache: KVCacheTypes = KVCacheTypes()) -> Model:
    """Speculation's draft model: same vocabulary as the target, attention only (its
    state is rolled back by length), its own state in the same slot numbers."""
    cfg, reader = open_model_file(path)
    if cfg.vocab_size != target.vocab_size:
        raise ModelFileError(f"spec.draft: the draft's vocabulary ({cfg.vocab_size} tokens) "
                             f"is not the target's ({target.vocab_size}): a draft must share "
                             "its tokenizer")
    weights = load_weights(path, cfg, device, quantize=quantize, reader=reader)
    del reader
    draft = Model(cfg, weights, device.xp, n_slots, ctx, kv_types(path, device.kind, quantize,
                                                                  kv_cache))
    if not draft.state.truncatable:
        raise ModelFileError("spec.draft: a draft model with recurrent layers cannot be "
                             "rolled back; choose an attention-only model")
    verdict = choose_activations(draft, path, activations, quantize)
    log.info("draft %s: %s activations (%s)", Path(path).name, verdict.used, verdict.why)
    return draft


class OpenGrammar:
    """A grammar that allows every token (warm-up only)."""

    def __init__(self, n_tokens: int):
        self.words = np.full((n_tokens + 31) // 32, -1, dtype=np.int32)

    def bitmask(self) -> np.ndarray:
        return self.words

    def accept(self, token: int) -> None:
        pass


def load_engine(path: str | Path, die: str | Device = "cpu", n_slots: int = 8,
                ctx: int | None = None, prefill_chunk: int = 128, progress=None,
                prefix_cache_bytes: int = 0, quantize: str = "auto",
                spec: SpecConfig | None = None, activations: str = "int16",
                layers: tuple[int, int] | None = None,
                kv_cache: KVCacheTypes = KVCacheTypes()) -> Engine:
    """Load the model at `path` onto a die with `n_slots` KV slots of `ctx` positions,
    its attention KV held as `kv_cache` asks (common/kv_cache.py); `activations`: what
    its CPU products take (auto, int8, int16: worker/activations.py); `layers`: (lo, hi)
    for a stage of a replica split across two dies."""
    check_activations(activations)
    started = time.perf_counter()
    device = die if isinstance(die, Device) else open_device(die)
    cfg, reader = open_model_file(path)
    ctx = min(cfg.context_length, DEFAULT_CTX) if ctx is None else ctx
    if ctx < 2:
        raise ValueError(f"context must be at least 2 positions, got {ctx}")
    weights = load_weights(path, cfg, device, progress=progress, quantize=quantize,
                           reader=reader, layers=layers)
    del reader                       # the parsed metadata is not kept for the replica's life
    # KV types as the die table counts them (common/weight_format.kv_types): a GPU keeps
    # fp16 whatever its weights (a K80 holds fp32 weights; its KV at fp32 was twice what
    # admission reserved), the CPU fp32 unless --kv-cache asks f16; q8_0 / q4_0 as asked.
    # Recurrent state (Qwen3.5's DeltaNet) stays fp32 whatever this says.
    kv = kv_types(path, device.kind, quantize, kv_cache)
    model = Model(cfg, weights, device.xp, n_slots, ctx, kv_dtype=kv, layers=layers)
    engine = Engine(cfg, device, model, None, 0.0, Sampler(device.xp, device.settle))
    verdict = choose_activations(model, path, activations, quantize)
    engine.activations = verdict.used
    cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
    proposer = None
    if spec is not None and spec.kind == "draft" and model.state.truncatable:
        engine.draft = load_draft(spec.draft, cfg, device, n_slots, ctx, quantize,
                                  activations, kv_cache)
        proposer = DraftProposer(engine.draft, n_slots)
    engine.scheduler = Scheduler(engine.logits, n_slots, ctx, prefill_chunk, model.state, cache,
                                 sample=engine.sample, pooled=engine.pooled, spec=spec,
                                 proposer=proposer)
    engine.load_seconds = time.perf_counter() - started
    log.info("loaded %s (%s, %d layers) on die %s in %.1f s: %.0f MB weights (%s), "
             "%.0f MB KV (%s)", Path(path).name, cfg.arch, cfg.n_layers, device.die_id,
             engine.load_seconds, weights.nbytes() / 1e6,
             ", ".join(f"{n} {k}" for k, n in sorted(weights.formats().items())),
             model.state.nbytes / 1e6, kv[0] if kv[0] == kv[1] else f"k {kv[0]}, v {kv[1]}")
    if model.decode_c is not None:      # which decode layers run fused in C, and why not
        for line in model.decode_c.describe():
            log.info("decode layers of %s: %s", Path(path).name, line)
    if verdict.matrices or activations != "int16":
        log.info("%s: %s activations in its CPU products (%s)", Path(path).name,
                 verdict.used, verdict.why)
    if spec is not None and spec.on:
        if engine.scheduler.spec is None:
            log.info("speculation (%s) is off for %s: its recurrent layers' state cannot be "
                     "rolled back to a rejected position (a copy per verified position costs "
                     "more than speculation saves), so it decodes one token a step",
                     spec.kind, Path(path).name)
        else:
            log.info("speculation on for %s: %s, %s, proposals up to %d tokens",
                     Path(path).name, spec.kind,
                     f"n-grams up to {spec.n}" if spec.kind == "ngram" else
                     f"draft {Path(spec.draft).name} ({engine.draft.w.nbytes() / 1e6:.0f} MB "
                     f"weights, {engine.draft.state.nbytes / 1e6:.0f} MB KV)", spec.k)
    return engine
