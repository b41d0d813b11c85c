"""The block drafters under the same multi-process contract as EAGLE-3 (tests/train/test_distributed.py): DFlash on
2 processes under ZeRO-3 with gradient accumulation equals 1 process, and a DSpark run under ZeRO-2 killed with
SIGKILL mid-run resumes to bit-identical weights, its anchor sampling included."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.train.conftest import compose, run_launch, tiny_overrides
from tests.train.test_distributed import assert_close_runs, final_weights, kill_mid_run, losses
from train.trainer import train

COMMON = ("train.epochs=3", "train.save_every=1", "logging.log_every=1")


def block_overrides(recipe: str, verifier: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    overrides = tiny_overrides(verifier, data, run_dir, *COMMON, *extra)
    overrides[0] = f"recipe={recipe}"
    return overrides


def test_dflash_zero3_two_processes_equal_one(sharp_verifier, tiny_data, tmp_path):
    """Every valid anchor is used (max_anchors above the count): the same blocks whatever the process layout."""
    everything = "train.max_anchors=100000"
    one = tmp_path / "one"
    train(
        compose(
            block_overrides(
                "tiny_dflash", sharp_verifier, tiny_data, one, everything, "train.micro_batch_size=4"
            )
        ),
        one,
    )
    two = tmp_path / "two"
    accumulate = ("train.micro_batch_size=1", "train.grad_accum=2", "deepspeed=zero3", everything)
    result = run_launch(
        2, block_overrides("tiny_dflash", sharp_verifier, tiny_data, two, *accumulate), tmp_path
    )
    assert "on 2 process(es), DEEPSPEED" in result.stdout + result.stderr
    assert "training dflash draft" in result.stdout + result.stderr
    assert_close_runs(one, two, atol=1e-5)


def test_dspark_sigkill_and_resume_gives_identical_weights(sharp_verifier, tiny_data, tmp_path):
    sampled = ("deepspeed=zero2", "train.max_anchors=16")  # fewer than the valid positions: sampling matters
    reference = tmp_path / "reference"
    run_launch(2, block_overrides("tiny_dspark", sharp_verifier, tiny_data, reference, *sampled), tmp_path)
    run_dir = tmp_path / "run"
    args = block_overrides("tiny_dspark", sharp_verifier, tiny_data, run_dir, *sampled)
    checkpoints = run_dir / "checkpoints"
    kill_mid_run(args, checkpoints, tmp_path)
    run_launch(2, args, tmp_path)
    expected, resumed = final_weights(reference), final_weights(run_dir)
    assert "markov_head.markov_w2.weight" in resumed
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), name
    assert losses(run_dir) == losses(reference)
