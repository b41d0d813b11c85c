"""MTP: the multi-token-prediction layer a Qwen3-Next verifier ships, fine-tuned (speculators 0.9.0's ``mtp`` type;
vLLM serves it with its ``mtp`` method). It drafts like EAGLE-3, one token per forward, from the verifier's last
hidden state and the next token's embedding, then from its own output: the engine's sequential drafter serves it
(``project_features`` puts the verifier's state through the verifier's final norm, as vLLM feeds the MTP module)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from speculators.algorithms import Algorithm, register
from speculators.algorithms.eagle3.drafter import Drafter
from speculators.algorithms.mtp.config import MTP_MODEL_TYPES, MTPConfig
from speculators.algorithms.mtp.model import MTPDraftModel


def _config_rules(config: dict[str, Any]) -> Iterator[str]:
    layer = config.get("transformer_layer_config") or {}
    if layer.get("model_type") not in MTP_MODEL_TYPES:
        yield (
            f"transformer_layer_config.model_type {layer.get('model_type')!r}: an MTP draft is the MTP layer of a "
            f"verifier that ships one, one of {', '.join(MTP_MODEL_TYPES)}"
        )
    if config.get("num_nextn_predict_layers", 1) != 1:
        yield f"num_nextn_predict_layers {config.get('num_nextn_predict_layers')}: speculators 0.9.0 builds 1"
    ids = config.get("mtp_hidden_state_layer_ids")
    layers = layer.get("num_hidden_layers")
    if ids is not None and ids != [layers]:
        yield f"mtp_hidden_state_layer_ids {ids}: MTP reads the verifier's last hidden state, [{layers}]"


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the MTP layer (a meta-device model of the config: the verifier's own modules decide)."""
    import torch

    with torch.device("meta"):
        model = MTPDraftModel(MTPConfig.from_dict(config))
    return {
        name: tuple(tensor.shape)
        for name, tensor in model.state_dict().items()
        if name.startswith("mtp_layers.")
    }


MTP = register(
    Algorithm(
        name="mtp",
        display_name="MTP",
        package_class="MTPDraftModel",  # speculators 0.9.0's class for the type
        article="An",  # "an em-tee-pee draft"
        config_class=MTPConfig,
        model_class=MTPDraftModel,
        drafting="sequential",
        drafter_class=Drafter,
        aux_layer_key="mtp_hidden_state_layer_ids",
        config_rules=_config_rules,
        expected_shapes=_expected_shapes,
        vllm_method="mtp",
        embed_from_verifier=True,
        aux_blocked_tensors=(),
        verifier_layer_config=True,
        card_keys=("num_nextn_predict_layers",),
        anchor_tensor="mtp_layers.0.input_proj.weight",
        vllm_unserved=(
            "vLLM 0.32 reads no speculators-format MTP checkpoint (its speculators config reader knows eagle3, "
            "peagle, dflash, dflash2 and dspark); it serves MTP with method mtp from the verifier's own mtp.* "
            "tensors only"
        ),
    )
)
