"""Exact resume, for every registered algorithm (and HASS, a distinct objective), in two parts:

* every unit: its tiny recipe run straight through in this process, and again from that run's step-3 checkpoint
  (mid-epoch) in a run directory left as a killed attempt leaves it (the checkpoint and a metrics log that goes on
  past it), ends on the same weights and logged losses bit for bit. What differs between algorithms is proven here:
  the objective's state and the RNG of its position, anchor or COD sampling restore exactly;
* one unit (``KILLED``): the real thing, a 2-process ZeRO-2 ``accelerate launch`` SIGKILLed while it writes step 3,
  resumes to the weights and logged losses of an uninterrupted 2-process run, bit for bit. What that adds is the
  same for every algorithm (atomic checkpoint folders, ZeRO-2 partitions, per-rank seeds, the launcher's restart)
  and costs three launches (~100 s), so one unit carries it: P-EAGLE, whose sampled COD draws the most from the
  RNG and whose recipe samples fewer anchors than there are positions.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from speculators import runs
from tests.conformance.units import RESUME_RECIPES, UNITS
from tests.support.tiny_models import single_thread
from tests.train.conftest import (
    NUM_SAMPLES,
    build_sharp_verifier,
    compose,
    run_launch,
    tiny_overrides,
    write_features,
)
from tests.train.test_distributed import COMMON, STEPS, final_weights, kill_mid_run, losses
from train.trainer import train

pytestmark = pytest.mark.slow

KILLED = "peagle"  # the unit of the SIGKILL run (module docstring)
RESUMED_AT = 3  # mid-epoch: 2 steps per epoch


@pytest.fixture(scope="module")
def resume_verifier(tmp_path_factory):
    return build_sharp_verifier(tmp_path_factory.mktemp("verifier") / "tiny-sharp")


@pytest.fixture(scope="module")
def resume_data(tmp_path_factory, resume_verifier):
    return write_features(
        tmp_path_factory.mktemp("data"), resume_verifier, NUM_SAMPLES, heldout_same=True, seed=0
    )


@pytest.fixture(scope="module")
def resume_mtp(tmp_path_factory) -> tuple[Path, Path]:
    """The MTP unit's run: a tiny Qwen3-Next with an MTP layer (vocab as the sharp verifier's) and its features of
    the last hidden state (tiny_mtp's aux id [4])."""
    from tests.support.mtp import build_tiny_mtp_verifier

    verifier = build_tiny_mtp_verifier(tmp_path_factory.mktemp("verifier") / "tiny-qwen3-next", init_std=0.3)
    data = write_features(
        tmp_path_factory.mktemp("data"), verifier, NUM_SAMPLES, heldout_same=True, seed=0, aux_layer_ids=[4]
    )
    return verifier, data


def unit_overrides(request, name: str, run_dir: Path, *extra: str) -> list[str]:
    """The unit's tiny recipe (and its declared resume overrides) on the verifier and features it trains on."""
    unit = UNITS.get(name)
    if unit is not None and unit.verifier == "qwen3_next":
        verifier, data = request.getfixturevalue("resume_mtp")
    else:
        verifier, data = request.getfixturevalue("resume_verifier"), request.getfixturevalue("resume_data")
    recipe, declared = RESUME_RECIPES[name]
    overrides = tiny_overrides(verifier, data, run_dir, *COMMON, *extra, *declared)
    overrides[0] = f"recipe={recipe}"
    return overrides


def assert_same_run(reference: Path, resumed: Path) -> None:
    """The final weights bit for bit, and every logged loss (the attempt's records past its checkpoint dropped)."""
    expected, got = final_weights(reference), final_weights(resumed)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert losses(resumed) == losses(reference)


@pytest.mark.parametrize("name", list(RESUME_RECIPES))
def test_resume_from_a_mid_epoch_checkpoint_gives_identical_weights(request, tmp_path, name):
    # one process at the 2-process runs' global batch of 4: the same 6 steps; every checkpoint kept
    one = ("train.micro_batch_size=4", "train.keep_checkpoints=0")
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    with single_thread():
        train(compose(unit_overrides(request, name, reference, *one)), reference)
        checkpoint = reference / "checkpoints" / f"step-{RESUMED_AT}"
        shutil.copytree(checkpoint, resumed / "checkpoints" / checkpoint.name)
        shutil.copy(reference / runs.METRICS_NAME, resumed / runs.METRICS_NAME)  # the attempt logged past it
        train(compose(unit_overrides(request, name, resumed, *one)), resumed)  # train.resume=auto
    assert len(losses(reference)) == STEPS + 3  # a record per step + an evaluation per epoch
    # it resumed: a fresh start of the same run would end alike but write steps 1 and 2 again
    assert [step for step, _ in runs.list_checkpoints(resumed)] == list(range(RESUMED_AT, STEPS + 1))
    assert_same_run(reference, resumed)


def test_sigkill_and_resume_gives_identical_weights(request, tmp_path):
    def args(run_dir: Path) -> list[str]:
        return unit_overrides(request, KILLED, run_dir, "deepspeed=zero2")

    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    run_launch(2, args(reference), tmp_path)
    kill_mid_run(args(run_dir), run_dir / "checkpoints", tmp_path)
    result = run_launch(2, args(run_dir), tmp_path)  # auto-resume from the newest complete checkpoint
    assert "resum" in (result.stdout + result.stderr).lower()
    assert not list((run_dir / "checkpoints").glob(".step-*.partial"))
    assert_same_run(reference, run_dir)
