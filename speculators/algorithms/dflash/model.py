"""The DFlash draft: a block drafter whose layers all attend to the verifier's context features.

Read top to bottom, this file is the whole architecture (docs/algorithms.md, "Block drafters"):

    context  c_p = fc(concat(aux states of the verifier at p))              for every verified position p
    block    slot 0 = the anchor (the last real token, at position a), slots 1..B-1 = mask_token_id at a+1..a+B-1
    layer i  h = h + attn_i(input_layernorm(h)) ; h = h + mlp(post_attention_layernorm(h))
             attn_i's keys/values are [k_i(hidden_norm(c_p)) for p < a]  ++  [k_i(block slots)]
             (the SAME k/v projections; the context is injected into every layer and never updated by one)
    logits   lm_head(norm(h)) over the draft vocabulary; slot s >= 1 proposes the token at a+s

Within the block, slots see each other causally or bidirectionally (``config.block_causal``). One forward proposes
``block_size - 1`` tokens. It mirrors vLLM's ``qwen3_dflash.py`` so the weights mean the same in both: there the
context K/V are precomputed into the KV cache (``precompute_and_store_context_kv``) and the block is the query.

Attention is a callback ``attend(layer_idx, q, k, v)`` over the block's own rope'd q/k/v: training (anchor blocks
against a packed row) and the decoding engine (a context cache) each bring their own, built on
:func:`block_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from speculators.algorithms.dflash.config import DFlashConfig
from speculators.models.draft import DraftModel
from speculators.models.layers import AttendFn, BlockDecoderLayer, bind_layer, hf_layer_config

# (keys, values) of the context for every draft layer, each [N, kv_heads, C, D] with rope applied
ContextKV = list[tuple[torch.Tensor, torch.Tensor]]


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    context_visible: torch.Tensor,
    causal: bool,
) -> torch.Tensor:
    """Attention of block queries over ``context ++ block``.

    ``q [N, H, S, D]``, ``k``/``v [N, Hkv, S, D]`` (the block), ``context_k``/``context_v [N, Hkv, C, D]``,
    ``context_visible [N, S, C]`` bool (the caller's rule: earlier positions of the same document, inside a sliding
    window if any). Memory is ``N·S·(C+S)`` scores: linear in the number of blocks.
    """
    slots = q.shape[2]
    own = torch.ones(slots, slots, dtype=torch.bool, device=q.device)
    if causal:
        own = own.tril()
    visible = torch.cat([context_visible, own.expand(q.shape[0], slots, slots)], dim=-1)[:, None]
    keys, values = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=visible, enable_gqa=q.shape[1] != k.shape[1]
    )


class DFlashDraftModel(DraftModel):
    """A DFlash draft whose parameter names are exactly the checkpoint's (unprefixed)."""

    config_class = DFlashConfig
    markov_bias = False  # slot logits do not depend on the previous slot's token (DSpark's do)

    def __init__(self, config: DFlashConfig) -> None:
        problem = config.full_vocabulary_problem(config.draft_vocab_size, config.vocab_size)
        if problem:
            raise ValueError(problem)
        super().__init__()
        self.config = config
        cfg = hf_layer_config(config)
        hidden, vocab = config.hidden_size, config.vocab_size
        n_aux = len(config.aux_layer_ids)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_tokens.weight.requires_grad_(
            False
        )  # a frozen copy of the verifier's (the mask row included)
        self.fc = nn.Linear(n_aux * config.verifier_hidden_size, hidden, bias=False)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(BlockDecoderLayer(cfg, i) for i in range(config.num_layers))
        self.norm = LlamaRMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        self.register_vocab(config.draft_vocab_size, vocab)

    # ---- the forward pieces --------------------------------------------------------------------------------
    def project_context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``[..., n_aux * H_verifier]`` verifier states → the context feature ``c`` (vLLM's
        ``combine_hidden_states``)."""
        return self.fc(aux_hidden)

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Every layer's keys and values of the context features ``[N, C, H]`` at ``positions [N, C]``."""
        normed = self.hidden_norm(context)
        cos, sin = self.rotary_emb(normed, positions)
        return [layer.self_attn.project_kv(normed, cos, sin) for layer in self.layers]

    def block_inputs(
        self, anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Token ids ``[N, B]`` (anchor, then mask tokens) and positions ``[N, B]`` (consecutive from the anchor's)."""
        slots = torch.arange(self.config.block_size, device=anchor_tokens.device)
        ids = torch.full(
            (anchor_tokens.shape[0], self.config.block_size),
            self.config.mask_token_id,
            dtype=torch.long,
            device=anchor_tokens.device,
        )
        ids[:, 0] = anchor_tokens
        return ids, anchor_positions[:, None] + slots[None]

    def block_hidden(
        self, block_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """The normed final hidden state of every slot ``[N, B, H]``."""
        hidden = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, bind_layer(attend, layer.layer_idx))
        return self.norm(hidden)

    def slot_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-vocab logits of slots' hidden states. ``prev_ids``: the verifier-vocab token before each slot's
        target (the anchor for the first draft slot, then each earlier slot's token); DFlash ignores it, DSpark's
        Markov head adds a bias from it."""
        return self.lm_head(hidden)

    def aux_outputs(
        self, hidden: torch.Tensor, prev_ids: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Heads trained beside the token head (DSpark's confidence); none for DFlash."""
        return {}

    def forward(
        self,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: AttendFn,
        prev_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Draft-vocab logits of every slot ``[N, B, Vd]``; ``attend`` supplies the context (module docstring)."""
        return self.slot_logits(self.block_hidden(block_ids, positions, attend), prev_ids)


__all__ = ["ContextKV", "DFlashDraftModel", "block_attention"]
