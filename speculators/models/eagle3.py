"""The EAGLE-3 draft model: one (or more) Llama- or Qwen3-style decoder layers over the verifier's features.

Read top to bottom, this file is the whole architecture. Per position t (see docs/algorithms.md):

    g_t      = fc(concat(aux states of the verifier))                  (step 0) or the draft's own h (later steps)
    x        = concat(input_layernorm(embed(token_{t+1})), hidden_norm(g_t))     -> q/k/v of layer 0 are 2H wide
    residual = hidden_norm(g_t) if norm_before_residual else g_t
    h        = residual + attn(x); h_pre = h + mlp(post_attention_layernorm(h))
    logits   = lm_head(norm(h_pre))   over the draft vocabulary;   h_pre feeds the next drafting step

It mirrors vLLM's ``llama_eagle3.py`` / ``qwen3_eagle3.py`` so the weights mean the same thing in both. Attention is
a callback (``attend(layer_idx, q, k, v)``) so the same module serves training-time test (diagonal TTT attention),
the decoding engine (KV cache, tree masks) and plain causal use.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from speculators.format.checkpoint import load_checkpoint, save_checkpoint
from speculators.format.config import Eagle3Config

# attend(layer_idx, q, k, v) -> attention output; q: [B, heads, T, D], k/v: [B, kv_heads, T, D] (rope applied).
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# The original EAGLE-3 layout names layer 0 `midlayer`; vLLM accepts it as an alias.
LEGACY_PREFIXES = {"midlayer.": "layers.0."}


def causal_attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal self-attention over the given positions (no cache)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def hf_layer_config(config: Eagle3Config) -> LlamaConfig:
    """The layer settings as a transformers ``LlamaConfig`` (rope parsed exactly as the verifier's was).

    Qwen3 layers differ from Llama's only by the per-head q/k norms, which ``Eagle3Attention`` adds itself, so one
    config class serves both.
    """
    layer = {k: v for k, v in config.transformer_layer_config.items() if k != "model_type"}
    return LlamaConfig(**layer)


class Eagle3Attention(nn.Module):
    """Multi-head attention whose q/k/v read ``in_features`` (2H in layer 0); Qwen3 adds per-head q/k RMSNorm."""

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
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class Eagle3DecoderLayer(nn.Module):
    """Layer 0 attends over ``concat(embeds, hidden)``; later layers are plain pre-norm decoder layers."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, norm_before_residual: bool, qk_norm: bool):
        super().__init__()
        hidden = cfg.hidden_size
        self.layer_idx = layer_idx
        self.norm_before_residual = norm_before_residual
        self.self_attn = Eagle3Attention(cfg, 2 * hidden if layer_idx == 0 else hidden, qk_norm)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=cfg.rms_norm_eps)
        if layer_idx == 0:
            self.hidden_norm = LlamaRMSNorm(hidden, eps=cfg.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[..., torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_idx == 0:
            normed_hidden = self.hidden_norm(hidden)
            residual = normed_hidden if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        else:
            residual = hidden + residual
            x = self.input_layernorm(residual)
        residual = residual + self.self_attn(x, cos, sin, attend)
        return self.mlp(self.post_attention_layernorm(residual)), residual


class Eagle3DraftModel(nn.Module):
    """An EAGLE-3 draft whose parameter names are exactly the checkpoint's (unprefixed)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        if config.layer_type not in ("llama", "qwen3"):
            raise ValueError(
                f"transformer_layer_config.model_type {config.layer_type!r}: use 'llama' or 'qwen3'"
            )
        self.config = config
        cfg = hf_layer_config(config)
        hidden, vocab, n_aux = (
            config.hidden_size,
            config.vocab_size,
            len(config.eagle_aux_hidden_state_layer_ids),
        )
        verifier_hidden = config.verifier_hidden_size
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the verifier's embedding
        if config.norm_before_fc:
            self.input_norm = LlamaRMSNorm(n_aux * verifier_hidden, eps=cfg.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(
                LlamaRMSNorm(verifier_hidden, eps=cfg.rms_norm_eps) for _ in range(n_aux)
            )
        self.fc = nn.Linear(n_aux * verifier_hidden, hidden, bias=False)
        qk_norm = config.layer_type == "qwen3"
        self.layers = nn.ModuleList(
            Eagle3DecoderLayer(cfg, i, config.norm_before_residual, qk_norm) for i in range(config.num_layers)
        )
        self.norm = LlamaRMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        # d2t holds OFFSETS: target_id = draft_id + d2t[draft_id]; t2d marks verifier ids kept in the draft vocab.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        self.t2d[: config.draft_vocab_size] = True

    # ---- the forward pieces --------------------------------------------------------------------------------
    def project_features(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``[..., n_aux * H_verifier]`` concatenated verifier states → the draft's ``[..., H]`` input feature."""
        if self.config.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        if self.config.fc_norm:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attend: AttendFn | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step. Returns ``(draft-vocab logits, hidden for the next step)``.

        ``input_ids[t]`` is the token after the one whose feature is ``hidden[t]`` (EAGLE's one-token shift).
        """
        attend = attend or causal_attend
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(embeds, position_ids)
        residual = None
        for layer in self.layers:
            layer_attend = _bind_layer(attend, layer.layer_idx)
            hidden, residual = layer(embeds, hidden, residual, cos, sin, layer_attend)
        prenorm = hidden + residual
        normed = self.norm(prenorm)
        return self.lm_head(normed), (normed if self.config.norm_output else prenorm)

    # ---- vocabulary ----------------------------------------------------------------------------------------
    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to verifier ids through the d2t offsets."""
        return draft_ids + self.d2t[draft_ids]

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t.to(torch.long))
        self.t2d.copy_(t2d.to(torch.bool))

    def expand_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits → verifier-vocab logits (``-inf`` outside the draft vocabulary), as vLLM does."""
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[
            ..., self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=draft_logits.device))
        ] = draft_logits
        return full

    # ---- checkpoint I/O ------------------------------------------------------------------------------------
    def export_state_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Tensors under the standard names: float weights in ``dtype``, d2t int64, t2d bool, embed_tokens always."""
        tensors = {}
        for name, tensor in self.state_dict().items():
            if name in ("d2t", "t2d"):
                continue
            tensors[name] = tensor.detach().to(dtype).contiguous()
        if self.config.draft_vocab_size != self.config.vocab_size:
            tensors["d2t"] = self.d2t.detach().to(torch.long).clone()
            tensors["t2d"] = self.t2d.detach().to(torch.bool).clone()
        return tensors

    def save_pretrained(
        self, directory: str | Path, dtype: torch.dtype = torch.bfloat16, extra_files: dict | None = None
    ) -> Path:
        """Write a standard speculators checkpoint (atomically)."""
        self.config.torch_dtype = str(dtype).removeprefix("torch.")
        return save_checkpoint(directory, self.config.to_dict(), self.export_state_dict(dtype), extra_files)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> Eagle3DraftModel:
        """Load a speculators checkpoint (``midlayer.`` names accepted as vLLM does)."""
        config_dict, tensors = load_checkpoint(directory)
        model = cls(Eagle3Config.from_dict(config_dict))
        model.load_standard_tensors(tensors, source=str(directory))
        return model.to(dtype)

    def load_standard_tensors(self, tensors: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        renamed = {}
        for name, tensor in tensors.items():
            for old, new in LEGACY_PREFIXES.items():
                if name.startswith(old):
                    name = new + name[len(old) :]
            renamed[name] = tensor
        expected = set(self.state_dict())
        if self.config.draft_vocab_size == self.config.vocab_size:
            renamed.setdefault("d2t", torch.zeros(self.config.draft_vocab_size, dtype=torch.long))
            renamed.setdefault("t2d", torch.ones(self.config.vocab_size, dtype=torch.bool))
        missing = sorted(expected - set(renamed))
        unexpected = sorted(set(renamed) - expected)
        if missing or unexpected:
            raise ValueError(
                f"{source}: tensors do not match the config (missing {missing}, unexpected {unexpected}); "
                "run `speculators validate` for details"
            )
        own = self.state_dict()
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in renamed.items()})


def _bind_layer(attend: AttendFn, layer_idx: int) -> Callable[..., torch.Tensor]:
    def bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(layer_idx, q, k, v)

    return bound
