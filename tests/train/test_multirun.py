"""Hydra --multirun sweeps of 2 jobs: in one process (accelerate state reset between jobs) and with the accelerate
launcher plugin (every job its own 2-process `accelerate launch`). Each job gets its own complete run directory
and the recipe's shared data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT
from tests.train.conftest import launch_env


def sweep(tmp: Path, verifier: Path, data: Path, *extra: str) -> list[Path]:
    command = [
        sys.executable,
        str(REPO_ROOT / "train" / "run.py"),
        "--multirun",
        *extra,
        "recipe=tiny_eagle3",
        f"verifier.name_or_path={verifier}",
        f"train.data_dir={data}",
        f"output_root={tmp}",
        "logging=disabled",
        "train.epochs=1",
        "optim.lr=1e-3,2e-3",
    ]
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=launch_env(tmp), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (sweep_dir,) = (tmp / "tiny_eagle3" / "multirun").iterdir()
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir())


@pytest.mark.parametrize("launcher", ["in_process", "accelerate"])
def test_multirun_two_jobs_each_with_its_own_run_dir(launcher, sharp_verifier, tiny_data, tmp_path):
    extra = (
        [] if launcher == "in_process" else ["hydra/launcher=accelerate", "hydra.launcher.num_processes=2"]
    )
    jobs = sweep(tmp_path, sharp_verifier, tiny_data, *extra)
    assert [job.name for job in jobs] == ["0", "1"]
    learning_rates = []
    for job in jobs:
        config = yaml.safe_load((job / "config.yaml").read_text())
        assert config["run_dir"] == str(job)
        assert config["train"]["data_dir"] == str(tiny_data)  # jobs share the recipe's features
        learning_rates.append(config["optim"]["lr"])
        best = json.loads((job / "checkpoints" / "best.json").read_text())
        assert (job / best["path"] / "draft" / "model.safetensors").is_file()
        steps = [json.loads(line)["step"] for line in (job / "metrics.jsonl").read_text().splitlines()]
        assert steps and max(steps) == (4 if launcher == "in_process" else 2)  # global batch 2 vs 4
    assert learning_rates == [1e-3, 2e-3]
