"""LiLiCorr: DFlash's anchor blocks (train/objectives/dflash.py) plus the LiLiCorr head's transition loss.

The unary head (the verifier's, frozen: LiLiCorr reads the whole verifier vocabulary) is scored like DFlash's, soft
cross-entropy against the verifier per draft slot weighted by ``block.position_weighting``; the backbone learns
through it and through the head. Beside it, per slot, the head's cross-entropy of the correct next candidate among
the transitions of the lattice, teacher forced on the verifier's tokens: slot 0's start scores (anchor -> each
candidate), slot s's row of the candidate that holds the verifier's token at slot s - 1, the target being the
candidate that holds the verifier's token at slot s (its argmax; the top-k with a missing target put in place of
the last candidate, so every slot has a label, as DFlash2's selector is trained). Scores are the scaled cosine
logits vLLM walks (``lilicorr_logit_scale``). Weighted and normalised like the token loss and scaled by
``lilicorr.weight``. The head reads the backbone's states detached (``LiLiCorrDraftModel.lattice_terms``):
its loss trains the head only, the backbone learns from the token loss alone.

NVIDIA modelopt trains LiLiCorr (its PR #2342), but the facts we have (vLLM 0.32's module) fix the architecture and
the walk, not the objective: this transition cross-entropy is our choice, the natural one for a head whose output
is walked greedily row by row. The per-step hits and the simulated acceptance are the head's teacher-forced picks on
the served lattice (what the engine drafts), not the unary argmax. Its settings: the block drafters' ``block`` group
and its own ``lilicorr`` group (recipes/lilicorr/default.yaml).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from speculators.algorithms.lilicorr.config import LiLiCorrConfig
from speculators.algorithms.lilicorr.model import LiLiCorrDraftModel
from train.objectives import register
from train.objectives.dflash import AnchorBlockDraft, BlockSettings, CandidateHeadBlocks
from train.settings import at_least


@dataclass(frozen=True)
class LiLiCorrSettings:
    """``lilicorr``: the LiLiCorr head's shape, written as the config's ``lilicorr_<key>`` keys
    (speculators/algorithms/lilicorr/config.py), and the weight of its transition loss."""

    hidden_size: int = 0  # 0: the draft's hidden size
    candidate_topk: int = 8
    num_heads: int = 4
    mlp_ratio: float = 2.0
    factor_dim: int = 64
    vector_eps: float = 1e-6
    logit_scale: float = 16.0
    num_layers: int = 2
    weight: float = 1.0

    def problems(self, prefix: str) -> list[str]:
        found = at_least(f"{prefix}.hidden_size", self.hidden_size, 0)
        found += at_least(f"{prefix}.num_layers", self.num_layers, 0)
        found += at_least(f"{prefix}.weight", self.weight, 0)
        for key in ("candidate_topk", "num_heads", "factor_dim"):
            found += at_least(f"{prefix}.{key}", getattr(self, key), 1)
        for key in ("mlp_ratio", "vector_eps", "logit_scale"):
            if not getattr(self, key) > 0:
                found.append(f"{prefix}.{key}={getattr(self, key)} must be > 0")
        topk = self.candidate_topk
        if topk > 16 or topk & (topk - 1):
            found.append(f"{prefix}.candidate_topk={topk} must be a power of two <= 16 (vLLM refuses others)")
        return found


class LatticeAnchorBlockDraft(AnchorBlockDraft):
    """DFlash's blocks, then the head's terms scored inside the same forward (``target_ids [N, k]``: the verifier's
    argmax per draft slot, -1 where none), so the head's parameters are used by a module call. The head's anchor is
    each block's last context position (``cols``): its ``fc`` feature, as vLLM's anchor is the last confirmed one."""

    def forward(
        self, *blocks: Any, target_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits, extras = super().forward(*blocks)
        aux_hidden, rows, cols = blocks[1], blocks[4], blocks[5]
        anchor = self.draft.project_context(aux_hidden[rows, cols].to(self.draft.fc.weight.dtype))
        hidden = extras.pop("lattice_hidden")
        targets = None if target_ids is None else target_ids.clamp(min=0)
        extras.update(self.draft.lattice_terms(logits, hidden, anchor, targets))
        return logits, extras


@register
class LiLiCorrAnchorBlocks(CandidateHeadBlocks):
    """LiLiCorr's objective (module docstring)."""

    algorithms = ("lilicorr",)
    groups = {"block": BlockSettings, "lilicorr": LiLiCorrSettings}
    config_class = LiLiCorrConfig
    model_class = LiLiCorrDraftModel
    wrapper = LatticeAnchorBlockDraft
    head_ce_key = "lattice_ce"
    verifier_head_because = (
        "LiLiCorr's candidates come from the verifier's head (vLLM uses the target's), so the draft's is the "
        "verifier's, frozen"
    )

    def config_fields(self) -> dict[str, Any]:
        """The config's ``lilicorr_<key>`` keys: the ``lilicorr`` group but the loss weight."""
        fields = asdict(self.settings.group("lilicorr"))
        del fields["weight"]
        return {f"lilicorr_{key}": value for key, value in fields.items()}

    def head_weight(self) -> float:
        return self.settings.group("lilicorr").weight
