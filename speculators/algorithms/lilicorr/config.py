"""Typed ``config.json`` of a LiLiCorr draft: DFlash's (speculators.algorithms.dflash.config) plus the keys of the
LiLiCorr head, the candidate-lattice correlator vLLM 0.32 serves as ``LiLiCorrDraftModel``.

The speculators format (vLLM 0.32's reader, speculators 0.9.0) knows no ``lilicorr`` type: vLLM's LiLiCorr loader
reads a DFlash-shaped checkpoint whose ``dflash_config`` carries the head's keys. So the export writes both: our own
top-level keys (what our loader, validator and engine read, under ``speculators_model_type: lilicorr``) and the
``dflash_config`` block vLLM's module reads (``mask_token_id``, ``target_layer_ids`` = aux ids - 1, ``causal``,
``block_size`` and every ``lilicorr_*`` key), regenerated from the fields on every save so the two never disagree.

Like DFlash2 the head reads the verifier's whole vocabulary (its candidates are verifier ids embedded by the
verifier's embedding; vLLM refuses a draft-to-target map for it), so a reduced vocabulary is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from speculators.algorithms.dflash.config import DFlashConfig

ARCHITECTURE = "LiLiCorrDraftModel"  # what vLLM 0.32's registry maps to its LiLiCorr model
# the head's keys, as vLLM's LiLiCorrHead reads them from dflash_config
HEAD_KEYS = (
    "lilicorr_hidden_size",
    "lilicorr_candidate_topk",
    "lilicorr_num_heads",
    "lilicorr_mlp_ratio",
    "lilicorr_factor_dim",
    "lilicorr_vector_eps",
    "lilicorr_logit_scale",
    "lilicorr_num_layers",
)


@dataclass
class LiLiCorrConfig(DFlashConfig):
    """config.json of a LiLiCorr draft (``speculators_model_type: lilicorr``, module docstring)."""

    SPECULATORS_MODEL_TYPE: ClassVar[str] = "lilicorr"
    ARCHITECTURE: ClassVar[str] = ARCHITECTURE
    FULL_VOCABULARY: ClassVar[tuple[str, str] | None] = (
        "LiLiCorr",
        "its candidates are verifier ids; vLLM 0.32 refuses a draft-to-target map for it",
    )
    sliding_window_non_causal: bool = True  # a bidirectional block, as DFlash2's
    lilicorr_enabled: bool = True  # vLLM refuses a LiLiCorr checkpoint with it false
    lilicorr_hidden_size: int = (
        0  # the head's width; 0: the draft's hidden size (vLLM reads ``or hidden_size``)
    )
    lilicorr_candidate_topk: int = 8  # candidates per slot: a power of two <= 16 (vLLM refuses others)
    lilicorr_num_heads: int = 4  # heads of the lattice attention (must divide the head's width)
    lilicorr_mlp_ratio: float = 2.0  # the head layers' MLP width over the head's width
    lilicorr_factor_dim: int = (
        64  # width of the outgoing/incoming vectors whose dot product scores a transition
    )
    lilicorr_vector_eps: float = 1e-6  # eps of the vectors' L2 normalisation
    lilicorr_logit_scale: float = 16.0  # the normalised dot products times this are the transition logits
    lilicorr_num_layers: int = 2  # lattice transformer layers

    @property
    def head_hidden_size(self) -> int:
        """The head's width (``lilicorr_hidden_size``, or the draft's hidden size when 0)."""
        return int(self.lilicorr_hidden_size or self.hidden_size)

    def dflash_config(self) -> dict[str, Any]:
        """The block vLLM 0.32's DFlash-family loader reads (module docstring)."""
        return {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": [i - 1 for i in self.aux_hidden_state_layer_ids],
            "sample_from_anchor": self.sample_from_anchor,
            "causal": self.block_causal,
            "block_size": self.block_size,
            "lilicorr_enabled": self.lilicorr_enabled,
            **{key: getattr(self, key) for key in HEAD_KEYS},
        }

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["dflash_config"] = self.dflash_config()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """The fields are the truth; ``dflash_config`` is derived from them (and rewritten on save)."""
        data = {key: value for key, value in data.items() if key != "dflash_config"}
        return super().from_dict(data)


__all__ = ["ARCHITECTURE", "HEAD_KEYS", "LiLiCorrConfig"]
