"""Committed bench results are read by strangers: they must not name the machine that produced them (a home
directory, a checkout's absolute location, an interpreter path). Commands are recorded repo-relative."""

from __future__ import annotations

import pytest

from speculators.local_paths import file_text, find_local_paths, scrub
from tests.conftest import REPO_ROOT

RESULTS = sorted(p for p in (REPO_ROOT / "bench" / "results").iterdir() if p.is_file())


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_committed_result_file_holds_no_local_path(path):
    assert find_local_paths(file_text(path)) == []


def test_a_recorded_command_is_made_repo_relative():
    """What the bench writers do to a command before it lands in a result file."""
    command = (
        f"{REPO_ROOT}/.venv/bin/python train/run.py run_dir={REPO_ROOT}/outputs/x data=/home/alice/chats"
    )
    assert scrub(command, REPO_ROOT) == ".venv/bin/python train/run.py run_dir=outputs/x data=<local>/chats"
