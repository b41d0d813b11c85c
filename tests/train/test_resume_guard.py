"""A resume is the same run, or it is refused before anything is written (issue 40).

One finished tiny EAGLE-3 run is shared by the module; each test resumes a copy of it. A resume under another recipe
(another draft vocabulary, another algorithm, another ttt_steps / lr / seed) is refused with every differing key
and the ways on, and leaves every file of the run as it was; a change of length or cadence resumes and is said; a
``train.resume`` path that does not exist says so and names the run's checkpoints; the command line reports a
refusal in one line. Beside it, the exporter's fallback when ``best.json`` names a deleted step is a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from speculators import runs
from tests.conftest import REPO_ROOT
from tests.train.conftest import compose, tiny_overrides
from train.trainer import train

FIRST = ("train.epochs=1", "train.save_every=2")  # 4 steps (8 samples, micro batch 2): step-2 and step-4 kept


@pytest.fixture(scope="module")
def finished_run(sharp_verifier, tiny_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(compose(tiny_overrides(sharp_verifier, tiny_data, run_dir, *FIRST)), run_dir)
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


def digest(run_dir: Path, skip: str | None = None) -> dict[str, str]:
    """Every file of the run and its content hash (``skip``: a top-level directory left out)."""
    return {
        str(path.relative_to(run_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and path.relative_to(run_dir).parts[0] != skip
    }


def resume(verifier: Path, data: Path, run_dir: Path, *extra: str, recipe: str | None = None):
    overrides = tiny_overrides(verifier, data, run_dir, *FIRST, *extra)
    if recipe is not None:
        overrides[0] = f"recipe={recipe}"
    return train(compose(overrides), run_dir)


def test_another_draft_vocab_size_is_refused_and_nothing_is_written(sharp_verifier, tiny_data, run_copy):
    before = digest(run_copy)
    with pytest.raises(ValueError) as refused:
        resume(sharp_verifier, tiny_data, run_copy, "model.draft_vocab_size=128")
    message = str(refused.value)
    assert f"{run_copy / 'config.yaml'}" in message and "model.draft_vocab_size: 256 -> 128" in message
    assert "resume with the run's own recipe, or start a new run_dir" in message
    assert f"train.init_from={run_copy / 'checkpoints' / 'step-4'}" in message
    assert digest(run_copy) == before


def test_another_recipe_is_refused_naming_every_differing_key(sharp_verifier, tiny_data, run_copy):
    before = digest(run_copy)
    with pytest.raises(ValueError) as refused:
        resume(sharp_verifier, tiny_data, run_copy, recipe="tiny_dflash")
    message = str(refused.value)
    assert (
        "train.algorithm: eagle3 -> dflash" in message
        and "recipe_name: tiny_eagle3 -> tiny_dflash" in message
    )
    assert "block.block_size: (absent) -> " in message  # DFlash's own group, which the EAGLE-3 run never had
    assert digest(run_copy) == before


def test_changed_learning_settings_are_refused_not_mixed(sharp_verifier, tiny_data, run_copy):
    """Today these resumed silently ("resumed from step-4") and trained one run under two recipes."""
    before = digest(run_copy)
    changed = ("train.ttt_steps=2", "optim.lr=5e-3", "seed=7")
    with pytest.raises(ValueError) as refused:
        resume(sharp_verifier, tiny_data, run_copy, *changed)
    message = str(refused.value)
    # eval.k follows ttt_steps and data.seed follows seed: what they change is listed too
    for line in ("train.ttt_steps: 3 -> 2", "optim.lr: 0.001 -> 0.005", "seed: 0 -> 7", "eval.k: 3 -> 2"):
        assert f"  - {line}\n" in message, message
    assert digest(run_copy) == before


def test_a_longer_run_and_other_cadences_resume_and_are_said(sharp_verifier, tiny_data, run_copy, capsys):
    result = resume(
        sharp_verifier, tiny_data, run_copy, "train.epochs=2", "train.max_steps=6", "train.keep_checkpoints=3"
    )
    out = capsys.readouterr().out
    assert result["step"] == 6 and "resumed from" in out and "at step 4" in out
    said = next(line for line in out.splitlines() if line.startswith("resuming with changed: "))
    for change in ("train.epochs 1 -> 2", "train.max_steps null -> 6", "train.keep_checkpoints 2 -> 3"):
        assert change in said
    assert said.endswith("(the lr schedule now spans the new length)")
    assert runs.read_recipe(run_copy)["train"]["max_steps"] == 6  # the run's recipe is now the resumed one


def test_a_checkpoint_copied_into_a_new_run_dir_resumes(sharp_verifier, tiny_data, finished_run, tmp_path):
    """train.resume=<a step of another run>: compared with that run's recipe, its own paths (data_gen.output_dir
    under its run_dir) not counted as changes."""
    new_run = tmp_path / "elsewhere"
    start = finished_run / "checkpoints" / "step-2"
    result = resume(sharp_verifier, tiny_data, new_run, f"train.resume={start}")
    assert result["step"] == 4 and [step for step, _ in runs.list_checkpoints(new_run)] == [4]


def test_a_missing_resume_path_says_it_does_not_exist(sharp_verifier, tiny_data, run_copy, tmp_path):
    missing = run_copy / "checkpoints" / "step-3"
    new_run = tmp_path / "new"
    with pytest.raises(FileNotFoundError) as refused:
        resume(sharp_verifier, tiny_data, new_run, f"train.resume={missing}")
    message = str(refused.value)
    assert f"train.resume={missing}: the path does not exist" in message
    assert "step-2, step-4" in message and "init_from" not in message
    assert not new_run.exists()  # refused before the run directory was made


def test_the_command_line_refuses_in_one_line(sharp_verifier, tiny_data, run_copy, tmp_path):
    """An error raised inside train() was a traceback; now one ``error:`` line, and the run is untouched (bar
    Hydra's own record of each launch, ``<run_dir>/hydra``, which Hydra writes before any of our code runs)."""
    before = digest(run_copy, skip="hydra")
    args = tiny_overrides(sharp_verifier, tiny_data, run_copy, *FIRST, "model.draft_vocab_size=128")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    env.pop("SPECULATORS_TRACEBACK", None)
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train" / "run.py"), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "error: train.resume: " in result.stderr and "model.draft_vocab_size: 256 -> 128" in result.stderr
    assert digest(run_copy, skip="hydra") == before


def test_export_warns_when_best_json_names_a_deleted_step(run_copy):
    best_file = runs.checkpoints_dir(run_copy) / runs.BEST_NAME
    best = json.loads(best_file.read_text())
    best.update(step=2, path="checkpoints/step-2")
    best_file.write_text(json.dumps(best))
    shutil.rmtree(runs.step_dir(run_copy, 2))
    with pytest.warns(UserWarning, match=r"best\.json names step 2 .*using the latest, step-4, instead"):
        checkpoint = runs.locate_checkpoint(run_copy)
    assert checkpoint.step == 4 and checkpoint.selected_by == "latest"


def test_a_damaged_checkpoint_state_is_named_with_the_way_on(sharp_verifier, tiny_data, run_copy):
    """A state file truncated (a full disk, a killed copy) is a ValueError naming the checkpoint, the earlier one
    to resume and init_from, not the reader's own error (train/run.py prints it in one line)."""
    state = run_copy / "checkpoints" / "step-4" / "state"
    weights = next(state.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError) as refused:
        resume(sharp_verifier, tiny_data, run_copy)
    message = str(refused.value)
    assert f"{state} cannot be loaded" in message and "damaged" in message
    assert str(run_copy / "checkpoints" / "step-2") in message and "train.init_from=" in message
