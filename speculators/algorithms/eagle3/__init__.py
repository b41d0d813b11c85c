"""EAGLE-3 (and its variants HASS, an objective on the same model, and EAGLE-3.1, the same model with two norm
flags on): one drafting step per forward, k steps for k tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from speculators.algorithms import Algorithm, Variant, register, variant_config
from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.algorithms.eagle3.drafter import Drafter
from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.format.config import FULL, SLIDING


def _key_findings(config: dict[str, Any], severity: str) -> Iterator[str]:
    """EAGLE-3's own keys (norm_before_residual, eagle_aux ids, the newer norm flags), as the validator words them."""
    from speculators.algorithms.eagle3.rules import eagle3_key_findings
    from speculators.format.validate import Finding

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
    from speculators.algorithms.eagle3.rules import expected_shapes

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
    model = {flag: recipe_value(recipe, f"model.{flag}") for flag in NORM_FLAGS}
    config.norm_output = norm_flags(str(recipe_value(recipe, "train.algorithm", "eagle3")), model)[
        "norm_output"
    ]
    return config.to_dict()


# EAGLE-3.1 (speculators PR #610, what speculators 0.9.0's trainer defaults EAGLE-3 to): the same model and type
# with an RMSNorm over the concatenated aux states before fc and the normed hidden state carried to the next step
EAGLE31 = Variant("eagle31", "EAGLE-3.1", (("norm_before_fc", True), ("norm_output", True)), article="An")
NORM_FLAGS = ("norm_before_fc", "norm_output")


def norm_flags(algorithm: str, model: Any) -> dict[str, bool]:
    """``norm_before_fc`` / ``norm_output`` of a draft a ``train.algorithm`` trains: the recipe's ``model`` group
    (a mapping or settings object) where it sets them, else what the algorithm declares (EAGLE-3.1: both true),
    else false."""
    declared = variant_config(algorithm)
    flags = {}
    for flag in NORM_FLAGS:
        value = model.get(flag) if isinstance(model, dict) else getattr(model, flag, None)
        flags[flag] = bool(declared.get(flag, False) if value is None else value)
    return flags


EAGLE3 = register(
    Algorithm(
        name="eagle3",
        display_name="EAGLE-3",
        package_class="Eagle3DraftModel",  # speculators 0.9.0's class for the type
        converter="speculators.algorithms.eagle3.convert",  # EAGLE-3's layouts, and P-EAGLE's (an EAGLE-3 body)
        article="An",
        config_class=Eagle3Config,
        other_architectures=("Eagle3DraftModel",),  # what speculators 0.9.0's save_pretrained writes
        model_class=Eagle3DraftModel,
        drafting="sequential",
        drafter_class=Drafter,
        aux_layer_key="eagle_aux_hidden_state_layer_ids",
        config_rules=_config_rules,
        config_warnings=_config_warnings,
        expected_shapes=_expected_shapes,
        vllm_method="eagle3",
        trained_as=(Variant("hass", "HASS"), EAGLE31),
        card_keys=("norm_before_residual", "norm_before_fc", "norm_output"),
        config_from_weights=config_from_weights,
    )
)
