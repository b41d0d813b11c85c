"""EAGLE-3 (and HASS, an objective on the same model): one drafting step per forward, k steps for k tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from speculators.algorithms import Algorithm, register
from speculators.format.config import FULL, SLIDING, Eagle3Config
from speculators.models.eagle3 import Eagle3DraftModel


def _key_findings(config: dict[str, Any], severity: str) -> Iterator[str]:
    """EAGLE-3's own keys (norm_before_residual, eagle_aux ids, the newer norm flags), as the validator words them."""
    from speculators.format.validate import Finding, eagle3_key_findings

    def error(message: str) -> Finding:
        return Finding("error", "", message)

    def warning(message: str) -> Finding:
        return Finding("warning", "", message)

    return (f.message for f in eagle3_key_findings(config, error, warning) if f.severity == severity)


def _window_rules(config: dict[str, Any]) -> Iterator[str]:
    """Sliding-window draft layers as vLLM reads them: ``layer_types[i]`` per draft layer (it asserts the list
    covers every layer) and an integer ``sliding_window`` for the ``sliding_attention`` ones."""
    layer = config.get("transformer_layer_config") or {}
    types = layer.get("layer_types")
    if types is None:
        return
    layers = layer.get("num_hidden_layers", 1)
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {SLIDING, FULL}:
        yield (
            f"transformer_layer_config.layer_types {types!r} must list {layers} entries of {SLIDING!r} or "
            f"{FULL!r}, one per draft layer (vLLM indexes it by draft layer)"
        )
    elif SLIDING in types and not (
        isinstance(layer.get("sliding_window"), int) and layer["sliding_window"] >= 1
    ):
        yield "sliding_attention layers need transformer_layer_config.sliding_window, a positive integer"


def _config_rules(config: dict[str, Any]) -> Iterator[str]:
    yield from _key_findings(config, "error")
    yield from _window_rules(config)


def _config_warnings(config: dict[str, Any]) -> Iterator[str]:
    return _key_findings(config, "warning")


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    from speculators.format.validate import expected_shapes

    return expected_shapes(config)


def config_from_weights(
    tensors: dict[str, torch.Tensor],
    verifier_config: dict[str, Any],
    verifier_path: str,
    recipe: dict[str, Any],
) -> dict[str, Any]:
    """The config of EAGLE-3 ZeRO shards saved without one, from what the run recorded: the layer type, aux ids and
    norm flags from the recipe (the layer type defaults to the verifier family's, as the trainer's does), the draft
    vocabulary from ``lm_head``, the layer count from ``layers.N`` and the optional norms from their weights."""
    from speculators.runs import recipe_value

    layers = {int(n.split(".")[1]) for n in tensors if n.startswith("layers.")}
    config = Eagle3Config.from_verifier(
        verifier_config,
        verifier_path,
        draft_vocab_size=int(tensors["lm_head.weight"].shape[0]),
        aux_layer_ids=recipe_value(recipe, "verifier.aux_layer_ids"),
        num_layers=max(layers) + 1 if layers else 1,
        layer_type=recipe_value(recipe, "model.layer_type"),
        norm_before_residual=bool(recipe_value(recipe, "model.norm_before_residual", True)),
    )
    config.norm_before_fc = "input_norm.weight" in tensors
    config.fc_norm = "fc_norm.0.weight" in tensors
    config.norm_output = bool(recipe_value(recipe, "model.norm_output", False))
    return config.to_dict()


EAGLE3 = register(
    Algorithm(
        name="eagle3",
        display_name="EAGLE-3",
        config_class=Eagle3Config,
        other_architectures=("Eagle3DraftModel",),  # what speculators 0.9.0's save_pretrained writes
        model_class=Eagle3DraftModel,
        drafting="sequential",
        aux_layer_key="eagle_aux_hidden_state_layer_ids",
        config_rules=_config_rules,
        config_warnings=_config_warnings,
        expected_shapes=_expected_shapes,
        vllm_method="eagle3",
        trained_as=(("hass", "HASS"),),
        card_keys=("norm_before_residual",),
        config_from_weights=config_from_weights,
    )
)
