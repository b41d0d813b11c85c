"""Training in the dtype speculators.precision chooses: bf16 means autocast over fp32 master weights (the forward
really runs in bf16, the weights stay fp32 and train, the loss stays finite), and the run directory records what
was chosen and why (precision.json)."""

from __future__ import annotations

import json
import math

import torch

from speculators.precision import ENV_VAR, cpu_facts
from tests.train.conftest import compose, tiny_overrides
from train.trainer import Trainer


def test_bf16_autocast_step_keeps_fp32_master_weights_and_records_the_choice(
    sharp_verifier, tiny_data, tmp_path, monkeypatch
):
    monkeypatch.setenv(ENV_VAR, "bfloat16")  # what train.dtype=auto gives on a CPU with native bf16
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(sharp_verifier, tiny_data, run_dir, "train.max_steps=2", "train.epochs=1")
    trainer = Trainer(compose(overrides), run_dir)
    model = trainer.accelerator.unwrap_model(trainer.model)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    forward_dtypes: list[torch.dtype] = []
    hook = model.draft.fc.register_forward_hook(lambda module, args, out: forward_dtypes.append(out.dtype))
    failed = True
    try:
        trainer.fit()
        failed = False
    finally:
        hook.remove()
        trainer.close(failed=failed)
    assert forward_dtypes and set(forward_dtypes) == {torch.bfloat16}  # the forward ran under bf16 autocast
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters() if name in before)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if r["kind"] == "train"]
    assert losses and all(math.isfinite(loss) for loss in losses)
    record = json.loads((run_dir / "precision.json").read_text())["train"]
    assert (record["dtype"], record["source"]) == ("bfloat16", "env")
    assert record["cpu"] == cpu_facts().to_json() and record["device"] == "cpu"


def test_the_recipe_value_is_recorded_over_the_environment(sharp_verifier, tiny_data, tmp_path, monkeypatch):
    from train.trainer import train

    monkeypatch.setenv(ENV_VAR, "bfloat16")
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(sharp_verifier, tiny_data, run_dir, "train.max_steps=1", "train.dtype=fp32")
    train(compose(overrides), run_dir)
    record = json.loads((run_dir / "precision.json").read_text())["train"]
    assert (record["dtype"], record["source"], record["reason"]) == (
        "float32",
        "recipe",
        "train.dtype=float32 set explicitly",
    )
