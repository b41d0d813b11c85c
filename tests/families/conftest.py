"""One tiny verifier directory per declared family, built once per session and shared by every family test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.families import build_family_verifier


@pytest.fixture(scope="session")
def family_verifier(tmp_path_factory) -> Callable[[str], Path]:
    """``family_verifier(model_type)`` → the directory of that family's tiny random verifier (built on first use)."""
    root = tmp_path_factory.mktemp("family-verifiers")
    built: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in built:
            built[model_type] = build_family_verifier(root / model_type, model_type)
        return built[model_type]

    return get
