"""DFlash and DSpark training end to end in one process: anchor blocks drawn from the EAGLE-3 features, a draft that learns
to propose several tokens per forward, a checkpoint that is a valid DFlash directory, and attention memory linear in
the number of anchors."""

from __future__ import annotations

import json

import pytest
import torch

from speculators import algorithms
from speculators.algorithms.dflash.config import DFlashConfig
from speculators.algorithms.dflash.model import DFlashDraftModel
from speculators.runs import read_best, resolve_draft_dir
from tests.train.conftest import compose, tiny_overrides
from train.objectives.dflash import AnchorBlockDraft, dpace_weights, sample_anchors
from train.trainer import train


def test_dflash_learns_blocks_and_writes_a_dflash_checkpoint(sharp_verifier, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(
        sharp_verifier, tiny_data, run_dir, "train.epochs=40", "train.micro_batch_size=8"
    )
    overrides[0] = "recipe=tiny_dflash"
    overrides += ["train.eval_every=20", "optim.lr=5e-3", "model.init_lm_head_from_verifier=false"]
    train(compose(overrides), run_dir)
    best = read_best(run_dir)
    ceiling = best["metrics"]["eval/acceptance_length_max"]
    assert ceiling > 3.5  # block 4: three draft tokens per forward
    assert (best["acceptance_length"] - 1) / (ceiling - 1) > 0.4, best  # random drafts score ~1.0
    draft_dir = resolve_draft_dir(run_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    # the sharp verifier has no tokenizer: the mask id is one the data never contains, and the config says why
    assert "never occurs in the training data" in config["mask_token_source"]
    model = algorithms.load_draft(draft_dir)
    assert isinstance(model, DFlashDraftModel) and model.config.draft_vocab_size == 256
    errors = list(algorithms.get("dflash").config_rules(config))
    assert not errors, errors


def test_dspark_trains_its_markov_and_confidence_heads(sharp_verifier, tiny_data, tmp_path):
    run_dir = tmp_path / "dspark"
    overrides = tiny_overrides(
        sharp_verifier, tiny_data, run_dir, "train.epochs=20", "train.micro_batch_size=8"
    )
    overrides[0] = "recipe=tiny_dspark"
    overrides += ["optim.lr=5e-3", "model.init_lm_head_from_verifier=false"]
    train(compose(overrides), run_dir)
    best = read_best(run_dir)
    assert best["acceptance_length"] > 1.8, best
    draft_dir = resolve_draft_dir(run_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    unit = algorithms.of_config(config)
    assert unit.name == "dspark" and not list(unit.config_rules(config))
    model = algorithms.load_draft(draft_dir)
    state = model.state_dict()
    shapes = unit.expected_shapes(config)
    assert {k: tuple(v.shape) for k, v in model.export_state_dict().items()} == shapes
    # the heads learnt: the Markov table's output map left its zero init, the confidence head moved
    assert state["markov_head.markov_w2.weight"].abs().sum() > 0
    assert state["confidence_head.proj.bias"].abs().item() > 0


def test_anchor_sampling_is_reproducible_and_bounded():
    valid = torch.rand(3, 50, generator=torch.Generator().manual_seed(0)) > 0.3
    rows, cols = sample_anchors(valid, 20, seed=7)
    again = sample_anchors(valid, 20, seed=7)
    assert rows.numel() == 20 and torch.equal(rows, again[0]) and torch.equal(cols, again[1])
    assert bool(valid[rows, cols].all())
    assert not torch.equal(cols, sample_anchors(valid, 20, seed=8)[1])
    every = sample_anchors(valid, 10_000, seed=0)
    assert every[0].numel() == int(valid.sum())


def test_dpace_weights_count_the_tokens_a_slot_unlocks():
    ce = torch.tensor([[0.0, 0.0, 0.0], [float("inf"), 0.0, 0.0]])
    trained = torch.ones(2, 3, dtype=torch.bool)
    weights = dpace_weights(ce, trained, alpha=0.5)
    # a perfectly confident block: slot j unlocks (k - j) accepted tokens
    assert torch.allclose(weights[0], torch.tensor([3.0, 2.0, 1.0]))
    # a hopeless first slot halves (alpha) everything after it
    assert torch.allclose(weights[1], torch.tensor([0.5 + 0.5 + 0.5, 1.0, 0.5]))


def test_attention_memory_is_linear_in_anchors(tiny_llama_dir):
    """The block attention's saved scores grow with the anchors, not their square: doubling the anchors doubles
    the bytes the forward keeps for backward (measured with saved-tensor hooks), at most."""
    verifier = json.loads((tiny_llama_dir / "config.json").read_text())
    config = DFlashConfig.from_verifier(verifier, str(tiny_llama_dir), mask_token_id=3, block_size=4)
    model = AnchorBlockDraft(DFlashDraftModel(config), anchor_chunk=1000)
    length, n_aux = 256, len(config.aux_layer_ids)
    torch.manual_seed(0)
    inputs = (
        torch.randint(0, 100, (1, length)),
        torch.randn(1, length, n_aux * config.hidden_size),
        torch.arange(length)[None],
        torch.zeros(1, length, dtype=torch.long),
    )

    def saved_bytes(anchors: int) -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        cols = torch.linspace(10, length - 10, anchors).long()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*inputs, torch.zeros_like(cols), cols, 4)[0].sum()
        return total

    # weights, the row's context K/V and rope tables are shared by every anchor: compare increments
    m32, m64, m128 = saved_bytes(32), saved_bytes(64), saved_bytes(128)
    assert 1.8 < (m128 - m64) / (m64 - m32) < 2.2, (m32, m64, m128)


def test_training_attention_equals_the_engine_rule():
    """The training path (one row's context shared, exact two-part softmax, checkpointed) gives the engine's
    attention (:func:`block_attention`, SDPA over the gathered context ++ block) on the same inputs, causal or not."""
    from speculators.algorithms.dflash.model import block_attention
    from train.objectives.dflash import anchored_attention

    torch.manual_seed(0)
    anchors, heads, kv_heads, slots, dim, length = 5, 4, 2, 4, 8, 12
    q = torch.randn(anchors, heads, slots, dim, requires_grad=True)
    k, v = torch.randn(anchors, kv_heads, slots, dim), torch.randn(anchors, kv_heads, slots, dim)
    ctx_k, ctx_v = torch.randn(kv_heads, length, dim), torch.randn(kv_heads, length, dim)
    ends = torch.tensor([0, 3, 5, 8, 11])
    visible = (torch.arange(length)[None] <= ends[:, None])[:, None].expand(-1, slots, -1)
    for causal in (True, False):
        ours = anchored_attention(q, k, v, ctx_k, ctx_v, visible, causal)
        ref = block_attention(
            q, k, v, ctx_k.expand(anchors, -1, -1, -1), ctx_v.expand(anchors, -1, -1, -1), visible, causal
        )
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        (grad,) = torch.autograd.grad(ours.square().sum(), q)
        (grad_ref,) = torch.autograd.grad(ref.square().sum(), q)
        torch.testing.assert_close(grad, grad_ref, atol=1e-5, rtol=1e-5)
    assert not torch.equal(
        anchored_attention(q, k, v, ctx_k, ctx_v, visible, True),
        anchored_attention(q, k, v, ctx_k, ctx_v, visible, False),
    )


def test_cpu_budget_shortens_the_run_to_fit(sharp_verifier, tiny_data, tmp_path, capsys):
    """``train.max_cpu_seconds``: after the probe steps the run is cut to the steps the budget buys (equal-CPU lanes
    of the bench), and it still ends with an evaluation and a checkpoint."""
    run_dir = tmp_path / "budget"
    overrides = tiny_overrides(
        sharp_verifier, tiny_data, run_dir, "train.epochs=400", "train.micro_batch_size=1"
    )
    overrides[0] = "recipe=tiny_dflash"
    budget = ["train.max_cpu_seconds=3", "train.eval_every=100000", "train.save_every=100000"]
    result = train(compose([*overrides, *budget]), run_dir)
    planned = 400 * 8
    assert 10 <= result["step"] < planned
    assert f"(planned {planned})" in capsys.readouterr().out
    assert read_best(run_dir) is not None


def test_a_resumed_budgeted_run_keeps_its_schedule_and_spends_only_the_rest(
    sharp_verifier, tiny_data, tmp_path
):
    """A bench lane killed mid-run resumes with the step count its budget was fitted to (so its lr schedule, and
    with it every weight, is the uninterrupted run's) and counts the CPU spent before the kill: without the
    checkpointed budget the resumed run would re-measure and get a fresh budget of its own."""
    import shutil

    from safetensors.torch import load_file

    from speculators.runs import list_checkpoints

    def budgeted(run_dir):
        overrides = tiny_overrides(
            sharp_verifier, tiny_data, run_dir, "train.epochs=400", "train.micro_batch_size=1"
        )
        overrides[0] = "recipe=tiny_dflash"
        budget = ["train.max_cpu_seconds=3", "train.eval_every=100000", "train.save_every=12"]
        # torch's per-tensor AdamW loop, as when this test was calibrated: the fused kernel makes the tiny steps so
        # cheap that a second pytest worker's bursts swing the 10-step CPU probe by half (247 vs 154 steps, seen once)
        budget.append("optim.fused=false")
        # the fitted length stands: a run that re-plans for a busier machine (the default, test_cpu_budget.py) is
        # resumed at its checkpointed length but then measures its own machine, so it cannot be compared step for step
        hold = "train.cpu_budget_hold=false"
        return compose([*overrides, *budget, hold, "train.keep_checkpoints=1000"])

    whole = tmp_path / "whole"
    result = train(budgeted(whole), whole)
    kept = list_checkpoints(whole)
    middle_step, middle = kept[len(kept) // 2]
    assert 10 < middle_step < result["step"]
    state = json.loads((middle / "trainer_state.json").read_text())
    assert state["budget_steps"] == result["step"] and 0 < state["budget_cpu_s"] < 3
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(middle, resumed / "checkpoints" / middle.name)
    for name in ("config.yaml", "draft_vocab.safetensors"):
        if (whole / name).exists():
            shutil.copy(whole / name, resumed / name)
    again = train(budgeted(resumed), resumed)
    assert again["step"] == result["step"]
    final = f"step-{result['step']}/draft/model.safetensors"
    ours, theirs = load_file(resumed / "checkpoints" / final), load_file(whole / "checkpoints" / final)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    # a checkpoint from before the budget was recorded: the steps already done are charged at the CPU per step the
    # resumed run measures, so it ends near the whole run's step count, not a fresh budget (about 1.5x) later
    legacy = tmp_path / "legacy"
    shutil.copytree(resumed / "checkpoints" / middle.name, legacy / "checkpoints" / middle.name)
    state_file = legacy / "checkpoints" / middle.name / "trainer_state.json"
    old_state = {k: v for k, v in state.items() if not k.startswith("budget_")}
    state_file.write_text(json.dumps(old_state))
    for name in ("config.yaml", "draft_vocab.safetensors"):
        if (whole / name).exists():
            shutil.copy(whole / name, legacy / name)
    estimated = train(budgeted(legacy), legacy)
    assert 0.75 * result["step"] <= estimated["step"] <= 1.3 * result["step"]


def test_dflash2_trains_its_convolutions_and_selector(sharp_verifier, tiny_data, tmp_path):
    """tiny_dflash2: the draft learns blocks, its convolutions leave the identity and its selector learns; the
    unary head stays the verifier's (frozen, as speculators 0.9.0 rebuilds it) and the checkpoint is a valid
    DFlash2 directory with 0.9.0's keys."""
    from safetensors.torch import load_file

    from speculators.algorithms.dflash2.model import DFlash2DraftModel

    run_dir = tmp_path / "dflash2"
    overrides = tiny_overrides(
        sharp_verifier, tiny_data, run_dir, "train.epochs=20", "train.micro_batch_size=8"
    )
    overrides[0] = "recipe=tiny_dflash2"
    overrides += ["optim.lr=5e-3"]
    train(compose(overrides), run_dir)
    best = read_best(run_dir)
    assert best["acceptance_length"] > 1.8, best
    draft_dir = resolve_draft_dir(run_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    unit = algorithms.of_config(config)
    assert unit.name == "dflash2" and not list(unit.config_rules(config))
    assert config["draft_vocab_size"] == config["transformer_layer_config"]["vocab_size"]
    assert (config["selector_rank"], config["selector_top_k"]) == (16, 4)
    assert (config["conv_kernel_size"], config["conv_group_size"]) == (2, 16)
    assert config["sliding_window_non_causal"] is True
    model = algorithms.load_draft(draft_dir)
    assert isinstance(model, DFlash2DraftModel)
    state = model.state_dict()
    shapes = unit.expected_shapes(config)
    assert {n: tuple(t.shape) for n, t in state.items() if n not in ("d2t", "t2d")} == shapes
    conv = model.layers[0].attention_conv
    assert conv.kernel_projection.weight.abs().sum() > 0  # trained away from the identity start
    fresh = DFlash2DraftModel(model.config)
    assert not torch.equal(
        fresh.candidate_selector.hidden_projection.weight,
        state["candidate_selector.hidden_projection.weight"],
    )
    verifier = load_file(str(next(sharp_verifier.glob("*.safetensors"))))
    head = verifier.get("lm_head.weight", verifier.get("model.embed_tokens.weight"))
    torch.testing.assert_close(state["lm_head.weight"], head.float(), rtol=0, atol=0)


def test_dflash2_refuses_a_reduced_vocabulary(sharp_verifier, tiny_data, tmp_path):
    from train.settings import SettingsError

    overrides = tiny_overrides(sharp_verifier, tiny_data, tmp_path / "run")
    overrides[0] = "recipe=tiny_dflash2"
    with pytest.raises(SettingsError, match="requires the full verifier vocabulary"):
        train(compose([*overrides, "model.draft_vocab_size=128"]), tmp_path / "run")


def test_lilicorr_trains_its_lattice_head(sharp_verifier, tiny_data, tmp_path):
    """tiny_lilicorr: the draft learns blocks, its acceptance counted on the head's walk (its teacher-forced picks
    among each slot's top 4: an untrained head picks among them at random); the candidate head stays the
    verifier's (frozen, as vLLM draws candidates from the target's) and the checkpoint is a valid LiLiCorr
    directory whose ``dflash_config`` (what vLLM reads) carries every head key of the recipe."""
    from safetensors.torch import load_file

    from speculators.algorithms.lilicorr.config import HEAD_KEYS
    from speculators.algorithms.lilicorr.model import LiLiCorrDraftModel

    run_dir = tmp_path / "lilicorr"
    overrides = tiny_overrides(
        sharp_verifier, tiny_data, run_dir, "train.epochs=20", "train.micro_batch_size=8"
    )
    overrides[0] = "recipe=tiny_lilicorr"
    overrides += ["optim.lr=5e-3"]
    train(compose(overrides), run_dir)
    best = read_best(run_dir)
    assert best["acceptance_length"] > 1.8, best
    draft_dir = resolve_draft_dir(run_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    unit = algorithms.of_config(config)
    assert unit.name == "lilicorr" and not list(unit.config_rules(config))
    assert config["architectures"] == ["LiLiCorrDraftModel"]
    assert config["draft_vocab_size"] == config["transformer_layer_config"]["vocab_size"]
    block = config["dflash_config"]
    assert block["lilicorr_enabled"] is True and block["block_size"] == 4
    assert {key: block[key] for key in HEAD_KEYS} == {key: config[key] for key in HEAD_KEYS}
    assert (
        block["lilicorr_hidden_size"],
        block["lilicorr_candidate_topk"],
        block["lilicorr_num_layers"],
    ) == (32, 4, 1)
    assert block["target_layer_ids"] == [i - 1 for i in config["aux_hidden_state_layer_ids"]]
    model = algorithms.load_draft(draft_dir)
    assert isinstance(model, LiLiCorrDraftModel)
    state = model.state_dict()
    assert {n: tuple(t.shape) for n, t in state.items() if n not in ("d2t", "t2d")} == unit.expected_shapes(
        config
    )
    verifier = load_file(str(next(sharp_verifier.glob("*.safetensors"))))
    head = verifier.get("lm_head.weight", verifier.get("model.embed_tokens.weight"))
    torch.testing.assert_close(state["lm_head.weight"], head.float(), rtol=0, atol=0)


def test_lilicorr_refuses_a_reduced_vocabulary(sharp_verifier, tiny_data, tmp_path):
    from train.settings import SettingsError

    overrides = tiny_overrides(sharp_verifier, tiny_data, tmp_path / "run")
    overrides[0] = "recipe=tiny_lilicorr"
    with pytest.raises(SettingsError, match="requires the full verifier vocabulary"):
        train(compose([*overrides, "model.draft_vocab_size=128"]), tmp_path / "run")
