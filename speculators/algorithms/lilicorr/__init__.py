"""LiLiCorr: DFlash with a candidate-lattice correlator head (speculators.algorithms.lilicorr.model), trained by
NVIDIA modelopt and served by vLLM 0.32 as ``LiLiCorrDraftModel`` under its DFlash method, on its V2 GPU runner
only. vLLM 0.32 reads no speculators-format ``lilicorr`` type (its speculators reader knows eagle3, peagle, dflash,
dflash2 and dspark), so it refuses our export from its ``speculators_config``; its LiLiCorr loader reads the same
config's ``dflash_config`` block (speculators.algorithms.lilicorr.config) from a DFlash-shaped checkpoint. Our
engine drafts it on CPU."""

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
from speculators.algorithms.lilicorr.config import HEAD_KEYS, LiLiCorrConfig
from speculators.algorithms.lilicorr.drafter import LatticeBlockDrafter
from speculators.algorithms.lilicorr.model import CANDIDATE_FEATURES, LiLiCorrDraftModel

POSITIVE_INTS = ("lilicorr_candidate_topk", "lilicorr_num_heads", "lilicorr_factor_dim")
POSITIVE_NUMBERS = ("lilicorr_mlp_ratio", "lilicorr_vector_eps", "lilicorr_logit_scale")
VLLM_UNSERVED = (
    "vLLM 0.32 reads no speculators-format lilicorr config (its speculators types: eagle3, peagle, dflash, dflash2, "
    "dspark); its LiLiCorr loader (LiLiCorrDraftModel, V2 GPU runner only) reads this config's dflash_config from a "
    "DFlash-shaped checkpoint"
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number_problems(config: dict[str, Any]) -> Iterator[str]:
    """Each head key's type and range, as vLLM's ``LiLiCorrHead`` needs it (none has a default there)."""
    for key in POSITIVE_INTS:
        if not _is_int(config.get(key)) or config[key] < 1:
            yield f"{key} {config.get(key)!r} must be a positive integer (vLLM reads it from dflash_config)"
    for key in POSITIVE_NUMBERS:
        value = config.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            yield f"{key} {value!r} must be a number > 0 (vLLM reads it from dflash_config)"
    for key in ("lilicorr_hidden_size", "lilicorr_num_layers"):
        if not _is_int(config.get(key)) or config[key] < 0:
            yield f"{key} {config.get(key)!r} must be an integer >= 0 (lilicorr_hidden_size 0: the draft's width)"


def lilicorr_config_rules(config: dict[str, Any]) -> Iterator[str]:
    """DFlash's rules plus the head's keys, each saying what vLLM's loader would do with a wrong one."""
    yield from block_config_rules(config)
    layer = config.get("transformer_layer_config") or {}
    problem = LiLiCorrConfig.full_vocabulary_problem(config.get("draft_vocab_size"), layer.get("vocab_size"))
    if problem:
        yield problem
    if config.get("lilicorr_enabled") is not True:
        yield "lilicorr_enabled must be true: vLLM's LiLiCorr model refuses a checkpoint with it false"
    found = list(_number_problems(config))
    yield from found
    if found:
        return
    topk, heads = config["lilicorr_candidate_topk"], config["lilicorr_num_heads"]
    if topk > 16 or topk & (topk - 1):
        yield f"lilicorr_candidate_topk {topk} must be a power of two <= 16: vLLM's LiLiCorrHead refuses others"
    width = config["lilicorr_hidden_size"] or layer.get("hidden_size")
    if _is_int(width) and width % heads:
        yield f"lilicorr_num_heads {heads} must divide the head's width {width} (lilicorr_hidden_size or hidden_size)"
    if _is_int(width) and int(width * config["lilicorr_mlp_ratio"]) < 1:
        yield f"lilicorr_mlp_ratio {config['lilicorr_mlp_ratio']} leaves the head's MLP no width (int(width * ratio))"
    expected = (
        LiLiCorrConfig.from_dict(config).dflash_config() if not list(block_config_rules(config)) else None
    )
    if expected is not None and config.get("dflash_config") != expected:
        yield (
            "dflash_config disagrees with the top-level keys (vLLM reads dflash_config, we read the top level); "
            "re-export or rewrite it from them"
        )


def lilicorr_expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """DFlash's tensors and the head's ``lilicorr.*`` (vLLM's names; ``token_proj`` only when the head is narrower
    or wider than the draft, every linear biased)."""
    shapes = block_expected_shapes(config)
    hidden = int(config["transformer_layer_config"]["hidden_size"])
    width = int(config["lilicorr_hidden_size"] or hidden)
    slots, topk, heads = (
        config["block_size"] - 1,
        config["lilicorr_candidate_topk"],
        config["lilicorr_num_heads"],
    )
    factor, inner = config["lilicorr_factor_dim"], int(width * config["lilicorr_mlp_ratio"])
    head: dict[str, tuple[int, ...]] = {}

    def linear(name: str, out: int, into: int) -> None:
        head[f"{name}.weight"], head[f"{name}.bias"] = (out, into), (out,)

    if width != hidden:
        linear("token_proj", width, hidden)
    linear("pass_hidden_proj", width, hidden)
    head["feature_norm.weight"] = head["feature_norm.bias"] = (CANDIDATE_FEATURES,)
    linear("feature_mlp.up_proj", width, CANDIDATE_FEATURES)
    linear("feature_mlp.down_proj", width, width)
    head["slot_embedding"], head["rank_embedding"] = (1, 1, slots, 1, width), (1, 1, 1, topk, width)
    head["relative_slot_bias"], head["same_slot_bias"] = (heads, 2 * config["block_size"] - 1), (heads,)
    linear("context_proj", width, hidden)
    for i in range(config["lilicorr_num_layers"]):
        layer = f"layers.{i}"
        head[f"{layer}.attn_norm.weight"] = head[f"{layer}.mlp_norm.weight"] = (width,)
        head[f"{layer}.attn.in_proj_weight"], head[f"{layer}.attn.in_proj_bias"] = (
            (3 * width, width),
            (3 * width,),
        )
        linear(f"{layer}.attn.out_proj", width, width)
        linear(f"{layer}.mlp.up_proj", inner, width)
        linear(f"{layer}.mlp.down_proj", width, inner)
    head["output_norm.weight"] = head["anchor_norm.weight"] = (width,)
    linear("factor_input_proj", width, 3 * width)
    for name in ("out_head", "in_head", "anchor_out_head"):
        linear(name, factor, width)
    return {**shapes, **{f"lilicorr.{name}": shape for name, shape in head.items()}}


def lilicorr_native_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config.json vLLM 0.32's own LiLiCorr loader reads: the draft layer's config with the keys its
    speculators reader would add for a DFlash draft (``architectures``, ``draft_vocab_size``,
    ``eagle_aux_hidden_state_layer_ids``) and the ``dflash_config`` block (the head's keys inside it)."""
    native = dict(config["transformer_layer_config"])
    native.update(
        architectures=[LiLiCorrConfig.ARCHITECTURE],
        draft_vocab_size=config.get("draft_vocab_size"),
        eagle_aux_hidden_state_layer_ids=list(config["aux_hidden_state_layer_ids"]),
        dflash_config=LiLiCorrConfig.from_dict(config).dflash_config(),
    )
    if config.get("target_hidden_size") is not None:
        native["target_hidden_size"] = config["target_hidden_size"]
    return native


LILICORR = register(
    Algorithm(
        name="lilicorr",
        display_name="LiLiCorr",
        config_class=LiLiCorrConfig,
        model_class=LiLiCorrDraftModel,
        drafting="block",
        drafter_class=LatticeBlockDrafter,
        aux_layer_key="aux_hidden_state_layer_ids",
        config_rules=lilicorr_config_rules,
        config_warnings=block_config_warnings,
        # vLLM embeds the candidates with the target's embedding and draws them from the target's head
        weight_warnings=verifier_owned_weight_warnings,
        expected_shapes=lilicorr_expected_shapes,
        vllm_method="dflash",  # vLLM 0.32 picks LiLiCorr inside its DFlash method, by the architecture
        card_keys=(*BLOCK_CARD_KEYS, *HEAD_KEYS),
        embed_from_verifier=True,
        vllm_unserved=VLLM_UNSERVED,
        vllm_native_config=lilicorr_native_config,
    )
)
