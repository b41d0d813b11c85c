"""Drafting with LiLiCorr: DFlash's block drafter (speculators.algorithms.dflash.drafter), one backbone forward per
verify step, then ONE head forward over the lattice of every slot's top-k candidates, then a walk over the slots in
which each draft token is the best transition from the candidate drafted before it (the anchor's start scores for
the first slot), as vLLM's V2 LiLiCorr speculator walks them."""

from __future__ import annotations

from typing import Any

import torch

from speculators.algorithms.dflash.drafter import BlockDrafter
from speculators.decoding.segment import Segment


class LatticeBlockDrafter(BlockDrafter):
    """:class:`BlockDrafter` whose slots are read from the LiLiCorr lattice: at temperature 0 the argmax of the row
    of the candidate drafted before, else a draw from the softmax of the tempered row over the slot's candidates
    (the ``q`` that rejection sampling checks the draw against)."""

    anchor: tuple[torch.Tensor, torch.Tensor] | None = None

    def read_segment(self, segment: Segment) -> None:
        """DFlash's context cache, and the head's anchor: ``hidden_norm(fc(aux))`` at each row's last confirmed
        position (zero for a row that confirmed nothing, as vLLM's ``anchor_valid``)."""
        super().read_segment(segment)
        last = segment.last
        rows = torch.arange(last.shape[0], device=last.device)
        features = segment.features[rows, last].to(self.dtype)
        self.anchor = (
            self.draft.anchor_hidden(self.draft.project_context(features)),
            segment.valid[rows, last],
        )

    def reads_slots_in_turn(self) -> bool:
        return True  # every slot's row is the one of the candidate drafted before it

    def slot_inputs(self, hidden: torch.Tensor) -> list[Any]:
        """Per slot: the previous slot's candidates (None for the first), its own candidates ``[B, k]`` and its
        scaled rows ``[B, k, k]`` from one head forward over all slots."""
        assert self.anchor is not None, "read the segment before drafting"
        ids, log_probs = self.draft.candidates(hidden)
        rows = self.draft.lattice_scores(hidden, *self.anchor, ids, log_probs)
        return [(ids[:, s - 1] if s else None, ids[:, s], rows[:, s]) for s in range(hidden.shape[1])]

    def slot_logits(self, slot_input: Any, prev: torch.Tensor) -> torch.Tensor:
        """``[B, V]``: the row of the previous candidate (of ``prev``, the token drafted before) on this slot's
        candidates, -inf elsewhere."""
        before, ids, rows = slot_input
        index = torch.zeros_like(prev) if before is None else (before == prev[:, None]).long().argmax(-1)
        row = rows.gather(1, index[:, None, None].expand(-1, 1, rows.shape[-1]))[:, 0]
        full = row.new_full((row.shape[0], self.vocab_size), float("-inf"))
        return full.scatter(-1, ids, row)


__all__ = ["LatticeBlockDrafter"]
