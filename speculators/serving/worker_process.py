"""Running a standalone worker script in another virtualenv and exchanging JSON files with it.

The external consumers (vLLM on CPU, the ``speculators`` package) pin a torch/transformers stack that cannot live
beside ours, so each runs in its own virtualenv. We talk to them only through a request file and a result file:
no imports cross the boundary, and a crash in the consumer becomes a clear error here with the tail of its log.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

REPO_ROOT = Path(__file__).resolve().parents[2]
LOG_TAIL_LINES = 60


class ConsumerUnavailable(FileNotFoundError):
    """The virtualenv of an external consumer is missing (create it with the named make target)."""


class WorkerError(RuntimeError):
    """A worker process failed; the message carries its error and the tail of its log."""


def consumer_python(env_var: str, venv_name: str, make_target: str) -> Path:
    """The interpreter of a consumer virtualenv: ``$env_var`` if set, else ``<repo>/<venv_name>/bin/python``."""
    override = os.environ.get(env_var)
    python = Path(override) if override else REPO_ROOT / venv_name / "bin" / "python"
    if not python.exists():
        origin = f"${env_var}" if override else f"the default {venv_name}"
        raise ConsumerUnavailable(
            f"{python} does not exist ({origin}): run `make {make_target}` in {REPO_ROOT} to create it, "
            f"or point {env_var} at a Python that has it installed"
        )
    return python


def missing_consumer_is_error(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a missing consumer virtualenv must fail a test run instead of skipping its tests: under CI
    (``CI`` set to true/1/yes, as CI services do), where `make test` builds every consumer environment, a skip
    would silently drop the vLLM and speculators-package checks."""
    value = (os.environ if environ is None else environ).get("CI", "")
    return value.strip().lower() in ("1", "true", "yes")


@cache
def python_has_module(python: str, module: str) -> bool:
    """Whether ``python`` can find ``module`` (without importing it: vLLM's import alone takes seconds)."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def worker_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment minus what would leak our virtualenv into theirs, plus offline settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def run_json_worker(
    python: Path,
    script: Path,
    request: dict[str, Any],
    timeout: float,
    what: str,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``python script REQUEST.json RESULT.json`` and return the parsed result.

    The worker's stdout/stderr go to a log file (``log_path`` if given, else a temporary one that is removed on
    success). A non-zero exit, a timeout or a missing result raises :class:`WorkerError` naming the log.
    """
    workdir = Path(tempfile.mkdtemp(prefix="speculators-worker-"))
    request_path, result_path = workdir / "request.json", workdir / "result.json"
    log = Path(log_path) if log_path else workdir / "worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    request_path.write_text(json.dumps(request))
    failure = None
    try:
        with open(log, "w") as handle:
            completed = subprocess.run(
                [str(python), str(script), str(request_path), str(result_path)],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=worker_environment(env),
                timeout=timeout,
                cwd=workdir,
            )
        if completed.returncode != 0:
            failure = f"exited with status {completed.returncode}"
    except subprocess.TimeoutExpired:
        failure = f"did not finish within {timeout:.0f} s and was killed"
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    if failure is None and result is None:
        failure = "wrote no result file"
    if failure is not None:
        kept = _keep_log(log, workdir)
        raise WorkerError(f"{what} {failure}{_job_error(result)}; log {kept}:\n{_tail(kept)}")
    if log_path is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


class LineWorker:
    """A long-lived worker: ``python script --serve FD``. Requests go to its stdin, one JSON object per line; each
    gets exactly one JSON reply line on the private pipe ``FD`` (its stdout/stderr go to the log, where libraries
    print freely). The first line on the pipe is the worker's greeting. Closing stdin asks the worker to exit.

    Why: a worker that loads something expensive (vLLM: import and engine start, ~20 s on CPU) can serve many
    requests for the price of one start.
    """

    def __init__(
        self,
        python: Path,
        script: Path,
        what: str,
        timeout: float,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.what = what
        self.workdir = Path(tempfile.mkdtemp(prefix="speculators-worker-"))
        self.log = Path(log_path) if log_path else self.workdir / "worker.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        read_fd, write_fd = os.pipe()
        with open(self.log, "w") as handle:
            self.process = subprocess.Popen(
                [str(python), str(script), "--serve", str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=worker_environment(env),
                cwd=self.workdir,
                pass_fds=(write_fd,),
                text=True,
            )
        os.close(write_fd)
        self._replies_fd = read_fd
        self._pending = b""  # bytes read past the last complete reply line
        self.greeting = self._reply(timeout)

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request and wait (at most ``timeout`` s) for its reply."""
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the worker is gone: reading its reply reports why
        return self._reply(timeout)

    def _reply(self, timeout: float) -> dict[str, Any]:
        """The next reply line. The pipe is read in chunks against one deadline, so a worker that hangs midway
        through a line times out like one that never starts it."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._replies_fd], [], [], remaining)[0]:
                self.process.kill()
                self._fail(f"did not answer within {timeout:.0f} s and was killed")
            chunk = os.read(self._replies_fd, 1 << 16)
            if not chunk:
                self._fail(f"exited with status {self.process.wait()}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def _fail(self, failure: str) -> NoReturn:
        self.close(keep_log=True)
        kept = _keep_log(self.log, self.workdir)
        raise WorkerError(f"{self.what} {failure}; log {kept}:\n{_tail(kept)}")

    def close(self, keep_log: bool = False) -> None:
        """Ask the worker to exit (kill it if it does not within a minute) and clean up."""
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        if self._replies_fd is not None:
            os.close(self._replies_fd)
            self._replies_fd = None
        if self.log.parent != self.workdir or not keep_log:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _job_error(result: dict[str, Any] | None) -> str:
    """The first failed job's error, if the worker got as far as reporting it."""
    for job in (result or {}).get("jobs", []):
        if not job.get("ok", True):
            return f" in job {job.get('name')!r}: {job.get('error')}\n{job.get('traceback', '')}"
    if result and result.get("error"):
        return f": {result['error']}\n{result.get('traceback', '')}"
    return ""


def _keep_log(log: Path, workdir: Path) -> Path:
    """Move a temporary log out of the work directory so it survives for inspection."""
    if log.parent != workdir:
        return log
    kept = Path(tempfile.gettempdir()) / f"{workdir.name}.log"
    shutil.move(str(log), kept)
    shutil.rmtree(workdir, ignore_errors=True)
    return kept


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-LOG_TAIL_LINES:])
