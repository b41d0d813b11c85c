"""The memory plan (``train.dry_run=true``): every recipe plans offline, and the meta-device count of one TTT step
matches the bytes a real step allocates on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from speculators.local_paths import find_local_paths
from tests.conftest import REPO_ROOT
from tests.support.plans import recipe_plan
from train.memory_plan import LiveBytes, build_meta_draft, meta_head, plan_memory, trace_step, write_plan

RECIPES = sorted(p.stem for p in (REPO_ROOT / "recipes" / "recipe").glob("*.yaml"))
KEYS = ("params_trainable", "params_frozen", "static_bytes_per_rank", "peak_bytes_per_rank")


def resolved(recipe: str, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(REPO_ROOT / "recipes"), version_base=None):
        cfg = compose(config_name="config", overrides=[f"recipe={recipe}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


# the tiny verifier a tiny recipe's algorithm needs: the tiny Llama, or one that ships an MTP layer for MTP
TINY_VERIFIERS = {"mtp": "tiny_qwen3_next_dir"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_plans_offline(recipe, request):
    overrides = []
    if recipe.startswith("tiny"):
        algorithm = resolved(recipe, "verifier.name_or_path=/nowhere")["train"]["algorithm"]
        verifier = request.getfixturevalue(TINY_VERIFIERS.get(algorithm, "tiny_llama_dir"))
        overrides = [f"verifier.name_or_path={verifier}"]
    plan = recipe_plan(recipe, *overrides)  # shared with the GPU recipes' tests (tests/support/plans.py)
    assert all(key in plan for key in KEYS)
    assert plan["params_trainable"] > 0 and plan["params_frozen"] > 0 and plan["activation_peak_bytes"] > 0
    for table in (plan["static_bytes_per_rank"], plan["peak_bytes_per_rank"]):
        assert set(table) == {"zero0", "zero1", "zero2", "zero3", "zero3_offload"}
        assert all(set(row) == {"1", "8"} for row in table.values())
    static = plan["static_bytes_per_rank"]
    assert static["zero3"]["8"] < static["zero2"]["8"] < static["zero1"]["8"] < static["zero1"]["1"]
    assert static["zero2"]["1"] == plan["params_trainable"] * 16  # bf16 2 + 2, fp32 master 4, AdamW 8
    if "8b" in recipe:
        assert plan["verifier_config"].startswith("recipes/verifiers/")
        assert (REPO_ROOT / plan["verifier_config"] / "config.json").is_file()


def test_written_plan_holds_no_local_path(tiny_llama_dir, tmp_path, capsys):
    """memory_plan.json may be shared or committed: a local verifier is named by its folder, nothing absolute."""
    plan = write_plan(resolved("tiny_eagle3", f"verifier.name_or_path={tiny_llama_dir}"), tmp_path)
    text = (tmp_path / "memory_plan.json").read_text()
    assert str(tiny_llama_dir) not in text and find_local_paths(text) == []
    assert plan["verifier"] == tiny_llama_dir.name


def test_llama8b_plan_has_the_published_shapes():
    plan = plan_memory(resolved("eagle3_llama8b"))
    h, v, vd = 4096, 128256, 32000
    layer = 2 * h * 32 * 128 + 2 * 2 * h * 8 * 128 + 32 * 128 * h + 3 * h * 14336  # q k v from 2H, o, MLP
    norms = 4 * h  # input_layernorm, hidden_norm, post_attention_layernorm, final norm
    assert plan["params_trainable"] == 3 * h * h + layer + vd * h + norms
    assert plan["params_frozen_parts"]["draft_embedding"] == v * h


def test_online_mode_counts_the_verifier_as_frozen():
    offline = plan_memory(resolved("eagle3_qwen3_8b"))
    online = plan_memory(resolved("eagle3_qwen3_8b", "train.data_mode=online"))
    assert 8.0e9 < online["params_frozen_parts"]["verifier"] < 8.4e9  # Qwen3-8B: 8.19B
    assert online["params_frozen"] == offline["params_frozen"] + online["params_frozen_parts"]["verifier"]


@pytest.mark.parametrize("recipe", ["tiny_eagle3", "tiny_dflash", "tiny_dspark", "tiny_dflash2"])
def test_meta_count_matches_a_real_step_on_cpu(tiny_llama_dir, recipe):
    """The same step on real CPU tensors (full rows, every token a loss token, draft vocab = full vocab so every
    target is trained): the planner's worst-case count must be within 10% of the real peak (it differs only by the
    last 2 + j positions of each row, which no TTT step or block can train on)."""
    from speculators import algorithms
    from speculators.verifier import verifier_config_dict

    config = resolved(recipe, f"verifier.name_or_path={tiny_llama_dir}", "model.draft_vocab_size=null")
    verifier_config = verifier_config_dict(str(tiny_llama_dir))
    model, draft_config, objective = build_meta_draft(config, verifier_config, torch.float32)
    head = meta_head(verifier_config, draft_config.draft_vocab_size, torch.float32)
    rows, length = int(config["train"]["micro_batch_size"]), int(config["train"]["max_length"])
    hidden = int(verifier_config["hidden_size"])
    aux = len(algorithms.get(draft_config.SPECULATORS_MODEL_TYPE).aux_layer_ids(draft_config)) * hidden
    from train.memory_plan import meta_batch

    planned = trace_step(model, head, meta_batch(rows, length, aux, hidden, torch.float32), objective)

    real_model = model.to_empty(device="cpu")
    torch.manual_seed(0)
    for param in real_model.parameters():
        param.data.normal_(0, 0.02)
    real_head = head.to_empty(device="cpu")
    real_head.weight.normal_()
    real_head.draft_weight.copy_(real_head.weight)
    real_head.target_ids.copy_(torch.arange(len(real_head.target_ids)))
    real_head.draft_index.copy_(torch.arange(len(real_head.draft_index)))
    real_head.norm.weight.data.fill_(1.0)
    real_model.draft.d2t.zero_()
    real_model.draft.t2d.fill_(True)
    for name, buffer in real_model.draft.rotary_emb.named_buffers():  # rope: a fresh module's values
        buffer.copy_(getattr(type(real_model.draft.rotary_emb)(real_model.draft.rotary_emb.config), name))
    batch = {
        "input_ids": torch.randint(0, 500, (rows, length)),
        "position_ids": torch.arange(length).repeat(rows, 1),
        "document_ids": torch.zeros(rows, length, dtype=torch.long),
        "loss_mask": torch.ones(rows, length, dtype=torch.bool),
        "aux_hidden": torch.randn(rows, length, aux),
        "last_hidden": torch.randn(rows, length, hidden),
    }
    real = trace_step(real_model, real_head, batch, objective)
    assert abs(planned - real) / real < 0.10, (planned, real)
    with LiveBytes() as tracker:  # the tracker itself sees real allocations and frees
        kept = torch.empty(1000, dtype=torch.float32)
        del kept
        torch.empty(10, dtype=torch.float32)
    assert tracker.peak == 4000 and tracker.live == 0


def test_dry_run_command_writes_the_plan_in_under_a_minute(tmp_path):
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "train/run.py", "recipe=eagle3_llama8b", "train.dry_run=true", f"run_dir={tmp_path}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.perf_counter() - started < 60
    plan = json.loads((tmp_path / "memory_plan.json").read_text())
    assert plan["recipe"] == "eagle3_llama8b" and "memory plan eagle3_llama8b" in result.stdout
    assert not (tmp_path / "checkpoints").exists()  # nothing of training ran


def test_flex_padded_keys_are_counted_as_flex_allocates_them(tiny_llama_dir):
    """The chunked trace never builds flex's zero-padded key/value concatenations; the plan adds them, byte for
    byte what train.ttt_attention.padded_step_keys allocates per step and layer (about 1.6 GB at the 8B recipe)."""
    from speculators.verifier import verifier_config_dict
    from train.memory_plan import flex_padded_key_bytes
    from train.ttt_attention import padded_step_keys

    config = resolved("tiny_eagle3", f"verifier.name_or_path={tiny_llama_dir}")
    _, draft_config, _ = build_meta_draft(config, verifier_config_dict(str(tiny_llama_dir)), torch.bfloat16)
    layer = draft_config.transformer_layer_config
    rows, length, steps = 2, 16, 3
    key = torch.zeros(rows, layer["num_key_value_heads"], length, draft_config.head_dim, dtype=torch.bfloat16)
    allocated = (
        sum(2 * padded_step_keys([key] * (step + 1), steps).nbytes for step in range(steps))
        * draft_config.num_layers
    )
    counted = flex_padded_key_bytes(rows, length, steps, draft_config, torch.bfloat16, "auto")
    assert counted == allocated > 0
    assert flex_padded_key_bytes(rows, length, steps, draft_config, torch.bfloat16, "chunked") == 0

    flex = plan_memory(resolved("eagle3_llama8b"))
    chunked = plan_memory(resolved("eagle3_llama8b", "train.attention_backend=chunked"))
    assert 1.5e9 < flex["flex_padded_keys_bytes"] < 1.7e9
    assert flex["activation_peak_bytes"] - chunked["activation_peak_bytes"] == flex["flex_padded_keys_bytes"]
