"""``train/adapt.py``: a served log to a refreshed draft, end to end on a tiny verifier (issue 41).

One parent draft (tiny EAGLE-3: data_gen, train, export) is shared by the module. The adapt command is SIGKILLed
(its whole process group, as a lost terminal or an OOM kill would) once its training has saved a checkpoint, then
run again: it continues where it stopped and finishes. The result is checked for what leaves the run: the lineage in
the config and the card, and no byte of the traffic's text (a canary planted in every prompt and answer) in any
exported file. A rerun with other settings, and a run directory inside the parent, are refused before anything is
written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from speculators.lineage import draft_hash
from tests.data_gen.conftest import chat_records, write_jsonl

REPO = Path(__file__).resolve().parents[2]
CANARY = "ZQXJ-canary-71d3"
REQUESTS = 24
WINDOW = 0.25  # the latest 6 requests are held out
START = 1_750_000_000


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "WANDB_MODE": "disabled"}  # fmt: skip


def common(verifier: Path) -> list[str]:
    return [
        "recipe=tiny_eagle3",
        f"verifier.name_or_path={verifier}",
        "verifier.dtype=float32",
        "logging=disabled",
        "train.mask_out_of_vocab=false",  # a random verifier: its argmax is rarely one of the draft's tokens
    ]


def run(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def parent(tmp_path_factory, tiny_llama_dir) -> Path:
    """A parent run with its features and an export inside it (as `make demo` leaves one)."""
    root = tmp_path_factory.mktemp("parent")
    source = write_jsonl(root / "chats.jsonl", chat_records(24, turns=1))
    run_dir = root / "run"
    overrides = [*common(tiny_llama_dir), f"run_dir={run_dir}", f"data.source={source}", "train.epochs=1"]
    run([sys.executable, "data_gen/run.py", *overrides])
    run([sys.executable, "train/run.py", *overrides])
    run([sys.executable, "-m", "speculators", "export", str(run_dir), str(run_dir / "export")])
    return run_dir


def served_log(path: Path, model: str) -> Path:
    """OpenAI chat-completion pairs, written out of time order, with the canary in every text."""
    records = []
    for i in range(REQUESTS):
        question = f"{CANARY} question {i}: what is {i} plus {i * 3}? Explain the steps."
        answer = f"{CANARY} We add {i} and {i * 3}. The sum is {i * 4}, so the answer is {i * 4}."
        records.append(
            {
                "request": {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0},
                "response": {
                    "id": f"chatcmpl-{i}",
                    "model": model,
                    "created": START + 60 * i,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                 "finish_reason": "stop"}],
                },
            }
        )  # fmt: skip
    order = list(range(0, REQUESTS, 2)) + list(range(1, REQUESTS, 2))
    return write_jsonl(path, [records[i] for i in order])


def adapt_command(verifier: Path, traffic: Path, parent: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "train/adapt.py", *common(verifier), f"run_dir={run_dir}", f"adapt.traffic={traffic}",
        f"adapt.parent={parent}", f"adapt.window={WINDOW}", "adapt.cpu_seconds=600", "adapt.epochs=2",
        "adapt.replay_share=0.25", "adapt.eval.max_prompts=2", "adapt.eval.max_new_tokens=8",
        "adapt.eval.max_prompt_tokens=96", "train.save_every=1", *extra,
    ]  # fmt: skip


def kill_once_training_saved(command: list[str], run_dir: Path, log: Path, timeout: float = 400) -> None:
    """SIGKILL the adapt command's whole process group once the training stage has saved a checkpoint."""
    with log.open("w") as stream:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=environment(),
            stdout=stream,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if any((run_dir / "checkpoints").glob("step-*")):
                break
            time.sleep(0.05)
        assert process.poll() is None, f"adapt ended before it could be killed:\n{log.read_text()[-3000:]}"
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def adapted(parent, tiny_llama_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("adapt")
    traffic = served_log(root / "traffic.jsonl", tiny_llama_dir.name)
    run_dir = root / "adapted"
    command = adapt_command(tiny_llama_dir, traffic, parent / "export", run_dir)
    kill_once_training_saved(command, run_dir, root / "killed.log")
    state = json.loads((run_dir / "adapt_state.json").read_text())
    assert set(state["done"]) == {"data"}  # killed inside the training stage
    finished = run(command)
    return {
        "run_dir": run_dir,
        "traffic": traffic,
        "output": finished.stdout,
        "parent": parent,
        "command": command,
    }


def test_a_killed_adapt_continues_where_it_stopped_and_finishes(adapted):
    state = json.loads((adapted["run_dir"] / "adapt_state.json").read_text())
    assert list(state["done"]) == ["data", "train", "export", "eval", "card"]
    assert "done in an earlier attempt" in adapted["output"]  # the data stage was not redone
    assert "acceptance length on the held-out window:" in adapted["output"]
    from speculators.format.validate import errors, validate_checkpoint

    findings = validate_checkpoint(adapted["run_dir"] / "export")
    assert not errors(findings), findings


def test_the_export_records_its_lineage_in_config_and_card(adapted):
    export = adapted["run_dir"] / "export"
    config = json.loads((export / "config.json").read_text())
    lineage = config["lineage"]
    assert lineage["parent"]["sha256"] == draft_hash(adapted["parent"] / "export")
    windows = lineage["traffic"]
    held = round(REQUESTS * WINDOW)
    assert windows["heldout"]["count"] == held and windows["adapted_on"]["count"] == REQUESTS - held
    assert windows["heldout"]["first_created"] == START + 60 * (REQUESTS - held)
    assert windows["heldout"]["last_created"] == START + 60 * (REQUESTS - 1)
    assert windows["adapted_on"]["last_created"] == START + 60 * (REQUESTS - held - 1)
    assert lineage["figures"]["window_al_before"] >= 1.0 and lineage["figures"]["window_al_after"] >= 1.0
    card = (export / "README.md").read_text()
    assert "## Lineage" in card and lineage["parent"]["sha256"] in card
    assert windows["heldout"]["sha256"] in card


def test_no_text_of_the_traffic_reaches_any_exported_byte(adapted):
    export = adapted["run_dir"] / "export"
    files = [path for path in export.rglob("*") if path.is_file()]
    assert files
    assert CANARY.encode() in adapted["traffic"].read_bytes()  # the canary is there to be found
    leaked = [str(path) for path in files if CANARY.encode() in path.read_bytes()]
    assert not leaked, f"traffic text in {leaked}"
    from speculators.export.hub import uploaded_files

    assert uploaded_files(export)  # what `speculators push` uploads: all of it checked above
    assert set(uploaded_files(export)) <= set(files)


def test_a_rerun_with_other_settings_is_refused_before_anything_is_written(adapted, tiny_llama_dir):
    state = (adapted["run_dir"] / "adapt_state.json").read_bytes()
    command = [*adapted["command"], "adapt.window=0.5"]
    result = subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "holds an adapt run with other settings" in line and "0.25" in line
    assert (adapted["run_dir"] / "adapt_state.json").read_bytes() == state


def test_a_run_directory_inside_the_parent_is_refused(parent, tiny_llama_dir, tmp_path):
    traffic = served_log(tmp_path / "traffic.jsonl", tiny_llama_dir.name)
    command = adapt_command(tiny_llama_dir, traffic, parent / "export", parent / "adapted")
    result = subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "give the adapted run a directory of its own" in result.stderr
    assert not (parent / "adapted").exists()
