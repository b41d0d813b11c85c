"""A user's mistake on any ``speculators`` subcommand ends in one ``error:`` line that names the file and the fix,
and exit status 1, never a traceback. A verifier directory given where a draft belongs is recognised from its
config.json alone: its weights (16 GB for an 8B model) are never read."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from speculators.cli import main as cli_main
from tests.conftest import REPO_ROOT


@pytest.fixture
def verifier_dir(tmp_path) -> Path:
    """A verifier-shaped directory whose weights are not safetensors at all: reading them would raise."""
    directory = tmp_path / "Llama-3.1-8B-Instruct"
    directory.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"\xff" * 64)  # what a read would choke on
    return directory


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_eval_of_a_verifier_dir_checks_its_config_before_any_weight(verifier_dir, tmp_path, capsys):
    status = cli_main(["eval", str(verifier_dir), "--output", str(tmp_path / "out"), "--no-plain"])
    assert status == 1
    line = one_error_line(capsys)
    assert str(verifier_dir / "config.json") in line
    assert "this is a model (llama), not a speculators draft" in line and "--verifier" in line
    assert not (tmp_path / "out").exists()


def test_export_of_a_verifier_dir_says_so(verifier_dir, tmp_path, capsys):
    assert cli_main(["export", str(verifier_dir), str(tmp_path / "out")]) == 1
    assert "not a speculators draft" in one_error_line(capsys)


def test_validate_of_a_verifier_dir_says_model_in_its_first_line(verifier_dir, capsys):
    assert cli_main(["validate", str(verifier_dir)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "this is a model (llama), not a speculators draft" in out[0]
    assert str(verifier_dir / "config.json") in out[0]
    assert len(out) == 2 and "1 error(s)" in out[1]  # no weight finding: the weights were not read


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "{missing}"],
        ["validate", "{missing}", "--verifier", "{missing}/verifier"],
        ["convert", "{missing}", "{tmp}/out"],
        ["push", "{missing}", "me/draft"],
        ["export", "{missing}", "{tmp}/out"],
    ],
    ids=lambda argv: argv[0],
)
def test_every_subcommand_reports_a_missing_path_in_one_line(argv, tmp_path, capsys):
    argv = [a.format(missing=tmp_path / "no-such-dir", tmp=tmp_path) for a in argv]
    assert cli_main(argv) == 1
    assert "no-such-dir" in one_error_line(capsys)


def test_console_script_prints_no_traceback(verifier_dir):
    """The real process: what a user sees on the terminal."""
    result = subprocess.run(
        [sys.executable, "-m", "speculators", "eval", str(verifier_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize(
    "script,override,message",
    [
        ("train/run.py", "train.ttt_steps=0", "error: invalid training settings"),
        ("data_gen/run.py", "data_gen.batch_size=0", "error: data_gen.batch_size and data_gen.shard_size"),
    ],
)
def test_pipeline_entry_points_report_a_recipe_mistake_in_one_line(script, override, message, tmp_path):
    """The Hydra entry points too: a bad override ends with the problem and exit 1, not Hydra's traceback."""
    argv = [
        sys.executable,
        str(REPO_ROOT / script),
        "recipe=tiny_eagle3",
        override,
        f"run_dir={tmp_path}/run",
    ]
    argv += [f"hydra.run.dir={tmp_path}/hydra", "train.dry_run=true"]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and message in result.stderr


@pytest.mark.parametrize(
    ("flag", "values"),
    [
        ("--concurrency", ["1", "0"]),
        ("--batch-size", ["0"]),
        ("-k", ["-1"]),
        ("--max-new-tokens", ["0"]),  # used to crash in the plot after the whole evaluation
        ("--max-prompts", ["0"]),  # used to mean "all prompts"
    ],
)
def test_eval_refuses_a_size_below_one_before_loading_anything(flag, values, tmp_path, capsys):
    """A batch of 0 would never finish a sweep; said in one line before any model is read (the draft path does
    not even exist)."""
    assert cli_main(["eval", str(tmp_path / "no-such-dir"), flag, *values]) == 2
    assert f"error: {flag} takes whole numbers of at least 1" in one_error_line(capsys)


def test_eval_refuses_an_unknown_device_before_loading_anything(tmp_path, capsys):
    assert cli_main(["eval", str(tmp_path / "no-such-dir"), "--device", "gpu0"]) == 1
    assert "error: --device 'gpu0': not a device" in one_error_line(capsys)


def test_a_prompt_file_that_is_not_utf8_is_named_by_line(tmp_path):
    from speculators.eval.prompts import load_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: not UTF-8 text \(byte 0xe9\); re-encode"):
        load_prompts(prompts)


@pytest.mark.parametrize("command", ["validate", "convert"])
@pytest.mark.parametrize(
    ("what", "says"),
    [("run", "is a training run; export it first"), ("step", "is a trainer checkpoint; export it first")],
)
def test_a_run_or_step_where_a_draft_belongs_says_export_it_first(command, what, says, tmp_path, capsys):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-10"
    (step / "state").mkdir(parents=True)
    target = run if what == "run" else step
    argv = [command, str(target)] + ([str(tmp_path / "out")] if command == "convert" else [])
    assert cli_main(argv) == 1
    captured = capsys.readouterr()
    assert (
        says in captured.out + captured.err
        and f"speculators export {target} OUT" in captured.out + captured.err
    )
    assert not (tmp_path / "out").exists()


def test_eval_with_a_verifier_path_that_does_not_exist_says_so(tmp_path, capsys):
    from speculators.verifier import resolve_verifier_path

    for missing in (str(tmp_path / "gone"), "./gone", "../gone"):
        with pytest.raises(FileNotFoundError, match=f"verifier '{re.escape(missing)}' does not exist here"):
            resolve_verifier_path(missing)
    assert resolve_verifier_path("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
