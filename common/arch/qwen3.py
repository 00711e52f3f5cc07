"""Qwen3 (dense): the llama block with RMSNorm over each head's q and k."""
from __future__ import annotations

from . import Family
from .llama import llama_blocks

FAMILY = Family("qwen3", ("qwen3",), llama_blocks, hf_qk_norm=True)
