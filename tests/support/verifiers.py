"""Tiny random verifiers (Llama or Qwen3 configs with random weights) for tests and benchmarks: fine for format,
pipeline and engine checks, meaningless for draft quality."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from speculators.format.checkpoint import atomic_directory


def tiny_verifier_config(arch: str = "llama", **overrides: Any) -> Any:
    """A small Llama or Qwen3 config (random weights are fine for format and pipeline tests)."""
    from transformers import LlamaConfig, Qwen3Config

    settings: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=2,  # head_dim 32: the smallest head size vLLM's CPU attention serves
        num_key_value_heads=1,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    if arch == "qwen3":
        settings.setdefault("head_dim", settings["hidden_size"] // settings["num_attention_heads"])
        return Qwen3Config(**settings, architectures=["Qwen3ForCausalLM"])
    if arch == "llama":
        return LlamaConfig(**settings, architectures=["LlamaForCausalLM"])
    raise ValueError(f"unknown tiny verifier architecture {arch!r}: use llama or qwen3")


def build_tiny_verifier(
    directory: str | Path, arch: str = "llama", seed: int = 0, tokenizer: Any = None, **overrides: Any
) -> Path:
    """Save a random tiny verifier (and optionally a tokenizer) as an HF directory; returns the directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_verifier_config(arch, **overrides))
    with atomic_directory(directory) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return Path(directory)
