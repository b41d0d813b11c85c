"""DFlash2: DFlash's anchor blocks (train/objectives/dflash.py) plus the candidate selector's loss, as speculators
0.9.0 trains it.

The unary head (the verifier's, frozen: DFlash2 reads the whole verifier vocabulary) is scored like DFlash's, soft
cross-entropy against the verifier per draft slot weighted by ``block.position_weighting``; the layers' dynamic
convolutions learn through it. Beside it, per slot, the selector's K-way cross-entropy toward the verifier's argmax
over the unary top-k (K = ``dflash2.selector_top_k``), the target put in place of the last candidate when the
top-k misses it, each slot's predecessor the data token before its target (teacher forcing), weighted and
normalised like the token loss and scaled by ``dflash2.selector_weight`` (0.9.0's ``selector_loss_alpha``,
1.0). speculators 0.9.0 computes a TV term only as a metric, never in the loss: neither do we. The per-step hits
and the simulated acceptance are the selector's picks (what the engine drafts), not the unary argmax. Its settings:
the block drafters' ``block`` group and its own ``dflash2`` group (recipes/dflash2/default.yaml).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from speculators.algorithms.dflash2.config import DFlash2Config
from speculators.algorithms.dflash2.model import DFlash2DraftModel
from train.objectives import register
from train.objectives.dflash import AnchorBlockDraft, BlockSettings, CandidateHeadBlocks
from train.settings import at_least


@dataclass(frozen=True)
class DFlash2Settings:
    """``dflash2``: the local convolutions and the candidate selector of the draft (its config's fields), and the
    selector loss's weight; speculators 0.9.0's defaults (recipes/dflash2/default.yaml)."""

    conv_kernel_size: int = 2  # causal taps per convolution
    conv_group_size: int = 16  # hidden channels sharing one dynamic coefficient
    selector_rank: int = 256  # predecessor/successor codebooks [verifier vocab, rank]
    selector_top_k: int = 16  # unary candidates the selector reranks per slot
    selector_weight: float = 1.0  # the selector loss beside the token loss (0.9.0's selector_loss_alpha)

    def problems(self, prefix: str) -> list[str]:
        config = [n for n in asdict(self) if n != "selector_weight"]
        found = [p for name in config for p in at_least(f"{prefix}.{name}", getattr(self, name), 1)]
        return found + at_least(f"{prefix}.selector_weight", self.selector_weight, 0)


class SelectorAnchorBlockDraft(AnchorBlockDraft):
    """DFlash's blocks, then the selector's terms scored inside the same forward (``target_ids [N, k]``: the
    verifier's argmax per draft slot, -1 where none), so the selector's parameters are used by a module call."""

    def forward(
        self, *blocks: Any, target_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits, extras = super().forward(*blocks)
        hidden, prev = extras.pop("selector_hidden"), extras.pop("selector_prev")
        targets = None if target_ids is None else target_ids.clamp(min=0)
        extras.update(self.draft.selector_terms(logits, hidden, prev, targets))
        return logits, extras


@register
class DFlash2AnchorBlocks(CandidateHeadBlocks):
    """DFlash2's objective (module docstring)."""

    algorithms = ("dflash2",)
    groups = {"block": BlockSettings, "dflash2": DFlash2Settings}
    config_class = DFlash2Config
    model_class = DFlash2DraftModel
    wrapper = SelectorAnchorBlockDraft
    head_ce_key = "selector_ce"
    verifier_head_because = (
        "DFlash2's unary head is the verifier's, frozen (speculators 0.9.0 rebuilds it from the verifier on "
        "load)"
    )

    def config_fields(self) -> dict[str, Any]:
        """The config's fields of the ``dflash2`` group (all of it but the loss weight)."""
        fields = asdict(self.settings.group("dflash2"))
        del fields["selector_weight"]
        return fields

    def head_weight(self) -> float:
        return self.settings.group("dflash2").selector_weight
