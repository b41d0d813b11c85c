"""Drafting with an EAGLE-3 draft, fed exactly as vLLM feeds it.

Each round starts from a *segment*: the positions the verifier confirmed in the last step. For each such position t
the draft reads ``fc(aux states of the verifier at t)`` and token ``x_{t+1}`` at position t, so its KV cache for
confirmed positions is always computed from verifier features (the speculative entries of the previous round are
dropped). The output at the segment's last position proposes the first draft token; every later step feeds the
draft's own returned hidden state with the token just proposed, one position further on.

Chains propose k tokens (argmax, or sampled from the draft's tempered distribution, which then serves as ``q``).
Trees follow EAGLE-2: expand the top-k children of the ``topk`` best nodes per depth (cumulative log-probability),
then keep the ``budget`` best candidates overall; a child never outranks its parent, so the kept set is a tree.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.decoding.cache import DraftCache
from speculators.decoding.sampling import sample, target_probs
from speculators.decoding.segment import Segment
from speculators.decoding.tree import DraftTree, chain_tree


class Drafter:
    """Owns the draft's KV cache for one batch and turns confirmed segments into chains or trees."""

    supports_tree = True

    def __init__(self, draft: Eagle3DraftModel, batch: int, device: torch.device) -> None:
        self.draft = draft
        self.cache = DraftCache(draft.config.num_layers, batch, device, draft.config.layer_windows)
        self.dtype = next(draft.parameters()).dtype
        self.vocab_size = draft.config.vocab_size
        self.target_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=device))
        self.seconds = 0.0  # time inside draft forwards (for the bench's bound)
        self.forwards = 0

    # ---- what the engine asks before decoding --------------------------------------------------------------
    @staticmethod
    def max_k(config: Any) -> int | None:
        """No limit: every step is one more forward."""
        return None

    @staticmethod
    def default_k(config: Any) -> int:
        """The chain length ``speculators eval`` runs when none is given (what vLLM's EAGLE-3 examples use)."""
        return 3

    # ---- model calls ---------------------------------------------------------------------------------------
    def _forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        valid_new: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        attend = self.cache.attend_fn(visible, valid_new, self.dtype, positions)
        logits, hidden = self.draft(tokens, hidden, positions, attend=attend)
        self.seconds += time.perf_counter() - start
        self.forwards += 1
        return logits, hidden

    def read_segment(self, segment: Segment) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward the confirmed segment and commit it. Returns the draft logits and hidden state at each row's
        last valid column, and that column's position."""
        batch, width = segment.tokens.shape
        device = segment.tokens.device
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        # holes see themselves, so no attention row is empty
        local = (causal[None] & segment.valid[:, None, :]) | torch.eye(
            width, dtype=torch.bool, device=device
        )[None]
        cached = self.cache.valid[:, None, :].expand(batch, width, self.cache.length)
        hidden = self.draft.project_features(segment.features.to(self.dtype))
        logits, hidden = self._forward(
            segment.tokens, hidden, segment.positions, torch.cat([cached, local], dim=-1), segment.valid
        )
        self.cache.commit()
        last = segment.last
        rows = torch.arange(batch, device=device)
        return logits[rows, last], hidden[rows, last], segment.positions[rows, last]

    def step(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, spec_visible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One speculative forward of ``Q`` nodes per row; ``spec_visible[B, Q, S + Q]`` covers the speculative
        columns (earlier ones, then the new ones); all committed valid columns are visible."""
        batch, queries = tokens.shape
        committed = self.cache.valid[:, None, : self.cache.committed].expand(
            batch, queries, self.cache.committed
        )
        visible = torch.cat([committed, spec_visible], dim=-1)
        valid_new = torch.ones(batch, queries, dtype=torch.bool, device=tokens.device)
        return self._forward(tokens, hidden, positions, visible, valid_new)

    # ---- proposals -----------------------------------------------------------------------------------------
    def chain(
        self,
        segment: Segment,
        root: torch.Tensor,
        k: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> DraftTree:
        """``k`` tokens, one per step: argmax at temperature 0, else sampled from ``q`` (kept for verification)."""
        logits, hidden, position = self.read_segment(segment)
        batch = root.shape[0]
        drafted, proposals = [], []
        for step in range(k):
            if temperature > 0:
                q_draft = target_probs(logits, temperature, top_p)
                choice = sample(q_draft, generator)
                q = q_draft.new_zeros(batch, self.vocab_size)
                q[:, self.target_ids] = q_draft
                proposals.append(q)
            else:
                choice = logits.argmax(dim=-1)
            token = self.target_ids[choice]
            drafted.append(token)
            if step + 1 < k:
                spec = torch.ones(batch, 1, step + 1, dtype=torch.bool, device=root.device)
                out_logits, out_hidden = self.step(
                    token[:, None], hidden[:, None], (position + step + 1)[:, None], spec
                )
                logits, hidden = out_logits[:, 0], out_hidden[:, 0]
        self.cache.rollback()
        stacked = torch.stack(proposals, dim=1) if proposals else None
        return chain_tree(root, torch.stack(drafted, dim=1), stacked)

    def tree(self, segment: Segment, root: torch.Tensor, topk: int, depth: int, budget: int) -> DraftTree:
        """EAGLE-2 dynamic tree with at most ``budget`` drafted tokens and ``depth`` levels."""
        logits, hidden, position = self.read_segment(segment)
        batch, device = root.shape[0], root.device
        topk = min(topk, logits.shape[-1])
        scores, ids = top_k(torch.log_softmax(logits.float(), dim=-1), topk)  # [B, K]
        cand_tokens, cand_scores = [self.target_ids[ids]], [scores]
        cand_parents = [torch.full((batch, topk), -1, dtype=torch.long, device=device)]
        cand_depths = [torch.ones(batch, topk, dtype=torch.long, device=device)]
        level_index = torch.arange(topk, device=device).expand(batch, topk)  # candidate ids of the frontier
        level_tokens, level_scores = self.target_ids[ids], scores
        level_hidden = hidden[:, None].expand(batch, topk, hidden.shape[-1])
        level_visible = torch.zeros(batch, topk, 0, dtype=torch.bool, device=device)
        eye = torch.eye(topk, dtype=torch.bool, device=device).expand(batch, topk, topk)
        num_candidates = topk
        for level in range(1, depth):
            visible = torch.cat([level_visible, eye], dim=-1)
            positions = (position + level)[:, None].expand(batch, topk)
            out_logits, out_hidden = self.step(level_tokens, level_hidden, positions, visible)
            child_scores, child_ids = top_k(torch.log_softmax(out_logits.float(), dim=-1), topk)  # [B, K, K]
            child_scores = (level_scores[:, :, None] + child_scores.clamp(max=0.0)).flatten(1)
            child_tokens = self.target_ids[child_ids].flatten(1)
            child_parent_slot = torch.arange(topk, device=device).repeat_interleave(topk).expand(batch, -1)
            cand_tokens.append(child_tokens)
            cand_scores.append(child_scores)
            cand_parents.append(level_index.gather(1, child_parent_slot))
            cand_depths.append(torch.full_like(child_tokens, level + 1))
            if level + 1 < depth:
                best_scores, best = top_k(child_scores, topk)
                slot = child_parent_slot.gather(1, best)
                level_index = num_candidates + best
                level_tokens, level_scores = child_tokens.gather(1, best), best_scores
                level_hidden = out_hidden.gather(1, slot[:, :, None].expand(-1, -1, out_hidden.shape[-1]))
                level_visible = visible.gather(1, slot[:, :, None].expand(-1, -1, visible.shape[-1]))
            num_candidates += topk * topk
        self.cache.rollback()
        candidates = [torch.cat(c, dim=1) for c in (cand_tokens, cand_scores, cand_parents, cand_depths)]
        return _select_tree(root, *candidates, budget=budget)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.select_rows(rows)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk`` over the last dim with ties broken towards the lower index, like ``argmax``.

    ``torch.topk`` leaves the order (and, at the boundary, the choice) among equal values unspecified; ties are real
    with low-precision logits and with degenerate test drafts, and trees must not depend on the platform. Rows
    whose k-th value is tied with a value left out fall back to a stable sort; the rest pay one comparison pass.
    """
    values, indices = x.topk(k, dim=-1)
    boundary = values[..., -1:]
    clean = (x == boundary).sum(-1) == (values == boundary).sum(-1)
    if not bool(clean.all()):
        order = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
        indices = torch.where(clean[..., None], indices, order)
        values = x.gather(-1, indices)
    order = torch.sort(indices, dim=-1).indices  # lower index first among equal values
    indices, values = indices.gather(-1, order), values.gather(-1, order)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return values.gather(-1, order), indices.gather(-1, order)


def _select_tree(
    root: torch.Tensor,
    tokens: torch.Tensor,
    scores: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    budget: int,
) -> DraftTree:
    """Keep the ``budget`` best candidates. Candidates are stored in depth order and a stable sort on the score
    keeps that order among ties, so a parent (score ≥ its child's) always ranks before its children."""
    batch, count = tokens.shape
    budget = min(budget, count)
    device = tokens.device
    order = torch.sort(-scores, dim=1, stable=True).indices[
        :, :budget
    ]  # [B, budget] candidate ids, best first
    node_of = torch.full((batch, count), -1, dtype=torch.long, device=device)
    node_of.scatter_(1, order, torch.arange(1, budget + 1, device=device).expand(batch, budget))
    cand_parent = parents.gather(1, order)
    parent_node = torch.where(cand_parent < 0, 0, node_of.gather(1, cand_parent.clamp(min=0)))
    if bool((parent_node < 0).any()):
        raise RuntimeError(
            "tree selection kept a node without its parent (scores must not increase with depth)"
        )
    zero = torch.zeros(batch, 1, dtype=torch.long, device=device)
    full_parents = torch.cat([zero - 1, parent_node], dim=1)
    depth = torch.cat([zero, depths.gather(1, order)], dim=1)
    return DraftTree(
        tokens=torch.cat([root[:, None], tokens.gather(1, order)], dim=1), parents=full_parents, depths=depth
    )
