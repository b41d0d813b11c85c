"""Pieces every draft architecture shares: the layer config, multi-head attention with an attention callback, and
the decoder layer of the block drafters.

Attention is a callback (``attend(q, k, v)`` bound per layer) so one module serves training (TTT diagonals, anchor
blocks against context), the decoding engine (KV caches, tree masks) and plain causal use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb, rotate_half

# attend(layer_idx, q, k, v) -> attention output; q: [B, heads, T, D], k/v: [B, kv_heads, T, D] (rope applied).
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal self-attention over the given positions (no cache)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def sliding_causal_attend(windows: list[int | None]) -> AttendFn:
    """Plain causal attention over the given (contiguous) positions where layer ``i`` sees only its last
    ``windows[i]`` positions (None: all of them), as vLLM runs ``sliding_attention`` draft layers."""
    if not any(windows):
        return causal_attend

    def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        window = windows[layer_idx] if layer_idx < len(windows) else None
        if window is None:
            return causal_attend(layer_idx, q, k, v)
        offset = k.shape[2] - q.shape[2]  # the queries are the last positions
        query = offset + torch.arange(q.shape[2], device=q.device)
        distance = query[:, None] - torch.arange(k.shape[2], device=q.device)[None]
        mask = (distance >= 0) & (distance < window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def bind_layer(attend: AttendFn, layer_idx: int) -> Callable[..., torch.Tensor]:
    """``attend`` with its layer index fixed (what one layer's attention module calls)."""

    def bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(layer_idx, q, k, v)

    return bound


def hf_layer_config(config: Any) -> LlamaConfig:
    """The layer settings of a draft config as a transformers ``LlamaConfig`` (rope parsed exactly as the verifier's
    was). Qwen3 layers differ from Llama's only by the per-head q/k norms, which :class:`DraftAttention` adds
    itself, so one config class serves both. Keys a Llama config does not know (layer types, windows) are dropped:
    the draft config's own properties say how attention is masked."""
    skip = {"model_type", "layer_types", "sliding_window", "use_sliding_window", "max_window_layers"}
    layer = {k: v for k, v in config.transformer_layer_config.items() if k not in skip}
    return LlamaConfig(**layer)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of one tensor ``[B, heads, T, D]`` (neox layout, as ``apply_rotary_pos_emb``)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DraftAttention(nn.Module):
    """Multi-head attention whose q/k/v read ``in_features`` (2H in EAGLE-3's layer 0); Qwen3 adds per-head q/k
    RMSNorm."""

    def __init__(self, cfg: LlamaConfig, in_features: int, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps) if qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = attend(q, k, v)
        # the width named, not -1: an empty sequence (a P-EAGLE depth no sampled chain reaches) reshapes too
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``x [B, T, in]`` alone (rope and k-norm applied), ``[B, kv_heads, T, D]`` each:
        the block drafters inject context features into every layer this way."""
        batch, length, _ = x.shape
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return rotate(k.transpose(1, 2), cos, sin), v.transpose(1, 2)


class BlockDecoderLayer(nn.Module):
    """A plain pre-norm Qwen3 decoder layer (the DFlash family's): attention over context keys and the block."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = DraftAttention(cfg, cfg.hidden_size, qk_norm=True)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


__all__ = [
    "AttendFn",
    "BlockDecoderLayer",
    "DraftAttention",
    "bind_layer",
    "causal_attend",
    "sliding_causal_attend",
    "hf_layer_config",
    "rotate",
]
