"""Qwen2 / Qwen2.5: the llama block with q/k/v biases."""
from __future__ import annotations

from . import Family
from .llama import llama_blocks

FAMILY = Family("qwen2", ("qwen2",), llama_blocks, hf_qkv_bias=True)
