"""The LiLiCorr draft: DFlash's backbone (speculators/algorithms/dflash/model.py) and the LiLiCorr head, a small
transformer over the lattice of every draft slot's top-k candidates that scores the transitions between the
candidates of adjacent slots. The tensor names are vLLM 0.32's (``lilicorr.*``, its ``LiLiCorrHead``), so vLLM
loads our weights as they are:

    candidates  C_s = top-k of log_softmax(lm_head(h_s)) (k = lilicorr_candidate_topk, best first), h_s the normed
                final state of draft slot s; lp_s = their log-probabilities over the whole verifier vocabulary
    features    f = [lp, exp(lp), lp - max(lp), rank / (k - 1), rank == 0]   (5 per candidate)
    lattice     x[s, r] = token_proj(embed(C_s[r])) + pass_hidden_proj(h_s) + feature_mlp(feature_norm(f))
                          + slot_embedding[s] + rank_embedding[r]
                n layers: x += attn(attn_norm(x), bias); x += mlp(mlp_norm(x)) over all (slot, rank) cells, with a
                learned additive bias per head: relative_slot_bias[slot(q) - slot(k) + B - 1] + same_slot_bias
    anchor      a = anchor_norm(context_proj(hidden_norm(fc(aux states of the last confirmed position))))
    factors     g = silu(factor_input_proj([output_norm(x), a, output_norm(x) * a]))
                out = normalize(out_head(g)), in = normalize(in_head(g)), a_out = normalize(anchor_out_head(a))
    scores      start[j] = scale * <a_out, in[0, j]>;  pair[s, i, j] = scale * <out[s, i], in[s + 1, j]>

Drafting walks the lattice greedily: slot 0 takes argmax_j start[j], slot s + 1 argmax_j pair[s, i_s, j] from the
candidate i_s taken at slot s (vLLM's V2 speculator walks the same rows; at T > 0 it draws from the softmax of the
row, -inf outside the candidates, the ``q`` rejection sampling checks). Candidates come from the verifier's head
(a frozen copy, as vLLM uses the target's) and are embedded by the verifier's embedding (ours is that copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speculators.algorithms.dflash.model import DFlashDraftModel
from speculators.algorithms.lilicorr.config import LiLiCorrConfig

CANDIDATE_FEATURES = 5  # log-prob, prob, log-prob below the best, rank fraction, is-best


class LiLiCorrMLP(nn.Module):
    """``down_proj(silu(up_proj(x)))``, both biased (vLLM builds it as a non-gated NemotronHMLP)."""

    def __init__(self, width: int, inner: int, out: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(width, inner)
        self.down_proj = nn.Linear(inner, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeAttention(nn.Module):
    """Full attention over the lattice cells with an additive per-head bias (no mask: every cell sees every cell)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if heads < 1 or width % heads:
            raise ValueError(f"lilicorr_num_heads {heads} must divide the head's width {width}")
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        batch, cells, width = x.shape
        q, k, v = (
            t.view(batch, cells, self.heads, -1).transpose(1, 2)
            for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(batch, cells, width))


class LatticeLayer(nn.Module):
    """One pre-norm layer of the lattice transformer."""

    def __init__(self, width: int, heads: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(width, eps=eps)
        self.attn = LatticeAttention(width, heads)
        self.mlp_norm = nn.RMSNorm(width, eps=eps)
        self.mlp = LiLiCorrMLP(width, int(width * mlp_ratio), width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    """The candidate-lattice correlator (module docstring); ``lattice`` returns the unscaled start and pair scores,
    ``forward`` vLLM's stacked rows."""

    def __init__(self, config: LiLiCorrConfig, eps: float) -> None:
        super().__init__()
        model_width, width = config.hidden_size, config.head_hidden_size
        slots, topk, heads = config.block_size - 1, config.lilicorr_candidate_topk, config.lilicorr_num_heads
        self.block_size, self.topk, self.width = config.block_size, topk, width
        self.eps_vector, self.logit_scale = config.lilicorr_vector_eps, config.lilicorr_logit_scale
        # vLLM builds token_proj only when the widths differ (an identity otherwise)
        self.token_proj = nn.Linear(model_width, width) if width != model_width else nn.Identity()
        self.pass_hidden_proj = nn.Linear(model_width, width)
        self.feature_norm = nn.LayerNorm(CANDIDATE_FEATURES)
        self.feature_mlp = LiLiCorrMLP(CANDIDATE_FEATURES, width, width)
        self.slot_embedding = nn.Parameter(torch.randn(1, 1, slots, 1, width) * 0.02)
        self.rank_embedding = nn.Parameter(torch.randn(1, 1, 1, topk, width) * 0.02)
        self.relative_slot_bias = nn.Parameter(torch.zeros(heads, 2 * config.block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(heads))
        self.context_proj = nn.Linear(model_width, width)
        self.layers = nn.ModuleList(
            LatticeLayer(width, heads, config.lilicorr_mlp_ratio, eps)
            for _ in range(config.lilicorr_num_layers)
        )
        self.output_norm = nn.RMSNorm(width, eps=eps)
        self.anchor_norm = nn.RMSNorm(width, eps=eps)
        self.factor_input_proj = nn.Linear(3 * width, width)
        self.out_head = nn.Linear(width, config.lilicorr_factor_dim)
        self.in_head = nn.Linear(width, config.lilicorr_factor_dim)
        self.anchor_out_head = nn.Linear(width, config.lilicorr_factor_dim)

    def attention_bias(self, slots: int) -> torch.Tensor:
        """``[heads, slots * k, slots * k]``: the learned bias between the cells of ``slots`` slots (offsets are
        the trained block's, so a shorter draft reads the same weights)."""
        slot_of = torch.arange(slots, device=self.same_slot_bias.device).repeat_interleave(self.topk)
        distance = slot_of[:, None] - slot_of[None, :]
        bias = self.relative_slot_bias[:, distance + self.block_size - 1]
        return bias + (distance == 0).to(bias.dtype) * self.same_slot_bias[:, None, None]

    def features(self, log_probs: torch.Tensor) -> torch.Tensor:
        """``[N, S, k, 5]`` per-candidate features of best-first log-probabilities ``[N, S, k]``."""
        lp = log_probs.float()
        rank = torch.arange(self.topk, device=lp.device, dtype=torch.float32)
        frac = rank / (self.topk - 1) if self.topk > 1 else torch.zeros_like(rank)
        return torch.stack(
            [
                lp,
                lp.exp(),
                lp - lp.max(-1, keepdim=True).values,
                frac.expand_as(lp),
                (rank == 0).float().expand_as(lp),
            ],
            dim=-1,
        )

    def lattice(
        self,
        token_embeddings: torch.Tensor,
        log_probs: torch.Tensor,
        pass_hidden: torch.Tensor,
        anchor_hidden: torch.Tensor,
        anchor_valid: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscaled ``start [N, k]`` and ``pair [N, S - 1, k, k]`` cosine scores of the candidates of ``S`` slots
        (``token_embeddings [N, S, k, H]``, ``log_probs [N, S, k]``, ``pass_hidden [N, S, H]``, ``anchor_hidden
        [N, H]``, ``anchor_valid [N]`` bool)."""
        batch, slots, topk = log_probs.shape
        if not 1 <= slots < self.block_size or topk != self.topk:
            raise ValueError(
                f"LiLiCorr scores 1..{self.block_size - 1} slots of {self.topk} candidates, got {slots}x{topk}"
            )
        dtype = self.pass_hidden_proj.weight.dtype
        x = self.token_proj(token_embeddings.to(dtype)) + self.pass_hidden_proj(
            pass_hidden.to(dtype)
        ).unsqueeze(-2)
        x = x + self.feature_mlp(self.feature_norm(self.features(log_probs).to(dtype)))
        x = x + self.slot_embedding[:, 0, :slots] + self.rank_embedding[:, 0]
        x = x.reshape(batch, slots * topk, self.width)
        bias = self.attention_bias(slots)[None]
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).view(batch, slots, topk, self.width)
        anchor = self.context_proj(anchor_hidden.to(dtype)) * anchor_valid[:, None].to(dtype)
        anchor = self.anchor_norm(anchor)
        row = anchor[:, None, None, :]
        factors = F.silu(self.factor_input_proj(torch.cat([x, row.expand_as(x), x * row], dim=-1)))
        out_vec = F.normalize(self.out_head(factors), dim=-1, eps=self.eps_vector)
        in_vec = F.normalize(self.in_head(factors), dim=-1, eps=self.eps_vector)
        anchor_out = F.normalize(self.anchor_out_head(anchor), dim=-1, eps=self.eps_vector)
        start = (anchor_out[:, None, :] * in_vec[:, 0]).sum(-1)
        return start, out_vec[:, :-1] @ in_vec[:, 1:].transpose(-1, -2)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """vLLM's rows ``[N, S, k, k]`` (``lattice``'s inputs): row ``[s, i]`` scores slot ``s``'s candidates after
        candidate ``i`` of slot ``s - 1``; slot 0's rows are all the start scores."""
        start, pairs = self.lattice(*inputs)
        first = start[:, None, None, :].expand(-1, 1, self.topk, -1)
        return self.logit_scale * torch.cat([first, pairs], dim=1).float()


class LiLiCorrDraftModel(DFlashDraftModel):
    """A LiLiCorr draft whose parameter names are exactly the checkpoint's (unprefixed)."""

    config_class = LiLiCorrConfig

    def __init__(self, config: LiLiCorrConfig) -> None:
        topk = config.lilicorr_candidate_topk
        if not 1 <= topk <= min(16, config.vocab_size) or topk & (topk - 1):
            raise ValueError(
                f"lilicorr_candidate_topk {topk} must be a power of two <= 16 (vLLM refuses others)"
            )
        if not config.lilicorr_enabled:
            raise ValueError(
                "lilicorr_enabled is false: vLLM refuses such a LiLiCorr checkpoint; set it true"
            )
        super().__init__(config)
        # the verifier's head, frozen: vLLM draws the candidates from the target's head
        self.lm_head.weight.requires_grad_(False)
        eps = float(config.transformer_layer_config.get("rms_norm_eps", 1e-6))
        self.lilicorr = LiLiCorrHead(config, eps)

    # ---- the lattice ----------------------------------------------------------------------------------------
    def candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's top-k verifier ids and their full-vocabulary log-probabilities, best first, ``[..., k]``
        (vLLM's ``get_top_k_tokens(..., return_log_probs=True)``)."""
        log_probs = torch.log_softmax(self.lm_head(hidden).float(), dim=-1)
        values, ids = log_probs.topk(self.config.lilicorr_candidate_topk, dim=-1)
        return ids, values

    def anchor_hidden(self, context: torch.Tensor) -> torch.Tensor:
        """The head's anchor input: ``hidden_norm`` of the last confirmed position's context feature ``fc(aux)``
        (vLLM's ``prepare_context_anchor``)."""
        return self.hidden_norm(context)

    def lattice_scores(
        self, hidden: torch.Tensor, anchor: torch.Tensor, anchor_valid: torch.Tensor, ids: torch.Tensor,
        log_probs: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """vLLM's scaled rows ``[N, S, k, k]`` of the candidates ``ids`` (``hidden``: the slots' normed states)."""
        return self.lilicorr(self.embed_tokens(ids), log_probs, hidden, anchor, anchor_valid)

    # ---- training ---------------------------------------------------------------------------------------------
    def aux_outputs(
        self, hidden: torch.Tensor, prev_ids: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """What the head reads beside the unary logits: the slots' normed states (the training objective scores
        the lattice from them inside its own forward)."""
        return {} if prev_ids is None else {"lattice_hidden": hidden}

    def lattice_terms(
        self,
        unary_logits: torch.Tensor,
        hidden: torch.Tensor,
        anchor_context: torch.Tensor,
        target_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The head's training terms of ``S`` slots (``unary_logits [N, S, V]``, ``hidden [N, S, H]`` their normed
        states, ``anchor_context [N, H]`` the anchor's ``fc`` feature): ``chosen [N, S]``, what the engine drafts
        at each slot on the served lattice given the verifier's token before it (teacher forced), and with
        ``target_ids [N, S]`` (verifier ids) ``lattice_ce [N, S]``: the cross-entropy of the target among the
        transitions from the previous target (the start scores for slot 0), on the lattice whose top-k has the
        target put in place of its last candidate where it missed it (every slot gets a label). The inputs are
        detached: the head's loss trains the head only."""
        from speculators.algorithms.dflash2.model import training_candidates

        # the head learns on the backbone's states as they are; the backbone learns from the token loss alone (a
        # head loss flowing into it slowed the backbone's fit: measured, tests/conformance/units.py)
        unary_logits, hidden, anchor_context = unary_logits.detach(), hidden.detach(), anchor_context.detach()
        anchor = self.anchor_hidden(anchor_context)
        valid = torch.ones(anchor.shape[0], dtype=torch.bool, device=anchor.device)
        log_partition = torch.logsumexp(unary_logits.float(), dim=-1, keepdim=True)
        ids = unary_logits.detach().topk(self.config.lilicorr_candidate_topk, dim=-1).indices
        with torch.no_grad():
            served = self.lattice_scores(
                hidden, anchor, valid, ids, unary_logits.float().gather(-1, ids) - log_partition
            )
        if target_ids is None:  # the engine's free walk
            return {"chosen": ids.gather(-1, walk(served)[..., None])[..., 0]}
        previous = torch.zeros_like(
            ids[..., 0]
        )  # the verifier's previous token among the previous candidates
        previous[:, 1:] = (ids[:, :-1] == target_ids[:, :-1, None]).long().argmax(-1)
        picked = served.gather(2, previous[..., None, None].expand(-1, -1, 1, ids.shape[-1]))[:, :, 0].argmax(
            -1
        )
        terms = {"chosen": ids.gather(-1, picked[..., None])[..., 0]}
        candidates, index, _ = training_candidates(ids, target_ids)
        log_probs = unary_logits.float().gather(-1, candidates) - log_partition
        rows = self.lattice_scores(hidden, anchor, valid, candidates, log_probs)
        before = torch.cat([torch.zeros_like(index[:, :1]), index[:, :-1]], dim=1)
        row = rows.gather(2, before[..., None, None].expand(-1, -1, 1, rows.shape[-1]))[:, :, 0]
        ce = F.cross_entropy(row.flatten(0, 1), index.flatten(), reduction="none")
        terms["lattice_ce"] = ce.view_as(index)
        return terms


def walk(rows: torch.Tensor) -> torch.Tensor:
    """The greedy path ``[N, S]`` (candidate indices) through scaled rows ``[N, S, k, k]``: slot 0 from row 0,
    then each slot from the row of the index taken before it (vLLM's walk at temperature 0)."""
    index = torch.zeros(rows.shape[0], dtype=torch.long, device=rows.device)
    path = []
    for slot in range(rows.shape[1]):
        row = rows[:, slot].gather(1, index[:, None, None].expand(-1, 1, rows.shape[-1]))[:, 0]
        index = row.argmax(-1)
        path.append(index)
    return torch.stack(path, dim=1)


__all__ = ["LiLiCorrDraftModel", "LiLiCorrHead", "walk"]
