"""Real multi-process runs through `accelerate launch` on CPU (gloo): 2-process DDP, ZeRO-2 and ZeRO-3 (with and
without gradient accumulation, with feature noise) compute the same losses and weights as 1 process on the same
global batch. (A 2-process run killed with SIGKILL resumes to bit-identical weights: tests/conformance/test_resume.py,
for every algorithm, with ``kill_mid_run`` from here.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.train.conftest import accelerate_launch, compose, launch_env, run_launch, tiny_overrides
from train.trainer import train

STEPS = 6  # 8 samples, global batch 4 -> 2 steps/epoch x 3 epochs
BF16_LOSS_TOL, BF16_WEIGHT_TOL = 2e-2, 6e-3  # measured: 8e-4 (CE), 2e-3 (weights: ~2 Adam steps)
COMMON = ("train.epochs=3", "train.save_every=1", "train.noise_std=0.01", "logging.log_every=1")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[tuple]:
    """Per step: (step, kind, loss, per-step CE, per-step accuracy) of every train/eval record."""
    out = []
    for r in records(run_dir):
        prefix = "train" if r["kind"] == "train" else "eval"
        keys = sorted(k for k in r if k.startswith((f"{prefix}/ce_", f"{prefix}/acc_")))
        out.append((r["step"], r["kind"], r[f"{prefix}/loss"], *[r[k] for k in keys]))
    return out


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{STEPS}" / "draft" / "model.safetensors"))


def assert_close_runs(
    a: Path, b: Path, atol: float, weight_atol: float = 5e-5, weight_rtol: float = 1e-4
) -> None:
    """Same losses per step (fp32 summation order is the only difference) and final weights within a small
    fraction of one Adam step (lr 1e-3): Adam's normalised updates amplify 1e-7 gradient differences."""
    la, lb = losses(a), losses(b)
    assert [x[:2] for x in la] == [x[:2] for x in lb]
    for ra, rb in zip(la, lb, strict=True):
        assert ra[2:] == pytest.approx(rb[2:], abs=atol, rel=atol), (ra, rb)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(
            wa[name].float(), wb[name].float(), atol=weight_atol, rtol=weight_rtol, msg=name
        )


@pytest.fixture(scope="module")
def one_process_run(sharp_verifier, tiny_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("one") / "run"
    train(
        compose(tiny_overrides(sharp_verifier, tiny_data, run_dir, *COMMON, "train.micro_batch_size=4")),
        run_dir,
    )
    return run_dir


@pytest.fixture(scope="module")
def zero2_run(sharp_verifier, tiny_data, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("zero2")
    run_dir = tmp / "run"
    run_launch(2, tiny_overrides(sharp_verifier, tiny_data, run_dir, *COMMON, "deepspeed=zero2"), tmp)
    return run_dir


def test_zero2_two_processes_equal_one(one_process_run, zero2_run):
    assert len(losses(zero2_run)) == STEPS + 3  # a record per step + an evaluation per epoch
    assert_close_runs(one_process_run, zero2_run, atol=1e-5)
    state = json.loads((zero2_run / "checkpoints" / f"step-{STEPS}" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["global_batch"] == 4


@pytest.mark.parametrize("backend", ["zero3", "none"])
def test_zero3_and_ddp_two_processes_equal_one(backend, one_process_run, sharp_verifier, tiny_data, tmp_path):
    """With gradient accumulation too: 2 processes × 2 micro batches of 1 = the same global batch of 4."""
    run_dir = tmp_path / "run"
    accumulate = ("train.micro_batch_size=1", "train.grad_accum=2")
    overrides = tiny_overrides(
        sharp_verifier, tiny_data, run_dir, *COMMON, *accumulate, f"deepspeed={backend}"
    )
    result = run_launch(2, overrides, tmp_path)
    kind = "DEEPSPEED" if backend == "zero3" else "MULTI_CPU"
    assert f"on 2 process(es), {kind}" in result.stdout + result.stderr
    assert_close_runs(one_process_run, run_dir, atol=1e-5)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker it started (by pid: only what this test launched)."""
    family = [process.pid] + [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=30)


def kill_mid_run(args: list[str], checkpoints: Path, tmp_path: Path) -> None:
    """Launch a 2-process run and SIGKILL it (every process) while it writes, or has just written, step 3; it must
    not have finished."""
    process = subprocess.Popen(
        accelerate_launch(2, args, tmp_path),
        cwd=Path(__file__).resolve().parents[2],
        env=launch_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline and process.poll() is None:
            if (checkpoints / ".step-3.partial").exists() or (checkpoints / "step-3").exists():
                break
            time.sleep(0.01)
    finally:
        kill_tree(process)
    assert not (checkpoints / f"step-{STEPS}").exists(), "the run finished before it could be killed"


# ---- bf16 (train.dtype=bf16 forces it; the suite's other runs are fp32: tests/conftest.py) ------------------------
BF16 = ("train.dtype=bf16",)


def test_recipe_dtype_is_forced_on_cpu_too():
    from train.assemble import compute_dtype

    assert compute_dtype("auto") == torch.float32  # tests/conftest.py: SPECULATORS_COMPUTE_DTYPE=float32
    assert compute_dtype("bf16") == compute_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="fp16 needs loss scaling"):
        compute_dtype("fp16")


@pytest.fixture(scope="module")
def one_process_bf16_run(sharp_verifier, tiny_data, tmp_path_factory) -> Path:
    """The bf16 reference: 1 process under DeepSpeed ZeRO-2 (bf16 weights, fp32 master copy), global batch 4."""
    tmp = tmp_path_factory.mktemp("one_bf16")
    overrides = tiny_overrides(
        sharp_verifier, tiny_data, tmp / "run", *COMMON, *BF16, "deepspeed=zero2", "train.micro_batch_size=4"
    )
    result = run_launch(1, overrides, tmp)
    assert "dtype bfloat16" in result.stdout + result.stderr
    return tmp / "run"


@pytest.mark.slow  # bf16 matmuls are ~30x slower than fp32 on this AVX2 CPU; two launches
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_bf16_two_processes_equal_one(stage, one_process_bf16_run, sharp_verifier, tiny_data, tmp_path):
    """ZeRO-2 (micro batch 2) and ZeRO-3 (micro batch 1 x accumulation 2) on 2 processes in bf16 match 1 process:
    losses within bf16 rounding (8 mantissa bits: ~0.4% per op; one flipped argmax moves an accuracy by ~1%) and
    final weights within 6e-3, a few Adam steps of lr 1e-3 (measured: CE 8e-4 relative, weights 2e-3)."""
    run_dir = tmp_path / "run"
    accumulate = ("train.micro_batch_size=1", "train.grad_accum=2") if stage == "zero3" else ()
    overrides = tiny_overrides(
        sharp_verifier, tiny_data, run_dir, *COMMON, *BF16, *accumulate, f"deepspeed={stage}"
    )
    result = run_launch(2, overrides, tmp_path)
    assert "on 2 process(es), DEEPSPEED" in result.stdout + result.stderr
    assert "dtype bfloat16" in result.stdout + result.stderr
    assert_close_runs(
        one_process_bf16_run, run_dir, atol=BF16_LOSS_TOL, weight_atol=BF16_WEIGHT_TOL, weight_rtol=0.0
    )
