"""EAGLE-3 (and HASS, an objective on the same model): one drafting step per forward, k steps for k tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from speculators.algorithms import Algorithm, register
from speculators.format.config import Eagle3Config
from speculators.models.eagle3 import Eagle3DraftModel


def _no_extra_rules(config: dict[str, Any]) -> Iterator[str]:
    """EAGLE-3's keys are the validator's base rules (speculators.format.validate)."""
    return iter(())


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    from speculators.format.validate import expected_shapes

    return expected_shapes(config)


EAGLE3 = register(
    Algorithm(
        name="eagle3",
        config_class=Eagle3Config,
        model_class=Eagle3DraftModel,
        drafting="sequential",
        aux_layer_key="eagle_aux_hidden_state_layer_ids",
        config_rules=_no_extra_rules,
        expected_shapes=_expected_shapes,
        vllm_method="eagle3",
    )
)
