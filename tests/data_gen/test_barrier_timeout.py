"""The data-generation process group waits as long as the recipe says (``data_gen.barrier_timeout_hours``).

Two gloo processes; rank 1 reaches the barrier 4 s late. With a 1 s configured timeout rank 0's barrier fails;
with 1 minute both pass. torch's default (30 min) would pass both, so the first case proves the setting reaches
the process group, and the second that it is what lets a late rank through.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from data_gen.pipeline import GenSettings
from tests.conftest import REPO_ROOT

RANK_SCRIPT = """
import sys, time
from data_gen.processes import data_gen_state
state = data_gen_state(float(sys.argv[1]), cpu=True)
if state.process_index == 1:
    time.sleep(4)
try:
    state.wait_for_everyone()
    print("passed", flush=True)
except Exception as error:
    print("timed out:", type(error).__name__, flush=True)
    sys.exit(3)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_pair(hours: float) -> list[subprocess.CompletedProcess]:
    port = str(free_port())
    processes = []
    for rank in range(2):
        env = {
            **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT, str(hours)],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        )
    results = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return results


def test_a_short_configured_timeout_reaches_the_barrier():
    rank0, _ = run_pair(1 / 3600)  # 1 s
    assert rank0.returncode == 3 and "timed out" in rank0.stdout, rank0.stdout + rank0.stderr[-2000:]


def test_a_late_rank_passes_within_the_configured_timeout():
    rank0, rank1 = run_pair(1 / 60)  # 1 min
    assert "passed" in rank0.stdout and "passed" in rank1.stdout, rank0.stderr[-2000:] + rank1.stderr[-2000:]


def test_the_timeout_is_a_recipe_setting_sized_in_hours():
    assert GenSettings.from_mapping({}).barrier_timeout_hours >= 12
    assert GenSettings.from_mapping({"barrier_timeout_hours": 2}).barrier_timeout_hours == 2
    with pytest.raises(ValueError, match="barrier_timeout_hours"):
        GenSettings.from_mapping({"barrier_timeout_hours": 0})
