"""Tests that need a consumer virtualenv (vLLM, the speculators package) go through ONE rule, ``require_consumer``
in tests/conftest.py: skip on a developer's machine, fail under ``CI=true``. A bare ``pytest.skip``,
``importorskip`` or ``skipif`` would make them vanish from CI unnoticed (issue 24), so this test reads every test
file's syntax tree and refuses any skip outside the allow-list below, and any consumer availability check whose
answer does not go straight into ``require_consumer``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

TESTS = REPO_ROOT / "tests"
SKIP_CALLS = {"skip", "importorskip", "xfail"}  # pytest.<name>(...)
SKIP_MARKS = {"skip", "skipif", "xfail"}  # pytest.mark.<name>
AVAILABILITY_CHECKS = {"vllm_available", "speculators_package_available"}
# (file relative to tests/, enclosing function) -> why a skip is legitimate there
ALLOWED_SKIPS = {
    ("conftest.py", "require_consumer"): "the one rule itself: skips locally, fails under CI=true",
}
# (file, enclosing function) -> why an availability check may stand alone there
ALLOWED_CHECKS = {
    ("consumers/test_bridge_errors.py", "test_missing_vllm_env_names_make_target"): (
        "asserts the check is False with the virtualenv removed (the error names the make target)"
    ),
    ("consumers/test_bridge_errors.py", "test_worker_crash_reports_its_error"): (
        "asserts the check is False for a fake interpreter that crashes"
    ),
}


def _name(node: ast.AST) -> str:
    """``pytest.mark.skipif`` for the attribute chain of ``node`` (calls unwrapped), else ``""``."""
    if isinstance(node, ast.Call):
        return _name(node.func)
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _enclosing(tree: ast.Module) -> dict[ast.AST, str]:
    """Every node of ``tree`` -> the name of the innermost function around it ("" at module level)."""
    owner: dict[ast.AST, str] = {}

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            owner[child] = name
            visit(child, name)

    visit(tree, "")
    return owner


def violations(path: Path, root: Path = TESTS) -> list[str]:
    """Every skip outside :data:`ALLOWED_SKIPS` and every availability check not fed to ``require_consumer``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(root).as_posix()
    owner = _enclosing(tree)
    fed_to_rule = {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _name(node).split(".")[-1] == "require_consumer"
        for arg in node.args
    }
    found = []
    for node in ast.walk(tree):
        name = _name(node) if isinstance(node, (ast.Call, ast.Attribute)) else ""
        parts = name.split(".")
        where = (rel, owner.get(node, ""))
        is_skip = (isinstance(node, ast.Call) and parts[:1] == ["pytest"] and parts[-1] in SKIP_CALLS) or (
            isinstance(node, ast.Attribute) and parts[:2] == ["pytest", "mark"] and node.attr in SKIP_MARKS
        )
        if is_skip and where not in ALLOWED_SKIPS:
            found.append(f"{rel}:{node.lineno} {name}: use require_consumer (tests/conftest.py)")
        is_check = isinstance(node, ast.Call) and parts[-1] in AVAILABILITY_CHECKS
        if is_check and id(node) not in fed_to_rule and where not in ALLOWED_CHECKS:
            found.append(f"{rel}:{node.lineno} {name}() not passed to require_consumer")
    return found


@pytest.mark.parametrize("path", sorted(TESTS.rglob("*.py")), ids=lambda p: p.relative_to(TESTS).as_posix())
def test_no_skip_outside_the_one_rule(path):
    assert violations(path) == []


def test_the_scan_finds_each_kind_of_bare_skip(tmp_path):
    """The scanner itself, on the patterns issue 24 found: a plain skip after an availability check, an
    importorskip, a skipif mark; and the one rule passes."""
    probe = tmp_path / "consumers" / "test_probe.py"
    probe.parent.mkdir()
    probe.write_text(
        "import pytest\n"
        "from speculators.serving.vllm_bridge import vllm_available\n"
        "from tests.conftest import require_consumer\n"
        "@pytest.mark.skipif(True, reason='x')\n"
        "def test_a():\n"
        "    if not vllm_available():\n"
        "        pytest.skip('the vLLM virtualenv is missing')\n"
        "    helpers = pytest.importorskip('tests.train.conftest')\n"
        "def test_b():\n"
        "    require_consumer(vllm_available(), 'the vLLM virtualenv', 'vllm-env')\n"
    )
    found = violations(probe, tmp_path)
    assert len(found) == 4, found
    assert any("skipif" in f for f in found) and any("importorskip" in f for f in found)
    assert any("pytest.skip" in f for f in found) and any("vllm_available()" in f for f in found)
    assert not any(":10 " in f for f in found)  # test_b's check goes to the rule
