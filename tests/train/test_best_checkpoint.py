"""The best checkpoint is the one with the highest held-out acceptance length, not the lowest loss.

A real run where the two disagree: at lr 1e-2 the tiny draft's held-out loss falls at every evaluation while its
simulated acceptance length peaks early and then drops (the soft cross-entropy keeps improving the whole
distribution while the top-1 agreement that acceptance counts gets worse). ``checkpoints/best.json`` and
``speculators export RUN`` must both pick the acceptance peak.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from speculators.cli import main as cli_main
from tests.train.conftest import compose, tiny_overrides
from train.trainer import train


def test_best_checkpoint_and_export_follow_acceptance_not_loss(sharp_verifier, tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = ("train.epochs=3", "optim.lr=1e-2", "train.eval_every=1", "logging.log_every=100")
    train(compose(tiny_overrides(sharp_verifier, tiny_data, run_dir, *overrides)), run_dir)
    evals = [
        record
        for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if record["kind"] == "eval"
    ]
    by_loss = min(evals, key=lambda r: r["eval/loss"])
    by_acceptance = max(evals, key=lambda r: r["eval/acceptance_length"])
    # the case must really disagree: the loss winner accepts clearly less than the acceptance winner
    assert by_loss["step"] != by_acceptance["step"], evals
    assert by_acceptance["eval/acceptance_length"] > by_loss["eval/acceptance_length"] + 0.1, evals
    assert by_acceptance["eval/loss"] > by_loss["eval/loss"], evals

    best = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    assert best["step"] == by_acceptance["step"]
    assert best["acceptance_length"] == by_acceptance["eval/acceptance_length"]
    assert (
        run_dir / best["path"] / "draft" / "config.json"
    ).is_file()  # kept, though older than the last two

    out = tmp_path / "exported"
    assert cli_main(["export", str(run_dir), str(out), "--dtype", "float32"]) == 0
    assert f"step-{by_acceptance['step']}" in capsys.readouterr().out
    exported = load_file(out / "model.safetensors")
    for step, same in ((by_acceptance["step"], True), (by_loss["step"], False)):
        trained = load_file(run_dir / "checkpoints" / f"step-{step}" / "draft" / "model.safetensors")
        assert torch.equal(exported["fc.weight"], trained["fc.weight"]) is same, step
