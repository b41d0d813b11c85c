"""Drafting with DFlash2: DFlash's block drafter (speculators.algorithms.dflash.drafter), one backbone forward per
verify step, then a walk over the slots in which each draft token is the candidate selector's pick given the token
drafted before it (the root for the first slot), as vLLM's V2 DFlash2 speculator walks them."""

from __future__ import annotations

import torch

from speculators.algorithms.dflash.drafter import BlockDrafter


class SelectorBlockDrafter(BlockDrafter):
    """:class:`BlockDrafter` whose slots are read through the draft's ``selected_logits``: at temperature 0 the
    selector's argmax among the slot's unary top-k, else a draw from the softmax of the tempered selector scores
    over those candidates (the ``q`` that rejection sampling checks the draw against)."""

    def reads_slots_in_turn(self) -> bool:
        return True  # every slot's selector reads the token drafted before it

    def slot_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.draft.selected_logits(hidden, prev)


__all__ = ["SelectorBlockDrafter"]
