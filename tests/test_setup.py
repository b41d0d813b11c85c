"""Set-up hygiene: make asks the GPU question once per run, and tests/ is a package tree, so every helper is
imported by one module path whatever order pytest collects the directories in."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

TESTS = REPO_ROOT / "tests"


@pytest.mark.parametrize("target", ["lint", "vllm-env", "test"])
def test_make_runs_nvidia_smi_at_most_once(target, tmp_path):
    """A stand-in nvidia-smi first on PATH counts its calls (none answers: a CPU host); `make -n` parses the
    Makefile and expands every variable a run would, without building anything."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f'#!/bin/sh\necho called >> "{log}"\nexit 9\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VLLM_FLAVOUR", None)
    argv = ["make", "-n", "-B", target, f"VLLM_VENV={tmp_path / 'venv'}", f"VENV={tmp_path / 'main'}"]
    result = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().count("called") if log.exists() else 0
    assert calls <= 1, f"nvidia-smi ran {calls} times for `make {target}`"
    if target == "vllm-env":
        assert calls == 1 and "for CPU" in result.stdout  # the answer (no GPU) is used

    log.unlink(missing_ok=True)
    given = subprocess.run(
        [*argv, "VLLM_FLAVOUR=cpu"], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert given.returncode == 0 and not log.exists()  # given: never asked


def test_tests_is_a_package_tree():
    """Without __init__.py, pytest imports two directories' conftest.py both as the top-level module
    `conftest`, and which one `from conftest import ...` gets depends on collection order."""
    folders = {p.parent for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(f.relative_to(REPO_ROOT)) for f in folders if not (f / "__init__.py").is_file())
    assert missing == []


def test_nothing_imports_a_bare_conftest():
    bare = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            bare += [f"{path.relative_to(TESTS)}:{node.lineno}" for name in names if name == "conftest"]
    assert bare == []


SYS_PATH_ALLOWED = {
    "scripts/gpu_check.py": "runs on a bare GPU image where the checkout is not pip-installed"
}


def _sys_path_edits(path) -> list[int]:
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == "path"
        and isinstance(node.func.value.value, ast.Name)
        and node.func.value.value.id == "sys"
    ]


def test_no_sys_path_edits_but_the_bare_gpu_image_script():
    """speculators, data_gen and train are installed packages (`pip install -e .`): an edit of sys.path only hides
    a broken install. scripts/gpu_check.py keeps one, and says why next to it."""
    edits = {}
    for folder in ("bench", "scripts", "speculators", "data_gen", "train", "tests"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            rel = path.relative_to(REPO_ROOT).as_posix()
            if (lines := _sys_path_edits(path)) and rel not in SYS_PATH_ALLOWED:
                edits[rel] = lines
    assert edits == {}
    gpu_check = (REPO_ROOT / "scripts" / "gpu_check.py").read_text()
    before = gpu_check[: gpu_check.index("sys.path.insert")]
    assert "bare GPU image" in before.splitlines()[-3] + before.splitlines()[-4]  # the reason, right above it


@pytest.mark.parametrize("script", ["engine_bench", "run", "data_gen_bench", "train_bench", "fp8_bench"])
def test_bench_scripts_import_from_the_installed_packages(script, tmp_path):
    """Run from outside the checkout with nothing added to the path: their imports resolve to installed packages
    (the test tree is not one, so a bench must not import it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = (
        "import runpy, sys; sys.argv = ['x', '--help'];"
        f"runpy.run_path({str(REPO_ROOT / 'bench' / (script + '.py'))!r}, run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage" in result.stdout.lower()


def test_engine_bench_fits_its_draft_without_the_test_tree_on_the_path(tmp_path):
    """engine_bench's default draft comes from tests/support/quickfit.py, loaded from its file."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = "from bench.engine_bench import _quickfit; print(_quickfit().fit_draft.__name__)"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["fit_draft"]
