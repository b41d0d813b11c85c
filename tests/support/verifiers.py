"""Tiny random verifiers (Llama or Qwen3 configs with random weights) for tests and benchmarks: fine for format,
pipeline and engine checks, meaningless for draft quality."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from speculators.atomic import atomic_directory


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


def tiny_byte_tokenizer(reserved: int = 5) -> Any:
    """A byte-level tokenizer built in memory, no merges: one token per byte (256) plus ``<|endoftext|>`` (eos),
    ``<|mask|>``, ``<|pad|>`` and ``reserved`` spare specials (264 tokens by default, a multiple of 8).

    Why: a host with no hub access and no embedded SmolLM2 (the GPU host) still needs a real tokenizer that vLLM
    loads and decodes with; every text encodes and every id decodes, so a tiny random verifier of this vocabulary
    size serves end to end."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        mask_token="<|mask|>",
        pad_token="<|pad|>",
        additional_special_tokens=[f"<|reserved_{i}|>" for i in range(reserved)],
    )
