"""Two ranks under ``accelerate launch`` (CPU, gloo) write the same samples as one process, through the Hydra entry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from data_gen.store import FeatureDataset, read_manifest, read_token_counts
from tests.data_gen.conftest import chat_records, write_jsonl
from train.assemble import free_port

REPO = Path(__file__).resolve().parents[2]


def launch(processes: int, verifier: Path, source: Path, out: Path, tmp: Path) -> subprocess.CompletedProcess:
    overrides = [
        "recipe=eagle3_smollm2",
        f"verifier.name_or_path={verifier}",
        "verifier.dtype=float32",
        f"data.source={source}",
        "data.heldout_fraction=0.25",
        "data.max_length=80",
        f"data_gen.output_dir={out}",
        "data_gen.shard_size=3",
        "data_gen.batch_size=2",
        f"hydra.run.dir={tmp / 'hydra'}",  # one dir for all ranks (docs/environment.md)
    ]
    if processes == 1:
        command = [sys.executable, "data_gen/run.py", *overrides]
    else:
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), "data_gen/run.py", *overrides,
        ]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_two_ranks_write_the_same_samples_as_one(tiny_llama_dir, tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", chat_records(16, turns=2))
    one = launch(1, tiny_llama_dir, source, tmp_path / "one", tmp_path / "h1")
    two = launch(2, tiny_llama_dir, source, tmp_path / "two", tmp_path / "h2")
    assert "data_gen done" in one.stdout and two.stdout.count("data_gen done") == 1  # rank 0 alone reports
    for split in ("train", "heldout"):
        a, b = FeatureDataset(tmp_path / "one" / split), FeatureDataset(tmp_path / "two" / split)
        assert a.sample_ids == b.sample_ids and len(set(a.sample_ids)) == len(a.sample_ids)
        assert read_manifest(tmp_path / "one" / split)["num_shards"] >= (3 if split == "train" else 1)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
            torch.testing.assert_close(x["aux_hidden"], y["aux_hidden"], rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(x["last_hidden"], y["last_hidden"], rtol=1e-2, atol=1e-2)
    assert torch.equal(read_token_counts(tmp_path / "one")[0], read_token_counts(tmp_path / "two")[0])
    # same threads (OMP_NUM_THREADS=1) and the same batches per shard: the very same bytes
    for split in ("train", "heldout"):
        digests = [
            [s["sha256"] for s in read_manifest(tmp_path / run / split)["shards"]] for run in ("one", "two")
        ]
        assert digests[0] == digests[1]
