"""Typed ``config.json`` of a P-EAGLE draft: an EAGLE-3 config plus the mask token (docs/format.md, "P-EAGLE")."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from speculators.algorithms.eagle3.config import Eagle3Config


@dataclass
class PEagleConfig(Eagle3Config):
    """config.json of a P-EAGLE draft (``speculators_model_type: peagle``): an EAGLE-3 draft that proposes its K
    tokens in ONE forward. Slot 0 is EAGLE-3's ordinary input (the bonus token with the verifier feature of the last
    accepted position); slots 1..K-1 hold ``mask_token_id`` with the learned ``mask_hidden`` in place of the
    verifier feature (docs/algorithms.md, "P-EAGLE").

    vLLM serves it on its EAGLE-3 classes with ``parallel_drafting`` on, reading the mask id from
    ``mask_token_id`` (as ``pard_token``): a missing key is a KeyError there and null breaks later, so the id is a
    required int here. ``norm_before_residual`` is always written: vLLM's P-EAGLE default (false) differs from its
    EAGLE-3 default (true) and from what our trainer uses. ``speculative_tokens`` is K, the trained depths.
    """

    SPECULATORS_MODEL_TYPE: ClassVar[str] = "peagle"
    ARCHITECTURE: ClassVar[str] = "PEagleSpeculator"
    mask_token_id: int = field(kw_only=True)
    # why this mask id (speculators/mask_token.py): read by people only, consumers ignore it
    mask_token_source: str = field(default="", kw_only=True)
    # speculators 0.9.0 trains the embedding of P-EAGLE drafts (its default, which its CLI cannot change)
    embed_requires_grad: bool = field(default=True, kw_only=True)

    @property
    def num_depths(self) -> int:
        """K: the tokens one forward proposes (slot 0 plus K-1 mask slots)."""
        return self.speculators_config.speculative_tokens

    @classmethod
    def from_verifier(  # type: ignore[override]
        cls,
        verifier_config: dict[str, Any],
        name_or_path: str,
        mask_token_id: int,
        mask_token_source: str = "",
        embed_requires_grad: bool = True,
        **eagle3_arguments: Any,
    ) -> PEagleConfig:
        """An EAGLE-3 config from the verifier (see :meth:`Eagle3Config.from_verifier`) plus the mask token;
        ``speculative_tokens`` is the number of depths K."""
        base = Eagle3Config.from_verifier(verifier_config, name_or_path, **eagle3_arguments)
        vocab = int(base.transformer_layer_config["vocab_size"])
        if not 0 <= int(mask_token_id) < vocab:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the verifier vocabulary ({vocab})")
        values = {f.name: getattr(base, f.name) for f in fields(Eagle3Config)}
        values["speculators_config"].algorithm = cls.SPECULATORS_MODEL_TYPE
        return cls(
            **values,
            mask_token_id=int(mask_token_id),
            mask_token_source=mask_token_source,
            embed_requires_grad=embed_requires_grad,
        )
