"""P-EAGLE: an EAGLE-3 draft that proposes K tokens in one forward (speculators.algorithms.peagle.model).

vLLM 0.32 has no P-EAGLE method of its own: it runs the draft on its EAGLE-3 classes with ``parallel_drafting``.
Served as the model (``LLM(model=<draft dir>)``) its speculators adapter turns that on from
``speculators_model_type: peagle``; through ``speculative_config`` the caller must say ``"method": "eagle3",
"parallel_drafting": true`` itself, or vLLM drafts sequentially (K forwards) with ``mask_hidden`` unloaded and
only logs that it skipped it. :func:`vllm_extra` supplies the flag so no caller forgets it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from speculators.algorithms import AUX_BLOCKED_BY_FC, Algorithm, register
from speculators.algorithms.peagle.config import PEagleConfig
from speculators.algorithms.peagle.drafter import ParallelDrafter
from speculators.algorithms.peagle.model import PEagleDraftModel

# what vLLM's Llama EAGLE-3 class assumes when the checkpoint names no aux count it reads (it ignores the
# top-level ids the speculators adapter writes)
LLAMA_ASSUMED_AUX_LAYERS = 3


def config_rules(config: dict[str, Any]) -> Iterator[str]:
    """Errors in P-EAGLE's own keys, each saying what a consumer would do (docs/format.md, "P-EAGLE"), after
    EAGLE-3's (the same body: aux ids, norm flags)."""
    from speculators import algorithms

    yield from algorithms.get("eagle3").config_rules(config)
    layer = config.get("transformer_layer_config") or {}
    vocab = layer.get("vocab_size")
    mask = config.get("mask_token_id")
    if "mask_token_id" not in config:
        yield "mask_token_id is missing: vLLM's P-EAGLE config translation fails with a KeyError"
    elif not isinstance(mask, int) or isinstance(mask, bool):
        yield f"mask_token_id {mask!r} must be an integer: vLLM fills the K-1 parallel slots with it"
    elif isinstance(vocab, int) and not 0 <= mask < vocab:
        yield f"mask_token_id {mask} is outside the verifier vocabulary [0, {vocab})"
    for key in ("norm_before_residual", "eagle_aux_hidden_state_layer_ids"):
        if key not in config:
            yield f"{key} is missing: vLLM's P-EAGLE default differs from what the draft was trained with"
    if config.get("fc_norm"):
        yield "fc_norm is true: vLLM's P-EAGLE translation does not copy it, so vLLM would build no fc_norm"
    ids = config.get("eagle_aux_hidden_state_layer_ids") or []
    if layer.get("model_type", "llama") == "llama" and len(ids) != LLAMA_ASSUMED_AUX_LAYERS:
        yield (
            f"{len(ids)} aux layers with llama layers: vLLM's Llama EAGLE-3 class assumes "
            f"{LLAMA_ASSUMED_AUX_LAYERS} for P-EAGLE and would build fc too narrow or too wide"
        )
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    if not isinstance(tokens, int) or tokens < 1:
        yield f"speculative_tokens {tokens!r} must be K >= 1, the depths one forward proposes"


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """EAGLE-3's tensors plus ``mask_hidden [1, 1, n_aux · H_verifier]`` (vLLM views it as ``[1, n_aux · H]``)."""
    from speculators.algorithms.eagle3.rules import expected_shapes as eagle3_shapes

    shapes = eagle3_shapes(config)
    layer = config["transformer_layer_config"]
    n_aux = len(config.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    verifier_hidden = config.get("target_hidden_size") or layer["hidden_size"]
    shapes["mask_hidden"] = (1, 1, n_aux * verifier_hidden)
    return shapes


def vllm_extra(config: dict[str, Any]) -> dict[str, Any]:
    """What ``speculative_config`` needs besides method/model/k: parallel drafting (module docstring)."""
    return {"parallel_drafting": True}


def config_warnings(config: dict[str, Any]) -> Iterator[str]:
    from speculators import algorithms

    return algorithms.get("eagle3").config_warnings(config)


PEAGLE = register(
    Algorithm(
        name="peagle",
        display_name="P-EAGLE",
        package_class="PEagleDraftModel",  # speculators 0.9.0's class for the type
        config_warnings=config_warnings,
        config_class=PEagleConfig,
        other_architectures=("PEagleDraftModel",),  # what speculators 0.9.0's save_pretrained writes
        model_class=PEagleDraftModel,
        drafting="parallel",
        drafter_class=ParallelDrafter,
        aux_layer_key="eagle_aux_hidden_state_layer_ids",
        config_rules=config_rules,
        expected_shapes=expected_shapes,
        vllm_method="eagle3",
        vllm_extra=vllm_extra,
        card_keys=("norm_before_residual", "mask_token_id"),
        # mask_hidden stands in for the concatenated aux states, so it is laid out per aux layer as fc's input is
        aux_blocked_tensors=(*AUX_BLOCKED_BY_FC, ("mask_hidden", 2)),
    )
)
