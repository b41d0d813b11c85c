"""Shared fixtures: verifiers and a helper to build a draft for them. Everything is local; nothing reaches a hub."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
# "auto" picks bf16 on CPUs with avx512_bf16/AMX (speculators.precision): the suite's exact comparisons (greedy
# identity, resume bit-exactness, 1 vs 2 processes) were written for fp32 and must not depend on the CPU that runs
# them. Tests of the hardware rule pass their own environment; tests of bf16 set the recipe key.
os.environ.setdefault("SPECULATORS_COMPUTE_DTYPE", "float32")

REPO_ROOT = Path(__file__).resolve().parents[1]
# modules that share session fixtures too costly to build twice: the conformance suite's fits every unit and starts
# one vLLM worker and one speculators-package interpreter for both (its resume module has fixtures of its own)
SHARED_SESSION_GROUPS = {
    "tests/conformance/test_conformance.py": "conformance",
    "tests/conformance/test_consumers.py": "conformance",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``) every test joins a group that one worker
    runs whole: its module (a module fixture fits a draft or starts a consumer once, not once per worker), or the
    modules that share costly session fixtures. Before xdist reads the groups, hence ``tryfirst``."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        path = item.nodeid.split("::")[0]
        group = SHARED_SESSION_GROUPS.get(path, path)
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session) -> None:
    """Stop at once if xdist did not take the groups: it groups by a suffix on each node id, and a pytest whose node
    ids it cannot rewrite (pytest 9 with xdist 3.8) silently deals one module's tests to both workers, so every costly
    module and session fixture is built twice (measured: the conformance fits and vLLM session, ~10 min more)."""
    if not (os.environ.get("PYTEST_XDIST_WORKER") and session.config.getvalue("loadgroup")):
        return
    ungrouped = [item.nodeid for item in session.items if "@" not in item.nodeid.rpartition("]")[2]]
    if ungrouped:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(ungrouped)} tests (e.g. {ungrouped[0]}): pytest "
            f"{pytest.__version__} is not one its --dist loadgroup works with; install the pins of pyproject.toml's "
            "dev extra (make setup)"
        )


def pytest_configure(config) -> None:
    """An xdist worker computes on one thread: two workers share the two cores instead of four OpenMP threads
    waiting out each other's scheduler slices (the same reason vLLM's worker runs on one, speculators.serving)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def require_consumer(available: bool, what: str, make_target: str) -> None:
    """Skip a test whose consumer virtualenv is missing, or fail it under ``CI=true`` (where `make test` built
    every consumer environment, so a missing one is a broken set-up, not an optional check)."""
    from speculators.serving.worker_process import missing_consumer_is_error

    if available:
        return
    message = f"{what} is missing: run `make {make_target}`"
    if missing_consumer_is_error():
        pytest.fail(f"{message} (CI is set: a missing consumer environment is an error, not a skip)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded verifier (SmolLM2-135M-Instruct) as a cached HF directory."""
    from speculators.verifier import embedded_verifier_dir

    return embedded_verifier_dir()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random 8-layer Llama verifier (hidden 64, 2 heads of 32: servable by vLLM on CPU) that shares SmolLM2's tokenizer and chat template."""
    from tests.support.verifiers import build_tiny_verifier

    return build_tiny_verifier(
        tmp_path_factory.mktemp("verifiers") / "tiny-llama",
        arch="llama",
        tokenizer=smollm2_tokenizer,
        vocab_size=len(smollm2_tokenizer),
    )


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random 8-layer Qwen3 verifier (q/k norms) sharing SmolLM2's tokenizer."""
    from tests.support.verifiers import build_tiny_verifier

    return build_tiny_verifier(
        tmp_path_factory.mktemp("verifiers") / "tiny-qwen3",
        arch="qwen3",
        tokenizer=smollm2_tokenizer,
        vocab_size=len(smollm2_tokenizer),
    )


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen3-Next verifier with an MTP layer (4 layers): what an MTP recipe fine-tunes."""
    from tests.support.mtp import build_tiny_mtp_verifier

    return build_tiny_mtp_verifier(tmp_path_factory.mktemp("verifiers") / "tiny-qwen3-next")
