"""Drafting with a P-EAGLE draft: K tokens from ONE forward, fed exactly as vLLM's parallel drafting feeds it.

The round's forward reads the confirmed segment as EAGLE-3 does (token x_{t+1} with ``fc(aux(t))`` at every
confirmed position t; these entries are committed to the draft's KV cache) and, in the same forward, K-1 mask
slots at the positions after the segment's last one (``mask_token_id`` with ``fc(mask_hidden)``; speculative
entries, dropped after the round). Causal attention: a slot sees every committed position and the slots before it.
The segment's last position proposes draft token 0, mask slot d proposes token d. No drafted token is fed back,
so sampling each slot from its own distribution gives exactly the ``q`` that lossless verification needs.

Trees are not drafted: the slots of one forward form a single chain (what vLLM runs, too).
"""

from __future__ import annotations

from typing import Any

import torch

from speculators.algorithms.eagle3.drafter import Drafter
from speculators.algorithms.peagle.model import PEagleDraftModel
from speculators.decoding.sampling import sample, target_probs
from speculators.decoding.segment import Segment
from speculators.decoding.tree import DraftTree, chain_tree


class ParallelDrafter(Drafter):
    """A :class:`Drafter` whose chains take one draft forward (the draft must be a :class:`PEagleDraftModel`)."""

    draft: PEagleDraftModel
    supports_tree = False

    @staticmethod
    def default_k(config: Any) -> int:
        """The K depths the draft was trained for (its ``speculative_tokens``)."""
        return int(config.speculators_config.speculative_tokens)

    def chain(
        self,
        segment: Segment,
        root: torch.Tensor,
        k: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> DraftTree:
        """``k`` tokens from one forward over ``segment ++ k-1 mask slots`` (module docstring)."""
        batch, width = segment.tokens.shape
        device, slots = segment.tokens.device, k - 1
        rows = torch.arange(batch, device=device)
        last = segment.last
        features = self.draft.project_features(segment.features.to(self.dtype))
        mask_ids, mask_features = self.draft.mask_slots((batch, slots), features)
        offsets = torch.arange(1, slots + 1, device=device)
        positions = torch.cat([segment.positions, segment.positions[rows, last][:, None] + offsets], dim=1)
        valid = torch.cat([segment.valid, torch.ones(batch, slots, dtype=torch.bool, device=device)], dim=1)
        total = width + slots
        causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
        # holes (invalid segment columns) see themselves only, so no attention row is empty
        local = (causal[None] & valid[:, None, :]) | torch.eye(total, dtype=torch.bool, device=device)[None]
        cached = self.cache.valid[:, None, :].expand(batch, total, self.cache.length)
        logits, _ = self._forward(
            torch.cat([segment.tokens, mask_ids], dim=1),
            torch.cat([features, mask_features], dim=1),
            positions,
            torch.cat([cached, local], dim=-1),
            valid,
        )
        self.cache.commit(self.cache.length - slots)  # the segment is confirmed, the mask slots are not
        self.cache.rollback()
        slot_logits = torch.cat([logits[rows, last][:, None], logits[:, width:]], dim=1)  # [B, k, Vd]
        if temperature > 0:
            q_draft = target_probs(slot_logits, temperature, top_p)
            choice = torch.stack([sample(q_draft[:, d], generator) for d in range(k)], dim=1)
            proposals = q_draft.new_zeros(batch, k, self.vocab_size)
            proposals[:, :, self.target_ids] = q_draft
            return chain_tree(root, self.target_ids[choice], proposals)
        return chain_tree(root, self.target_ids[slot_logits.argmax(dim=-1)])

    def tree(self, segment: Segment, root: torch.Tensor, topk: int, depth: int, budget: int) -> DraftTree:
        raise ValueError(
            "a P-EAGLE draft proposes one chain per forward; decode it with method='chain' (vLLM does the same)"
        )


__all__ = ["ParallelDrafter"]
