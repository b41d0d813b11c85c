"""The long-lived worker protocol (``LineWorker``) against a small real worker script: replies survive being split
across pipe writes, a worker that hangs midway through a reply line times out instead of blocking forever, and a
worker killed by SIGKILL mid-session is reported with its exit status and log. (No consumer virtualenv needed.)"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from speculators.serving.worker_process import LineWorker, WorkerError

# Protocol: greet on the private fd, then answer each stdin line. "split" writes its reply in two flushed pieces,
# "hang" writes half a reply line and sleeps, "die" SIGKILLs itself after logging.
WORKER = """
import json, os, signal, sys, time
replies = os.fdopen(int(sys.argv[2]), "w")
replies.write(json.dumps({"hello": True}) + "\\n"); replies.flush()
for line in sys.stdin:
    request = json.loads(line)
    if request["do"] == "split":
        replies.write('{"answer": '); replies.flush(); time.sleep(0.2)
        replies.write(json.dumps(request["value"]) + "}\\n"); replies.flush()
    elif request["do"] == "hang":
        replies.write('{"answer": '); replies.flush(); time.sleep(60)
    elif request["do"] == "die":
        print("about to be killed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def worker_script(tmp_path: Path) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return script


def test_replies_split_across_writes_arrive_whole(worker_script):
    worker = LineWorker(Path(sys.executable), worker_script, "test worker", timeout=30)
    try:
        assert worker.greeting == {"hello": True}
        assert worker.call({"do": "split", "value": [1, 2]}, timeout=30) == {"answer": [1, 2]}
        assert worker.call({"do": "split", "value": "again"}, timeout=30) == {"answer": "again"}
    finally:
        worker.close()
    assert worker.process.returncode == 0


def test_worker_hanging_mid_line_times_out(worker_script):
    worker = LineWorker(Path(sys.executable), worker_script, "test worker", timeout=30)
    started = time.monotonic()
    with pytest.raises(WorkerError, match="did not answer within 2 s and was killed"):
        worker.call({"do": "hang"}, timeout=2)
    assert time.monotonic() - started < 20
    assert worker.process.poll() is not None


def test_worker_killed_mid_session_reports_status_and_log(worker_script):
    worker = LineWorker(Path(sys.executable), worker_script, "test worker", timeout=30)
    with pytest.raises(WorkerError, match=r"(?s)exited with status -9; log .*about to be killed") as caught:
        worker.call({"do": "die"}, timeout=30)
    kept_log = Path(str(caught.value).split("; log ", 1)[1].split(":\n", 1)[0])
    assert kept_log.is_file()
    kept_log.unlink()
