"""One model replica on one die: weights, KV memory and its scheduler."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common.model_file import ModelConfig, read_config
from .device import Device, open_device
from .model import Model, Span
from .prefix_cache import PrefixCache
from .scheduler import Scheduler
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

    def forward(self, tokens, spans: list[Span]) -> np.ndarray:
        """The scheduler's forward: host logits [n_sampled, V] float32."""
        return self.device.to_host(self.model.forward(tokens, spans))

    def warm_up(self) -> None:
        """One tiny forward so the first request does not pay for lazy set-up."""
        self.forward(np.zeros(1, dtype=np.int64), [Span(0, 0, 1)])


def load_engine(path: str | Path, die: str | Device = "cpu", n_slots: int = 8,
                ctx: int | None = None, prefill_chunk: int = 128, progress=None,
                prefix_cache_bytes: int = 0, quantize: str = "auto") -> Engine:
    """Load the model at `path` onto a die with `n_slots` KV slots of `ctx` positions."""
    started = time.perf_counter()
    device = die if isinstance(die, Device) else open_device(die)
    cfg = read_config(path)
    ctx = min(cfg.context_length, DEFAULT_CTX) if ctx is None else ctx
    if ctx < 2:
        raise ValueError(f"context must be at least 2 positions, got {ctx}")
    weights = load_weights(path, cfg, device, progress=progress, quantize=quantize)
    model = Model(cfg, weights, device.xp, n_slots, ctx, kv_dtype=device.weight_dtype)
    engine = Engine(cfg, device, model, None, 0.0)
    cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
    engine.scheduler = Scheduler(engine.forward, n_slots, ctx, prefill_chunk, model.kv, cache)
    engine.load_seconds = time.perf_counter() - started
    log.info("loaded %s (%s, %d layers) on die %s in %.1f s: %.0f MB weights (%s), "
             "%.0f MB KV", Path(path).name, cfg.arch, cfg.n_layers, device.die_id,
             engine.load_seconds, weights.nbytes() / 1e6,
             ", ".join(f"{n} {k}" for k, n in sorted(weights.formats().items())),
             model.kv.nbytes / 1e6)
    return engine
