"""EAGLE-3 (and HASS, an objective on the same model): one drafting step per forward, k steps for k tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from speculators.algorithms import Algorithm, register
from speculators.format.config import Eagle3Config
from speculators.models.eagle3 import Eagle3DraftModel


def _key_findings(config: dict[str, Any], severity: str) -> Iterator[str]:
    """EAGLE-3's own keys (norm_before_residual, eagle_aux ids, the newer norm flags), as the validator words them."""
    from speculators.format.validate import Finding, eagle3_key_findings

    def error(message: str) -> Finding:
        return Finding("error", "", message)

    def warning(message: str) -> Finding:
        return Finding("warning", "", message)

    return (f.message for f in eagle3_key_findings(config, error, warning) if f.severity == severity)


def _config_rules(config: dict[str, Any]) -> Iterator[str]:
    return _key_findings(config, "error")


def _config_warnings(config: dict[str, Any]) -> Iterator[str]:
    return _key_findings(config, "warning")


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    from speculators.format.validate import expected_shapes

    return expected_shapes(config)


EAGLE3 = register(
    Algorithm(
        name="eagle3",
        display_name="EAGLE-3",
        config_class=Eagle3Config,
        model_class=Eagle3DraftModel,
        drafting="sequential",
        aux_layer_key="eagle_aux_hidden_state_layer_ids",
        config_rules=_config_rules,
        config_warnings=_config_warnings,
        expected_shapes=_expected_shapes,
        vllm_method="eagle3",
    )
)
