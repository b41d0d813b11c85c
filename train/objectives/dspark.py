"""DSpark: DFlash's anchor blocks (train/objectives/dflash.py) with DSpark's two extra heads.

The Markov head reads each slot's previous data token (teacher forcing, as the block wrapper feeds it) at rank
``dspark.markov_rank``; the confidence head learns each slot's agreement with the verifier, ``1 - TV(draft,
verifier)``, with a binary cross-entropy weighted and normalised per slot like the token loss and scaled by
``dspark.confidence_weight``. Its settings: the block drafters' ``block`` group and its own ``dspark`` group
(recipes/dspark/default.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from speculators.algorithms.dspark.config import DSparkConfig
from speculators.algorithms.dspark.model import DSparkDraftModel
from train.objectives import register
from train.objectives.dflash import AnchorBlocks, BlockSettings, BlockTerms
from train.settings import at_least


@dataclass(frozen=True)
class DSparkSettings:
    """``dspark``: the Markov head's rank and the confidence loss's weight (recipes/dspark/default.yaml)."""

    markov_rank: int = 256  # markov_w1 [verifier vocab, r], markov_w2 [draft vocab, r]
    confidence_weight: float = 1.0  # the confidence BCE beside the token loss

    def problems(self, prefix: str) -> list[str]:
        return at_least(f"{prefix}.markov_rank", self.markov_rank, 1) + at_least(
            f"{prefix}.confidence_weight", self.confidence_weight, 0
        )


@register
class DSparkAnchorBlocks(AnchorBlocks):
    """DSpark's objective (module docstring)."""

    algorithms = ("dspark",)
    groups = {"block": BlockSettings, "dspark": DSparkSettings}
    config_class = DSparkConfig
    model_class = DSparkDraftModel

    def config_fields(self) -> dict[str, Any]:
        return {"markov_rank": self.settings.group("dspark").markov_rank}

    def extra_loss(
        self, out: BlockTerms, weights: torch.Tensor, mask: torch.Tensor, norm: torch.Tensor
    ) -> torch.Tensor:
        """The confidence head's BCE toward each slot's agreement with the verifier."""
        confidence = out.extras["confidence"][:, : self.steps].float()
        bce = F.binary_cross_entropy_with_logits(confidence, out.agreement, reduction="none")
        return self.settings.group("dspark").confidence_weight * (weights * bce * mask / norm).sum()
