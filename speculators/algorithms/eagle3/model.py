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

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from speculators import draft_layer_types
from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.models.draft import DraftModel
from speculators.models.layers import (
    AttendFn,
    DraftAttention,
    bind_layer,
    hf_layer_config,
    sliding_causal_attend,
)


class Eagle3DecoderLayer(nn.Module):
    """Layer 0 attends over ``concat(embeds, hidden)``; later layers are plain pre-norm decoder layers."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, norm_before_residual: bool, qk_norm: bool):
        super().__init__()
        hidden = cfg.hidden_size
        self.layer_idx = layer_idx
        self.norm_before_residual = norm_before_residual
        self.self_attn = DraftAttention(cfg, 2 * hidden if layer_idx == 0 else hidden, qk_norm)
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


class Eagle3DraftModel(DraftModel):
    """An EAGLE-3 draft whose parameter names are exactly the checkpoint's (unprefixed)."""

    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        layer_type = draft_layer_types.get(config.layer_type)  # a clear error for a type vLLM does not build
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
        self.layers = nn.ModuleList(
            Eagle3DecoderLayer(cfg, i, config.norm_before_residual, layer_type.qk_norm)
            for i in range(config.num_layers)
        )
        self.norm = LlamaRMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        self.register_vocab(config.draft_vocab_size, vocab)

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
        attend = attend or sliding_causal_attend(self.config.layer_windows)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(embeds, position_ids)
        residual = None
        for layer in self.layers:
            layer_attend = bind_layer(attend, layer.layer_idx)
            hidden, residual = layer(embeds, hidden, residual, cos, sin, layer_attend)
        prenorm = hidden + residual
        normed = self.norm(prenorm)
        return self.lm_head(normed), (normed if self.config.norm_output else prenorm)
