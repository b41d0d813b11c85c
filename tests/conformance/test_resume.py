"""Exact resume after SIGKILL, for every registered algorithm (and HASS, a distinct objective): a 2-process ZeRO-2
run of the unit's tiny recipe, killed while it writes step 3, resumes to the weights and logged losses of an
uninterrupted run, bit for bit (its position or anchor sampling included)."""

from __future__ import annotations

import pytest
import torch

from tests.conformance.units import RESUME_RECIPES
from tests.train.conftest import NUM_SAMPLES, build_sharp_verifier, run_launch, tiny_overrides, write_features
from tests.train.test_distributed import COMMON, final_weights, kill_mid_run, losses

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def resume_verifier(tmp_path_factory):
    return build_sharp_verifier(tmp_path_factory.mktemp("verifier") / "tiny-sharp")


@pytest.fixture(scope="module")
def resume_data(tmp_path_factory, resume_verifier):
    return write_features(
        tmp_path_factory.mktemp("data"), resume_verifier, NUM_SAMPLES, heldout_same=True, seed=0
    )


@pytest.mark.parametrize("name", list(RESUME_RECIPES))
def test_sigkill_and_resume_gives_identical_weights(resume_verifier, resume_data, tmp_path, name):
    def args(run_dir):
        recipe, extra = RESUME_RECIPES[name]
        overrides = tiny_overrides(resume_verifier, resume_data, run_dir, *COMMON, "deepspeed=zero2", *extra)
        overrides[0] = f"recipe={recipe}"
        return overrides

    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    run_launch(2, args(reference), tmp_path)
    kill_mid_run(args(run_dir), run_dir / "checkpoints", tmp_path)
    result = run_launch(2, args(run_dir), tmp_path)  # auto-resume from the newest complete checkpoint
    assert "resum" in (result.stdout + result.stderr).lower()
    assert not list((run_dir / "checkpoints").glob(".step-*.partial"))
    expected, resumed = final_weights(reference), final_weights(run_dir)
    assert expected.keys() == resumed.keys()
    for key in expected:
        assert torch.equal(expected[key], resumed[key]), key
    assert losses(run_dir) == losses(
        reference
    )  # metrics of the killed attempt past its checkpoint were dropped
