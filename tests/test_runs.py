"""The run directory (speculators.runs): one completeness rule, best/latest selection and source resolution, the
same for the trainer (resume, pruning, init_from) and the exporter. Step directories here hold only the files
the layout looks at; the export tests cover real drafts end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculators import runs


def make_step(
    run: Path, step: int, draft: bool = True, state: bool = False, trainer_state: bool = True
) -> Path:
    path = run / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    if draft:
        (path / "draft").mkdir()
        (path / "draft" / "config.json").write_text("{}")
        (path / "draft" / "model.safetensors").write_bytes(b"")
    if state:
        (path / "state").mkdir()
    if trainer_state:
        (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    return path


@pytest.fixture
def run(tmp_path) -> Path:
    root = tmp_path / "run"
    make_step(root, 10)
    make_step(root, 30, draft=False, state=True)  # a ZeRO checkpoint whose draft/ was not written
    return root


@pytest.mark.parametrize("style", ["run-relative", "checkpoints-relative", "absolute", "step-only", "draft"])
def test_best_json_path_styles(run, style):
    paths = {
        "run-relative": "checkpoints/step-10",
        "checkpoints-relative": "step-10",
        "absolute": str(run / "checkpoints" / "step-10"),
        "step-only": "",
        "draft": "checkpoints/step-10/draft",
    }
    (run / "checkpoints" / "best.json").write_text(json.dumps({"step": 10, "path": paths[style]}))
    checkpoint = runs.locate_checkpoint(run)
    assert (checkpoint.step, checkpoint.selected_by) == (10, "best")


def test_without_best_the_latest_complete_checkpoint_is_used(run):
    (run / "checkpoints" / "step-40").mkdir()  # an empty step directory: nothing to load
    (run / "checkpoints" / ".step-50.partial").mkdir()  # an interrupted save
    make_step(run, 60, draft=False)  # a trainer state without draft/ or state/
    checkpoint = runs.locate_checkpoint(run)
    assert (checkpoint.step, checkpoint.selected_by) == (30, "latest")
    (run / "checkpoints" / "best.json").write_text(json.dumps({"step": 99, "path": "checkpoints/step-99"}))
    assert runs.locate_checkpoint(run).step == 30  # best.json points at a deleted checkpoint


def test_trainer_and_exporter_agree_on_complete_steps(run):
    """Resume, pruning and export all see the same checkpoints: the trainer's listing is the exporter's."""
    (run / "checkpoints" / "step-40").mkdir()
    make_step(run, 60, draft=False)
    make_step(run, 70, trainer_state=False)  # a hand-copied draft: complete, loadable, not resumable
    assert [step for step, _ in runs.list_checkpoints(run)] == [10, 30, 70]
    assert runs.latest_checkpoint(run) == run / "checkpoints" / "step-70"
    assert runs.locate_checkpoint(run).step == 70
    with pytest.raises(FileNotFoundError, match="no state and no trainer_state.json; start a new run"):
        runs.require_resumable(run / "checkpoints" / "step-70")
    assert runs.require_resumable(run / "checkpoints" / "step-30") == {"step": 30}


def test_step_and_draft_directories_are_sources_too(run):
    step = run / "checkpoints" / "step-10"
    assert runs.locate_checkpoint(step).step == 10 and runs.locate_checkpoint(step).run_dir == run.resolve()
    assert runs.locate_checkpoint(step / "draft").step == 10
    assert runs.resolve_draft_dir(step) == (step / "draft").resolve()
    with pytest.raises(FileNotFoundError, match="neither a run directory"):
        runs.locate_checkpoint(run / "checkpoints")


def test_a_checkpoint_without_a_draft_names_the_export_command(run):
    with pytest.raises(FileNotFoundError, match="speculators export .*step-30"):
        runs.resolve_draft_dir(run / "checkpoints" / "step-30")


def test_best_json_written_by_the_trainer_is_read_back(run):
    runs.write_best(run, 10, 1.5, {"eval/acceptance_length": 1.5})
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best == {
        "step": 10,
        "path": "checkpoints/step-10",
        "acceptance_length": 1.5,
        "metrics": {"eval/acceptance_length": 1.5},
    }
    assert (
        runs.read_best(run) == best
        and runs.best_checkpoint(run) == (run / "checkpoints" / "step-10").resolve()
    )
    (run / "checkpoints" / "best.json").write_text("{")
    with pytest.raises(ValueError, match="best.json is not valid JSON"):
        runs.read_best(run)
