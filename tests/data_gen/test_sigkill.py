"""A real ``data_gen/run.py`` process SIGKILLed while it writes shards resumes to the very bytes of a run that was
never interrupted: no sample lost, none duplicated (the in-process resume test only raises an exception, which runs
every ``finally``; a SIGKILL runs nothing)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_gen.store import FeatureDataset, read_manifest
from tests.data_gen.conftest import chat_records, write_jsonl

REPO = Path(__file__).resolve().parents[2]
CONVERSATIONS = 96
SHARD_SIZE = 2  # many small shards: a wide window in which to kill the run part-way
# written once the output is complete; they name the output dir or the wall time, so they differ between runs
RUN_SPECIFIC = ("recipe.json", "summary.json")


def data_gen_command(verifier: Path, source: Path, root: Path) -> list[str]:
    return [
        sys.executable,
        "data_gen/run.py",
        "recipe=tiny_eagle3",
        f"run_dir={root}",
        f"verifier.name_or_path={verifier}",
        "verifier.dtype=float32",
        f"data.source={source}",
        f"data.max_conversations={CONVERSATIONS}",
        "data.max_length=96",
        f"data_gen.output_dir={root / 'data'}",
        f"data_gen.shard_size={SHARD_SIZE}",
        "data_gen.batch_size=2",
    ]


def environment() -> dict[str, str]:
    # one thread in every run: the same kernels, so the same bf16 bytes (as tests/data_gen/test_multiprocess.py)
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_to_completion(command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def kill_mid_shard(command: list[str], train: Path, log: Path, timeout: float = 240) -> str:
    """Start the run, SIGKILL it once a few shards are done and the next one is half-written (its temporary file
    exists), or else once more are done (it is then working on the next); returns which of the two it caught."""
    with log.open("w") as stream:
        process = subprocess.Popen(
            command, cwd=REPO, env=environment(), stdout=stream, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + timeout
    caught = None
    try:
        while caught is None and time.monotonic() < deadline and process.poll() is None:
            names = [entry.name for entry in os.scandir(train)] if train.is_dir() else []
            done = sum(name.startswith("shard-") and name.endswith(".json") for name in names)
            if done >= 2 and any(
                name.startswith(".shard-") and ".safetensors.tmp-" in name for name in names
            ):
                caught = "a shard half-written"
            elif done >= 8:
                caught = "between two shards"
            else:
                time.sleep(0.0005)
        assert caught is not None, (
            f"the run ended (rc {process.poll()}) before it could be killed:\n{log.read_text()[-3000:]}"
        )
        process.send_signal(signal.SIGKILL)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    return caught


def output_bytes(data: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(data)): p.read_bytes()
        for p in sorted(data.rglob("*"))
        if p.is_file() and p.name not in RUN_SPECIFIC
    }


@pytest.mark.slow  # three data_gen processes (each ~10 s to start: torch, transformers, Hydra)
def test_sigkilled_data_gen_resumes_to_the_bytes_of_an_uninterrupted_run(tiny_llama_dir, tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", chat_records(CONVERSATIONS, turns=2))
    reference = tmp_path / "reference"
    run_to_completion(data_gen_command(tiny_llama_dir, source, reference))

    killed = tmp_path / "killed"
    command = data_gen_command(tiny_llama_dir, source, killed)
    caught = kill_mid_shard(command, killed / "data" / "train", tmp_path / "killed.log")
    train = killed / "data" / "train"
    records = sorted(train.glob("shard-*.json"))
    total = read_manifest(reference / "data" / "train")["num_shards"]
    assert not (train / "manifest.json").exists() and 0 < len(records) < total, caught

    resumed = run_to_completion(command)
    assert f"resuming, {len(records)} of" in resumed.stdout + resumed.stderr, caught
    ours, theirs = output_bytes(killed / "data"), output_bytes(reference / "data")
    assert sorted(ours) == sorted(theirs)  # no temporary left, no shard missing or extra
    for name, content in theirs.items():
        assert ours[name] == content, f"{name} differs after the resume ({caught})"
    expected = [record["id"] for record in chat_records(CONVERSATIONS, turns=2)]
    ids = [i for split in ("train", "heldout") for i in FeatureDataset(killed / "data" / split).sample_ids]
    assert sorted(ids) == sorted(expected)  # every conversation exactly once (whole mode: one sample each)
