"""The block drafters under the same multi-process contract as EAGLE-3 (tests/train/test_distributed.py): DFlash on
2 processes under ZeRO-3 with gradient accumulation equals 1 process. (SIGKILL and exact resume, anchor sampling
included, for every algorithm: tests/conformance/test_resume.py.)"""

from __future__ import annotations

from pathlib import Path

from tests.train.conftest import compose, run_launch, tiny_overrides
from tests.train.test_distributed import assert_close_runs
from train.trainer import train

COMMON = ("train.epochs=3", "train.save_every=1", "logging.log_every=1")


def block_overrides(recipe: str, verifier: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    overrides = tiny_overrides(verifier, data, run_dir, *COMMON, *extra)
    overrides[0] = f"recipe={recipe}"
    return overrides


def test_dflash_zero3_two_processes_equal_one(sharp_verifier, tiny_data, tmp_path):
    """Every valid anchor is used (max_anchors above the count): the same blocks whatever the process layout."""
    everything = "block.max_anchors=100000"
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
