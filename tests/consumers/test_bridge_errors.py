"""The bridges fail clearly: a missing consumer virtualenv names its make target; a worker that crashes surfaces
its error and log tail instead of an empty result. (No engine starts here: these take well under a second.)"""

from __future__ import annotations

import sys

import pytest

from speculators.serving import (
    ConsumerUnavailable,
    VllmError,
    VllmRequest,
    VllmSession,
    WorkerError,
    generate_with_vllm,
    load_with_speculators_package,
    vllm_available,
)

pytestmark = pytest.mark.consumer


def test_missing_vllm_env_names_make_target(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULATORS_VLLM_PYTHON", str(tmp_path / "absent" / "python"))
    assert not vllm_available()
    with pytest.raises(ConsumerUnavailable, match=r"make vllm-env.*SPECULATORS_VLLM_PYTHON"):
        generate_with_vllm(VllmRequest(model=tmp_path, prompts=["hi"]))


def test_missing_speculators_env_names_make_target(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULATORS_PKG_PYTHON", str(tmp_path / "absent" / "python"))
    with pytest.raises(ConsumerUnavailable, match="make speculators-env"):
        load_with_speculators_package(tmp_path)


def test_worker_crash_reports_its_error(monkeypatch, tmp_path):
    # Our own interpreter has no vLLM: the worker dies on `import vllm`, and the error says so.
    monkeypatch.setenv("SPECULATORS_VLLM_PYTHON", sys.executable)
    assert not vllm_available()
    with pytest.raises(VllmError, match="ModuleNotFoundError.*vllm") as caught:
        generate_with_vllm(VllmRequest(model=tmp_path, prompts=["hi"]), timeout=60)
    assert isinstance(caught.value, WorkerError)


def test_session_worker_crash_reports_its_error(monkeypatch, tmp_path):
    # The long-lived worker dies the same way; the session says so instead of waiting for a reply.
    monkeypatch.setenv("SPECULATORS_VLLM_PYTHON", sys.executable)
    with VllmSession(timeout=60) as session:
        with pytest.raises(VllmError, match="(?s)exited with status 1.*ModuleNotFoundError.*vllm"):
            session.run(VllmRequest(model=tmp_path, prompts=["hi"]))
