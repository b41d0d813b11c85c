"""No command deletes what it did not write (issue 40): export, convert and eval refuse a target that is or holds
their source, a file, or a directory of someone else's; they replace only their own earlier output (eval only with
--overwrite); and a SIGKILL at any point of the write leaves every earlier output intact."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speculators.cli import main as cli_main
from speculators.format import validate_checkpoint
from speculators.format.validate import errors
from tests.conftest import REPO_ROOT
from tests.export.conftest import build_draft, make_run
from tests.test_cli_errors import one_error_line

EVAL_ARGS = ["--max-prompts", "1", "--max-new-tokens", "2", "-k", "1", "--batch-size", "1", "--no-oracle"]
EVAL_ARGS += ["--dtype", "float32", "--threads", "1"]


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) by relative path, with its content's hash."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, verifier_dir) -> Path:
    drafts = {step: build_draft(verifier_dir, seed=step) for step in (10, 20)}
    return make_run(tmp_path_factory.mktemp("runs") / "run", str(verifier_dir), drafts, best_step=20)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, run_dir) -> Path:
    """An earlier export of the run, with a model card."""
    out = tmp_path_factory.mktemp("exports") / "export"
    assert cli_main(["export", str(run_dir), str(out), "--dtype", "float32"]) == 0
    return out


# ---- export -------------------------------------------------------------------------------------------------
def test_export_onto_its_own_run_directory_is_refused_and_the_run_survives(run_dir, capsys):
    before = tree(run_dir)
    assert cli_main(["export", str(run_dir), str(run_dir)]) == 1
    line = one_error_line(capsys)
    assert f"{run_dir} is the source" in line and str(run_dir / "export") in line
    assert tree(run_dir) == before


def test_export_onto_a_directory_that_holds_the_source_is_refused(run_dir, capsys):
    before = tree(run_dir.parent)
    assert cli_main(["export", str(run_dir / "checkpoints" / "step-20"), str(run_dir)]) == 1
    assert "contains the source" in one_error_line(capsys)
    assert tree(run_dir.parent) == before


def test_export_into_a_foreign_non_empty_directory_is_refused(run_dir, tmp_path, capsys):
    target = tmp_path / "notes"
    target.mkdir()
    (target / "todo.txt").write_text("keep me")
    assert cli_main(["export", str(run_dir), str(target)]) == 1
    line = one_error_line(capsys)
    assert "not empty" in line and "todo.txt" in line and "new or empty directory" in line
    assert (target / "todo.txt").read_text() == "keep me" and [p.name for p in target.iterdir()] == [
        "todo.txt"
    ]


def test_export_onto_a_file_is_refused_and_leaves_no_hidden_copy(run_dir, tmp_path, capsys):
    target = tmp_path / "draft.bin"
    target.write_bytes(b"precious")
    assert cli_main(["export", str(run_dir), str(target)]) == 1
    assert "is a file" in one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft.bin"] and target.read_bytes() == b"precious"


def test_an_earlier_export_is_replaced_and_the_command_says_so(run_dir, exported, tmp_path, capsys):
    out = tmp_path / "export"
    assert cli_main(["export", str(run_dir), str(out), "--dtype", "float32"]) == 0
    assert "replaced" not in capsys.readouterr().out
    assert cli_main(["export", str(run_dir), str(out), "--speculative-tokens", "2"]) == 0
    assert "it replaced the earlier export there" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_earlier_export_with_a_users_file_in_it_is_not_replaced(run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    assert cli_main(["export", str(run_dir), str(out)]) == 0
    (out / "my_benchmarks.csv").write_text("k,al\n3,2.1\n")
    before = tree(out)
    assert cli_main(["export", str(run_dir), str(out)]) == 1
    assert "my_benchmarks.csv" in one_error_line(capsys)
    assert tree(out) == before


def test_zero_speculative_tokens_is_refused_not_ignored(run_dir, tmp_path, capsys):
    assert cli_main(["export", str(run_dir), str(tmp_path / "out"), "--speculative-tokens", "0"]) == 1
    assert "--speculative-tokens 0" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_a_verifier_path_that_does_not_exist_is_named(run_dir, tmp_path, capsys):
    for missing in ("/no/such/verifier", "../no-such-verifier"):
        assert cli_main(["export", str(run_dir), str(tmp_path / "out"), "--verifier", missing]) == 1
        assert f"verifier '{missing}' does not exist here" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_k_from_eval_errors_name_their_own_flag(run_dir, tmp_path, capsys):
    results = tmp_path / "results.json"
    results.write_text("not json")
    assert cli_main(["export", str(run_dir), str(tmp_path / "out"), "--k-from-eval", str(results)]) == 1
    assert f"--k-from-eval {results}: not JSON" in one_error_line(capsys)
    assert cli_main(["export", str(run_dir), str(tmp_path / "out"), "--serve-concurrency", "0"]) == 1
    assert "--serve-concurrency 0" in one_error_line(capsys)


# ---- convert ------------------------------------------------------------------------------------------------
def test_convert_onto_itself_is_refused_and_keeps_its_card(exported, capsys):
    before = tree(exported)
    assert "README.md" in before
    assert cli_main(["convert", str(exported), str(exported)]) == 1
    assert "is the source" in one_error_line(capsys)
    assert tree(exported) == before


def test_convert_replaces_an_earlier_export_elsewhere(exported, tmp_path, capsys):
    out = tmp_path / "converted"
    assert cli_main(["convert", str(exported), str(out)]) == 0
    assert cli_main(["convert", str(exported), str(out)]) == 0
    assert "it replaced the earlier export there" in capsys.readouterr().out


# ---- eval ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eval_draft(tmp_path_factory, verifier_dir) -> Path:
    return build_draft(verifier_dir, seed=3).save_pretrained(
        tmp_path_factory.mktemp("eval") / "draft", dtype=torch.float32
    )


@pytest.fixture(scope="module")
def earlier_results(tmp_path_factory, eval_draft) -> Path:
    out = tmp_path_factory.mktemp("eval-out") / "eval"
    assert cli_main(["eval", str(eval_draft), *EVAL_ARGS, "--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["acceptance.png", "requests.jsonl", "results.json"]
    return out


def test_eval_never_overwrites_earlier_results_unasked(eval_draft, earlier_results, capsys):
    before = tree(earlier_results)
    assert cli_main(["eval", str(eval_draft), *EVAL_ARGS, "--output", str(earlier_results)]) == 1
    assert "--overwrite" in one_error_line(capsys)
    assert tree(earlier_results) == before


def test_eval_overwrite_replaces_the_whole_set(eval_draft, earlier_results, tmp_path, capsys):
    import shutil

    out = tmp_path / "eval"
    shutil.copytree(earlier_results, out)
    before = tree(out)
    argv = ["eval", str(eval_draft), *EVAL_ARGS, "--max-new-tokens", "3", "--output", str(out), "--overwrite"]
    assert cli_main(argv) == 0
    after = tree(out)
    assert sorted(after) == sorted(before) and after["results.json"] != before["results.json"]
    assert json.loads((out / "results.json").read_text())["settings"]["max_new_tokens"] == 3


def test_eval_into_the_drafts_own_directory_is_refused(eval_draft, capsys):
    before = tree(eval_draft)
    assert cli_main(["eval", str(eval_draft), *EVAL_ARGS, "--output", str(eval_draft), "--overwrite"]) == 1
    assert "is the source" in one_error_line(capsys)
    assert tree(eval_draft) == before


@pytest.mark.parametrize("flag", [["--temperature", "-1"], ["--top-p", "0"]])
def test_eval_refuses_a_sampling_setting_it_would_misread(eval_draft, tmp_path, flag, capsys):
    assert cli_main(["eval", str(eval_draft), *flag, "--output", str(tmp_path / "out")]) == 1
    assert flag[0] in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


# ---- fault injection: SIGKILL mid-write -----------------------------------------------------------------------
def killed_at(point: str, when: str, argv: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tests.support.kill_at", point, when, "--", *argv]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == -9, result.stderr[-3000:]  # it died where it was told to
    return result


# (each kill costs a process start, ~10 s: the points are split between the two commands, which write alike)
KILL_POINTS = [
    ("export", "safetensors.torch:save_file", "after"),  # the new weights half-way into the staging directory
    ("convert", "speculators.atomic:replace_directory", "before"),  # everything staged, nothing swapped
]


@pytest.mark.parametrize(("command", "point", "when"), KILL_POINTS, ids=["export-weights", "convert-swap"])
def test_a_killed_export_or_convert_leaves_the_earlier_export_intact(
    command, point, when, run_dir, exported, tmp_path
):
    import shutil

    out = tmp_path / "export"
    shutil.copytree(exported, out)
    before = tree(out)
    source = run_dir if command == "export" else exported
    killed_at(point, when, [command, str(source), str(out), "--speculative-tokens", "2"])
    assert tree(out) == before
    assert not errors(validate_checkpoint(out))


def test_a_kill_right_after_the_swap_leaves_the_new_export_whole(run_dir, exported, tmp_path):
    import shutil

    out = tmp_path / "export"
    shutil.copytree(exported, out)
    killed_at("speculators.atomic:exchange_paths", "after", ["export", str(run_dir), str(out)])
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"  # the new export (the earlier one is float32)
    assert not errors(validate_checkpoint(out))


def test_a_killed_eval_leaves_the_earlier_results_intact(eval_draft, earlier_results, tmp_path):
    """Killed with the new table, results and plot all written (staged), just before they are swapped in."""
    import shutil

    out = tmp_path / "eval"
    shutil.copytree(earlier_results, out)
    before = tree(out)
    killed_at(
        "speculators.eval.plot:plot_acceptance",
        "after",
        ["eval", str(eval_draft), *EVAL_ARGS, "--output", str(out), "--overwrite"],
    )
    assert tree(out) == before
