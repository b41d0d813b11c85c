"""End to end in one process: a draft overfits a handful of verifier-generated sequences until the simulated
acceptance length reaches its ceiling; the run directory follows the checkpoint contract; HASS trains too."""

from __future__ import annotations

import json

from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.format.validate import errors, validate_checkpoint
from speculators.runs import list_checkpoints, read_best, resolve_draft_dir
from tests.train.conftest import compose, tiny_overrides
from train.trainer import train


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_overfit_reaches_the_acceptance_ceiling(sharp_verifier, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    cfg = compose(
        tiny_overrides(
            sharp_verifier,
            tiny_data,
            run_dir,
            "train.epochs=60",
            "train.micro_batch_size=8",
            "train.eval_every=20",
            "optim.lr=5e-3",
            "model.init_lm_head_from_verifier=false",
            "logging.log_every=1",
        )
    )
    result = train(cfg, run_dir)
    best = read_best(run_dir)
    ceiling = best["metrics"]["eval/acceptance_length_max"]
    assert ceiling > 3.5  # 3 drafted tokens; a few positions are cut by document ends
    progress = (best["acceptance_length"] - 1) / (ceiling - 1)
    assert progress > 0.9, best
    first_step = next(r for r in metrics(run_dir) if r["kind"] == "train")
    assert first_step["step"] == 1 and first_step["train/acc_0"] < 0.5  # it did learn

    assert result["step"] == 60
    # the contract: complete step dirs (pruned to 2 + best), best.json, a loadable fp32 speculators draft
    steps = [step for step, _ in list_checkpoints(run_dir)]
    assert 60 in steps and best["step"] in steps and len(steps) <= 3
    draft_dir = resolve_draft_dir(run_dir)
    assert draft_dir == run_dir / "checkpoints" / f"step-{best['step']}" / "draft"
    problems = errors(validate_checkpoint(draft_dir))
    assert not problems, problems
    model = Eagle3DraftModel.from_pretrained(draft_dir)
    assert json.loads((draft_dir / "config.json").read_text())["torch_dtype"] == "float32"
    assert model.config.draft_vocab_size == 256 and int(model.t2d.sum()) == 256
    state = json.loads((draft_dir.parent / "trainer_state.json").read_text())
    assert state["step"] == best["step"] and state["global_batch"] == 8
    assert (run_dir / "draft_vocab.safetensors").is_file()


def test_hass_trains_with_topk_and_detached_context(sharp_verifier, tiny_data, tmp_path, monkeypatch):
    run_dir = tmp_path / "hass"
    overrides = tiny_overrides(sharp_verifier, tiny_data, run_dir, "train.epochs=2", "logging=offline")
    overrides[0] = "recipe=tiny_hass"
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(compose(overrides), run_dir)
    records = metrics(run_dir)
    assert all("train/topk_0" in r for r in records if r["kind"] == "train")
    assert list((run_dir / "wandb").glob("offline-run-*")), (
        "wandb offline mode writes its run under the run dir"
    )
    draft = json.loads((resolve_draft_dir(run_dir) / "config.json").read_text())
    assert draft["speculators_model_type"] == "eagle3"  # HASS exports as the servable eagle3 architecture
