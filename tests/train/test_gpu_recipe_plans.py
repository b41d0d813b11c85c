"""The GPU recipes for the sizes users ask for (gpt-oss-20b, Qwen3-30B-A3B, Llama-3.1-70B, and Llama-3.1-8B at 32k
tokens): each verifier's shipped config.json has the published shapes, and each recipe's dry-run memory plan fits the
hardware the recipe names (its ``memory_plan`` section), saying which ZeRO layout is needed."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO_ROOT
from tests.support.plans import recipe_plan
from train.memory_plan import GIB, LAYOUTS, OFFLOAD, RESERVE_GIB, hardware_verdict, online_verifier_params

# recipe -> (verifier, its published shape, its total parameter count in billions, low and high)
VERIFIERS = {
    "openai/gpt-oss-20b": (
        {"num_hidden_layers": 24, "hidden_size": 2880, "vocab_size": 201088, "num_local_experts": 32,
         "num_experts_per_tok": 4, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
         "intermediate_size": 2880, "sliding_window": 128},
        (20.8, 21.0),  # 20.9B total, 3.6B active
    ),
    "Qwen/Qwen3-30B-A3B": (
        {"num_hidden_layers": 48, "hidden_size": 2048, "vocab_size": 151936, "num_experts": 128,
         "num_experts_per_tok": 8, "moe_intermediate_size": 768, "num_attention_heads": 32,
         "num_key_value_heads": 4, "head_dim": 128},
        (30.4, 30.6),  # 30.5B total, 3.3B active
    ),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": (
        {"num_hidden_layers": 48, "hidden_size": 2048, "vocab_size": 151936, "num_experts": 512,
         "num_experts_per_tok": 10, "moe_intermediate_size": 512, "num_attention_heads": 16,
         "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4, "mtp_num_hidden_layers": 1},
        (79.5, 79.8),  # 79.7B without its MTP layer (1.65B, the mtp recipe's trainable part): 81.3B on the hub
    ),
    "meta-llama/Llama-3.1-70B-Instruct": (
        {"num_hidden_layers": 80, "hidden_size": 8192, "vocab_size": 128256, "intermediate_size": 28672,
         "num_attention_heads": 64, "num_key_value_heads": 8},
        (70.4, 70.7),  # 70.6B
    ),
}  # fmt: skip
GPU_RECIPES = {
    "eagle3_gpt_oss_20b": "openai/gpt-oss-20b",
    "eagle3_qwen3_30b_a3b": "Qwen/Qwen3-30B-A3B",
    "dflash_qwen3_30b_a3b": "Qwen/Qwen3-30B-A3B",
    "dflash2_qwen3_8b": "Qwen/Qwen3-8B",
    "lilicorr_qwen3_8b": "Qwen/Qwen3-8B",
    "eagle3_llama70b": "meta-llama/Llama-3.1-70B-Instruct",
    "mtp_qwen3_next_80b": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "eagle3_llama8b_32k": "meta-llama/Llama-3.1-8B-Instruct",
    "eagle31_llama8b": "meta-llama/Llama-3.1-8B-Instruct",
}


@pytest.fixture(scope="module")
def plans() -> dict[str, dict]:
    return {recipe: recipe_plan(recipe) for recipe in GPU_RECIPES}


@pytest.mark.parametrize("verifier", sorted(VERIFIERS))
def test_shipped_verifier_config_has_the_published_shape(verifier):
    """transformers reads the shipped file as the family's config, and the whole verifier built from it on the meta
    device has the published parameter count (which catches a wrong width, depth, expert count or vocabulary)."""
    from speculators.verifier import verifier_config_dict

    path = REPO_ROOT / "recipes" / "verifiers" / verifier / "config.json"
    shape, (low, high) = VERIFIERS[verifier]
    written = json.loads(path.read_text())
    assert {key: written[key] for key in shape} == shape
    loaded = verifier_config_dict(str(path.parent))
    assert loaded["model_type"] == written["model_type"]
    assert low < online_verifier_params(loaded) / 1e9 < high


@pytest.mark.parametrize("recipe", sorted(GPU_RECIPES))
def test_gpu_recipe_plan_fits_the_hardware_it_names(plans, recipe):
    plan = plans[recipe]
    verdict = plan["hardware"]
    assert plan["verifier_config"] == f"recipes/verifiers/{GPU_RECIPES[recipe]}"
    assert verdict["gpus"] == 8 and verdict["gpu_memory_gib"] >= 79
    layout = verdict["recipe_layout"]
    assert verdict["recipe_fits"], (recipe, layout, verdict["peak_bytes_per_rank"][layout] / GIB)
    budget = (verdict["gpu_memory_gib"] - RESERVE_GIB) * GIB
    assert verdict["peak_bytes_per_rank"][layout] <= budget
    # the verdict's numbers are the plan's own: static + frozen at 8 processes + batch and activations / SP degree
    per_sequence = plan["batch_bytes"] + plan["activation_peak_bytes"]
    for key in LAYOUTS:
        expected = (
            plan["static_bytes_per_rank"][key]["8"]
            + plan["frozen_bytes_per_rank"][key]["8"]
            + per_sequence // verdict["sequence_parallel"]
        )
        assert verdict["peak_bytes_per_rank"][key] == expected
        assert verdict["fits"][key] == (expected <= budget)
    # the recipe uses no more sharding than it needs, and the least it needs is what the plan names
    assert LAYOUTS.index(layout) >= LAYOUTS.index(verdict["least_sharding_that_fits"])


def test_the_eagle31_plan_is_eagle3s_draft_plus_its_input_norm(plans):
    """EAGLE-3.1's plan is of the draft the trainer builds for train.algorithm=eagle31: eagle3_llama8b's plus the
    RMSNorm over the three concatenated 4096-wide aux states (the only parameters norm_before_fc adds)."""
    eagle3, eagle31 = recipe_plan("eagle3_llama8b"), plans["eagle31_llama8b"]
    assert eagle31["algorithm"] == "eagle31" and eagle3["algorithm"] == "eagle3"
    assert eagle31["params_trainable"] - eagle3["params_trainable"] == 3 * 4096
    assert eagle31["params_frozen"] == eagle3["params_frozen"]


def test_a_smaller_gpu_changes_the_verdict(plans):
    """The control: the same plan judged for a 24 GiB GPU does not fit under the recipe's layout."""
    plan = plans["eagle3_gpt_oss_20b"]
    verdict = plan["hardware"]
    smaller = hardware_verdict(
        {"gpu": "24 GiB GPU", "gpus": 8, "gpu_memory_gib": 24, "sequence_parallel": 1},
        {key: plan["static_bytes_per_rank"][key]["8"] for key in LAYOUTS},
        {key: plan["frozen_bytes_per_rank"][key]["8"] for key in LAYOUTS},
        plan["batch_bytes"] + plan["activation_peak_bytes"],
        verdict["recipe_layout"],
    )
    assert verdict["recipe_fits"] and not smaller["recipe_fits"]


def test_moe_verifiers_cost_the_trainer_only_their_embedding_and_head_offline(plans):
    """Offline, the trainer holds the draft, the verifier's embedding and its lm_head: the experts never."""
    for recipe in ("eagle3_gpt_oss_20b", "eagle3_qwen3_30b_a3b"):
        parts = plans[recipe]["params_frozen_parts"]
        assert parts["verifier"] == 0
        shape = VERIFIERS[GPU_RECIPES[recipe]][0]
        assert parts["draft_embedding"] == shape["vocab_size"] * shape["hidden_size"]


def test_mtp_plan_trains_the_verifiers_own_mtp_layer(plans):
    """Qwen3-Next's MTP layer is one full-attention decoder layer with the verifier's 512-expert MoE block: its
    1.65B parameters are what trains; offline the verifier's stack is never held."""
    plan = plans["mtp_qwen3_next_80b"]
    assert 1.6e9 < plan["params_trainable"] < 1.7e9
    assert plan["params_frozen_parts"]["verifier"] == 0


def test_llama70b_plan_says_which_layout_it_needs(plans):
    """70B offline at the paper's 4 x 2048 tokens: the draft (1.4B trainable at hidden 8192) does not fit plain DDP,
    ZeRO-1 is the least sharding that fits, the recipe's ZeRO-3 leaves the most room and offload is not needed (the
    step's activations dominate). Online, the whole bf16 verifier (141 GB) sits on every rank and no layout, offload
    included, fits an 80 GB GPU."""
    plan = plans["eagle3_llama70b"]
    assert 1.3e9 < plan["params_trainable"] < 1.5e9
    verdict = plan["hardware"]
    assert verdict["recipe_layout"] == "zero3" and verdict["recipe_fits"]
    assert not verdict["fits"]["zero0"] and verdict["least_sharding_that_fits"] == "zero1"
    peaks = verdict["peak_bytes_per_rank"]
    assert peaks["zero3"] < peaks["zero2"] < peaks["zero1"] < peaks["zero0"]
    offload = plan["static_bytes_per_rank"][OFFLOAD]["8"]
    assert offload < plan["static_bytes_per_rank"]["zero3"]["8"]
    assert plan["offload_host_bytes_per_rank"]["8"] == plan["params_trainable"] * 18 // 8
    online = recipe_plan("eagle3_llama70b", "train.data_mode=online")
    assert 70.4e9 < online["params_frozen_parts"]["verifier"] < 70.7e9
    assert online["hardware"]["least_sharding_that_fits"] is None
    assert not any(online["hardware"]["fits"].values())
