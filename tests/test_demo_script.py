"""``make demo`` (scripts/demo.sh) numbers its stages 1/N … N/N, N being how many stages it runs.

The script itself runs here, from a copy whose ``.venv`` holds stand-ins for the interpreter and ``accelerate``
that do nothing: what is under test is the script's own stage labels, not the pipeline behind them."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

from tests.conftest import REPO_ROOT

STAGE_LABEL = re.compile(r"==> \[\d\d:\d\d\] (\d+)/(\d+) ")


def _do_nothing(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_demo_stage_labels_count_one_to_the_number_of_stages(tmp_path):
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "scripts" / "demo.sh", copy / "scripts" / "demo.sh")
    for tool in ("python", "accelerate"):
        _do_nothing(copy / ".venv" / "bin" / tool)
    env = {**os.environ, "RECIPE": "eagle3_smollm2", "RUN_DIR": str(tmp_path / "run")}
    done = subprocess.run(
        ["bash", "scripts/demo.sh"], cwd=copy, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    labels = [(int(n), int(total)) for n, total in STAGE_LABEL.findall(done.stdout)]
    assert len(labels) >= 5, done.stdout  # data generation, training, export, evaluation, model card, summary
    assert labels == [(n, len(labels)) for n in range(1, len(labels) + 1)], done.stdout
