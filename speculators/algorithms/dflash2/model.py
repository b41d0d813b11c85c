"""The DFlash2 draft: DFlash (speculators/algorithms/dflash/model.py) with local dynamic convolutions around each
layer's attention and MLP, and a low-rank candidate selector that reranks each slot's top-k unary candidates.

The architecture is speculators 0.9.0's ``DFlash2DraftModel`` (what vLLM 0.32 serves as ``DFlash2DraftModel``);
the tensor names are its, so either loads the other's weights:

    layer i   x = input_layernorm(h);        x, k_out = attention_conv.prepare(x)
              h = h + attention_conv.finish(attn_i(x, context), k_out)
              x = post_attention_layernorm(h); x, k_out = mlp_conv.prepare(x)
              h = h + mlp_conv.finish(mlp(x), k_out)
    conv      kernels = kernel_projection(x) -> [2 (in, out), T taps, G groups] per slot (G = H / conv_group_size)
              y_s = sum_{t < T, t <= s} x_{s-t} * (base_kernel[side, t] + kernels[side, t, group])  (per channel)
              slot s reads slots s-t of ITS block only (s is the slot's index in the block)
    unary     u_s = lm_head(norm(h_s)) over the verifier vocabulary (a frozen copy of the verifier's head, as
              speculators 0.9.0 rebuilds it on load)
    selector  C_s = top-k ids of u_s (k = selector_top_k)
              score_s(c | p) = u_s[c] + < predecessor_codebook[p] * hidden_projection(norm(h_s)), successor_codebook[c] >
              p = the token before slot s's target (the anchor for the first draft slot, then the token drafted at
              the slot before; teacher forced in training)

The convolutions start as the identity (``base_kernel[:, 0] = 1``, the rest and ``kernel_projection`` zero): an
untrained DFlash2 backbone is a DFlash one. The context features enter attention unconvolved (only the block is).
Drafting walks the slots: each draft token is the selector's argmax among its slot's candidates given the token
drafted before it (vLLM's V2 speculator does the same walk; at T > 0 it samples from the softmax of those scores,
-inf outside the candidates, which is the ``q`` rejection sampling checks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speculators.algorithms.dflash.model import DFlashDraftModel
from speculators.algorithms.dflash2.config import DFlash2Config
from speculators.models.layers import BlockDecoderLayer, hf_layer_config


def grouped_dynamic_conv(
    hidden: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``hidden [N, S, H]`` (S slots of N blocks) convolved causally along the slots: tap t multiplies slot s - t
    (zero before the block's first slot) by ``base [T, H]`` plus the slot's own coefficient ``delta [N, S, T, G]``
    broadcast over each group of ``group_size`` channels."""
    blocks, slots, width = hidden.shape
    taps, groups = base.shape[0], width // group_size
    grouped = hidden.view(blocks, slots, groups, group_size)
    out = torch.zeros_like(grouped)
    for tap in range(min(taps, slots)):
        coefficient = base[tap].to(hidden.dtype).view(groups, group_size) + delta[:, :, tap, :, None]
        source = grouped if tap == 0 else F.pad(grouped[:, : slots - tap], (0, 0, 0, 0, tap, 0))
        out = out + source * coefficient
    return out.view(blocks, slots, width)


class GroupedDynamicConv(nn.Module):
    """The pair of convolutions around one sublayer: its input side and its output side, both driven by ONE
    projection of the sublayer's input (``kernel_projection``: H -> 2 * taps * groups)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden_size {hidden_size}")
        self.taps, self.group_size, self.groups = taps, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity on both sides (module docstring)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input and the output side's coefficients ``[N, S, T, G]``."""
        kernels = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.taps, self.groups)
        convolved = grouped_dynamic_conv(hidden, kernels[..., 0, :, :], self.base_kernel[0], self.group_size)
        return convolved, kernels[..., 1, :, :]

    def finish(self, hidden: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(hidden, delta, self.base_kernel[1], self.group_size)


class ConvBlockDecoderLayer(BlockDecoderLayer):
    """DFlash's decoder layer with a :class:`GroupedDynamicConv` around its attention and around its MLP."""

    def __init__(self, cfg, layer_idx: int, taps: int, group_size: int) -> None:
        super().__init__(cfg, layer_idx)
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, taps, group_size)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, taps, group_size)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        x, out_kernel = self.attention_conv.prepare(self.input_layernorm(hidden))
        hidden = hidden + self.attention_conv.finish(self.self_attn(x, cos, sin, attend), out_kernel)
        x, out_kernel = self.mlp_conv.prepare(self.post_attention_layernorm(hidden))
        return hidden + self.mlp_conv.finish(self.mlp(x), out_kernel)


class CandidateSelector(nn.Module):
    """Scores candidate tokens given the previous token and the slot's hidden state (module docstring)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, std: float = 0.02) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * std)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * std)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=std)

    def context(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """``[..., rank]``: the predecessor's code times the projected hidden state."""
        predecessor = self.predecessor_codebook[prev_ids]
        return predecessor * self.hidden_projection(hidden).to(predecessor.dtype)

    def forward(
        self,
        unary_logits: torch.Tensor,
        hidden: torch.Tensor,
        prev_ids: torch.Tensor,
        candidate_ids: torch.Tensor,
    ) -> torch.Tensor:
        """``[..., K]``: each candidate's unary logit plus its transition score from the slot's hidden state and
        previous token (one module call, so a sharded trainer gathers the codebooks for it)."""
        context = self.context(hidden, prev_ids)
        transition = (context.unsqueeze(-2) * self.successor_codebook[candidate_ids]).sum(-1)
        unary = unary_logits.gather(-1, candidate_ids)
        return unary + transition.to(unary.dtype)


def training_candidates(
    candidate_ids: torch.Tensor, target_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(candidates [..., K], target index [...], whether the unary top-k held the target [...])``: the unary
    top-k with a missing target put in place of the last (weakest) candidate, as speculators 0.9.0 trains it, so
    every slot has a K-way label."""
    top_k = candidate_ids.shape[-1]
    hits = candidate_ids == target_ids.unsqueeze(-1)
    held = hits.any(-1)
    index = torch.where(held, hits.long().argmax(-1), torch.full_like(target_ids, top_k - 1))
    candidates = candidate_ids.clone()
    candidates[..., -1] = torch.where(held, candidate_ids[..., -1], target_ids)
    return candidates, index, held


class DFlash2DraftModel(DFlashDraftModel):
    """A DFlash2 draft whose parameter names are exactly the checkpoint's (unprefixed)."""

    config_class = DFlash2Config

    def __init__(self, config: DFlash2Config) -> None:
        if not 1 <= config.selector_top_k <= config.vocab_size:
            raise ValueError(f"selector_top_k {config.selector_top_k} must be in [1, {config.vocab_size}]")
        if not 1 <= config.conv_kernel_size <= config.block_size:
            raise ValueError(
                f"conv_kernel_size {config.conv_kernel_size} must be in [1, block_size {config.block_size}]"
            )
        super().__init__(config)
        layer_cfg = hf_layer_config(config)  # DFlash's layers, rebuilt with their convolutions
        self.layers = nn.ModuleList(
            ConvBlockDecoderLayer(layer_cfg, i, config.conv_kernel_size, config.conv_group_size)
            for i in range(config.num_layers)
        )
        # the verifier's head, frozen: speculators 0.9.0 rebuilds a full-vocabulary head from the verifier on load
        self.lm_head.weight.requires_grad_(False)
        self.candidate_selector = CandidateSelector(
            config.vocab_size,
            config.hidden_size,
            config.selector_rank,
            config.selector_top_k,
            float(config.transformer_layer_config.get("initializer_range", 0.02)),
        )

    # ---- the selector ----------------------------------------------------------------------------------------
    def candidates(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's unary top-k ids and their selector scores, both ``[..., K]`` (``hidden``: normed slot
        states, ``prev_ids``: the token before each slot's target)."""
        unary = self.lm_head(hidden)
        ids = unary.topk(self.config.selector_top_k, dim=-1).indices
        return ids, self.candidate_selector(unary, hidden, prev_ids, ids)

    def selected_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """What the engine drafts from (``[..., V]``): the selector's scores on the slot's candidates, -inf
        elsewhere. Its argmax is the selector's choice; its tempered softmax the distribution a draw comes from."""
        ids, scores = self.candidates(hidden, prev_ids)
        full = scores.new_full((*scores.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.scatter(-1, ids, scores)

    def aux_outputs(
        self, hidden: torch.Tensor, prev_ids: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """What the selector reads beside the unary logits: the slots' hidden states and previous tokens (the
        training objective scores its candidates from them inside its own forward)."""
        if prev_ids is None:
            return {}
        return {"selector_hidden": hidden, "selector_prev": prev_ids}

    def selector_terms(
        self,
        unary_logits: torch.Tensor,
        hidden: torch.Tensor,
        prev_ids: torch.Tensor,
        target_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The selector's training terms per slot: ``chosen`` (its pick among the unary top-k given the previous
        token: what the engine drafts there, teacher forced) and, with ``target_ids`` (verifier ids),
        ``selector_ce`` (its K-way cross-entropy over the unary top-k with a missing target put in place of the
        last candidate: :func:`training_candidates`, speculators 0.9.0's loss)."""
        top = unary_logits.detach().topk(self.config.selector_top_k, dim=-1).indices
        served = self.candidate_selector(unary_logits, hidden, prev_ids, top)
        terms = {"chosen": top.gather(-1, served.detach().argmax(-1, keepdim=True))[..., 0]}
        if target_ids is not None:
            candidates, index, _ = training_candidates(top, target_ids)
            scores = self.candidate_selector(unary_logits, hidden, prev_ids, candidates).float()
            ce = F.cross_entropy(scores.flatten(0, -2), index.flatten(), reduction="none")
            terms["selector_ce"] = ce.view_as(index)
        return terms


__all__ = [
    "CandidateSelector",
    "ConvBlockDecoderLayer",
    "DFlash2DraftModel",
    "GroupedDynamicConv",
    "grouped_dynamic_conv",
    "training_candidates",
]
