"""The import graph of the repository's own code: one-way layers and no circles (issue 30).

Layers, bottom to top: the library ``speculators/`` → ``data_gen/`` → ``train/`` → ``bench/`` and ``scripts/``. A
lower layer never imports a higher one, and no files import each other in a loop. Imports inside functions count
too: a function-level import hides a circle from Python's import machinery, not from the reader, and the next
module-level import of either side turns it into an ImportError. The library must also stay servable without the
training stack, so it never imports deepspeed, hydra, omegaconf or wandb, not even lazily (the export test
checks the same at run time for one command; this checks every file).

Everything is read with ``ast``; nothing is imported, so the test is fast and sees every branch.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"speculators": 0, "data_gen": 1, "train": 2, "bench": 3, "scripts": 3}
TRAINING_ONLY = ("deepspeed", "hydra", "omegaconf", "wandb")
# The one deliberate exception: exporting a DeepSpeed ZeRO checkpoint needs DeepSpeed's own shard gatherer, imported
# inside the one function that gathers (with an install hint when it is missing); every other export path runs
# without it (tests/export/test_export.py runs the export command with deepspeed, hydra and wandb blocked).
LAZY_TRAINING_IMPORTS = {("speculators/export/zero.py", "deepspeed.utils.zero_to_fp32")}


@dataclass(frozen=True)
class Import:
    """One import statement's target: the module as written (absolute) and the names taken from it."""

    source: Path
    line: int
    module: str
    names: tuple[str, ...]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def file_of(module: str, root: Path) -> Path | None:
    """The repository file a module name loads, or None for anything outside the layers (installed packages)."""
    if module.split(".")[0] not in LAYERS:
        return None
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def absolute(node: ast.ImportFrom, path: Path, root: Path) -> str:
    """``from .x import y`` as the absolute module it names (relative to the importing file's package)."""
    if not node.level:
        return node.module or ""
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def imports_of(path: Path, root: Path) -> Iterator[Import]:
    """Every import in the file, at any depth (functions, branches), plus ``importlib.import_module("constant")``."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, alias.name, ())
        elif isinstance(node, ast.ImportFrom):
            yield Import(path, node.lineno, absolute(node, path, root), tuple(a.name for a in node.names))
        elif isinstance(node, ast.Call) and _called_name(node.func) in ("import_module", "__import__"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                yield Import(path, node.lineno, node.args[0].value, ())


def _called_name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def edges_of(item: Import, root: Path) -> Iterator[tuple[Path, str]]:
    """(file, name) pairs one import ties its file to: ``from pkg import sub`` reaches ``pkg/sub.py`` when
    ``sub`` is a module, else ``pkg``'s own file with the name ``sub``."""
    for name in item.names or ("",):
        target = file_of(f"{item.module}.{name}", root) if name and name != "*" else None
        if target is not None:
            yield target, name
            continue
        target = file_of(item.module, root)
        if target is not None:
            yield target, name or item.module


def layer_files(root: Path) -> list[Path]:
    return sorted(p for layer in LAYERS for p in (root / layer).rglob("*.py") if "__pycache__" not in p.parts)


def layer_of(path: Path, root: Path) -> int:
    return LAYERS[path.relative_to(root).parts[0]]


def import_graph(root: Path) -> dict[Path, dict[Path, list[tuple[int, str]]]]:
    """file → imported file → [(line, name)] over every file of the layers (self-imports left out)."""
    graph: dict[Path, dict[Path, list[tuple[int, str]]]] = {}
    for path in layer_files(root):
        targets = graph.setdefault(path, {})
        for item in imports_of(path, root):
            for target, name in edges_of(item, root):
                if target != path:
                    targets.setdefault(target, []).append((item.line, name))
    return graph


def circles(graph: dict[Path, dict[Path, list[tuple[int, str]]]]) -> list[list[Path]]:
    """The strongly connected components with more than one file (Tarjan, iterative: the graph is deep)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found: list[list[Path]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph.get(start, {})))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe_circle(component: list[Path], graph, root: Path) -> str:
    """The circle's files and, for each tie inside it, the names the importer takes and where."""
    members = set(component)
    lines = ["circle: " + ", ".join(str(p.relative_to(root)) for p in component)]
    for source in component:
        for target, uses in sorted(graph[source].items()):
            if target in members:
                names = ", ".join(sorted({name for _, name in uses}))
                at = ", ".join(str(line) for line in sorted({line for line, _ in uses}))
                lines.append(
                    f"  {source.relative_to(root)} -> {target.relative_to(root)}: {names} (line {at})"
                )
    return "\n".join(lines)


def upward_imports(graph, root: Path) -> list[str]:
    return [
        f"{source.relative_to(root)}:{line} imports {target.relative_to(root)} ({name}): a lower layer "
        f"({source.relative_to(root).parts[0]}/) must not import a higher one ({target.relative_to(root).parts[0]}/)"
        for source, targets in graph.items()
        for target, uses in targets.items()
        if layer_of(target, root) > layer_of(source, root)
        for line, name in uses
    ]


# ---- the repository --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph():
    return import_graph(REPO_ROOT)


def test_no_file_imports_itself_back_through_a_circle(graph):
    found = circles(graph)
    assert not found, "import circles (function-level imports count):\n" + "\n".join(
        describe_circle(c, graph, REPO_ROOT) for c in found
    )


def test_no_layer_imports_a_higher_one(graph):
    found = upward_imports(graph, REPO_ROOT)
    assert not found, "imports running back up the layers:\n" + "\n".join(found)


def test_the_library_imports_no_training_stack():
    found = [
        f"{item.source.relative_to(REPO_ROOT)}:{item.line} imports {item.module}"
        for path in (REPO_ROOT / "speculators").rglob("*.py")
        for item in imports_of(path, REPO_ROOT)
        if item.module.split(".")[0] in TRAINING_ONLY
        and (str(item.source.relative_to(REPO_ROOT)), item.module) not in LAZY_TRAINING_IMPORTS
    ]
    assert not found, "the speculators library must serve without the training stack:\n" + "\n".join(found)


def test_the_graph_sees_the_imports_it_is_meant_to(graph):
    """Guards the checker itself: a function-level import, a relative import and ``from pkg import submodule``
    are all edges (else the tests above would pass on a blind graph)."""
    train = REPO_ROOT / "train"
    assert REPO_ROOT / "train" / "settings.py" in graph[train / "trainer.py"]
    assert REPO_ROOT / "data_gen" / "store.py" in graph[train / "features.py"]  # inside a method
    assert (
        REPO_ROOT / "speculators" / "families" / "__init__.py"
        in graph[REPO_ROOT / "speculators" / "verifier.py"]
    )


# ---- the checker on a small tree ---------------------------------------------------------------------------
def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_circle_hidden_in_a_function_is_found_with_its_names(tmp_path):
    write_tree(
        tmp_path,
        {
            "speculators/__init__.py": "",
            "speculators/a.py": "from speculators.b import thing\n",
            "speculators/b.py": "def f():\n    from . import a\n    from .a import other\n",
        },
    )
    graph = import_graph(tmp_path)
    (component,) = circles(graph)
    text = describe_circle(component, graph, tmp_path)
    assert "speculators/a.py -> speculators/b.py: thing (line 1)" in text
    assert "speculators/b.py -> speculators/a.py: a, other (line 2, 3)" in text


def test_an_upward_import_names_its_file_and_line(tmp_path):
    write_tree(
        tmp_path,
        {
            "speculators/__init__.py": "",
            "speculators/lib.py": "import os\n\n\ndef f():\n    import train.loop\n",
            "train/__init__.py": "",
            "train/loop.py": "import torch\n",
        },
    )
    (found,) = upward_imports(import_graph(tmp_path), tmp_path)
    assert found.startswith("speculators/lib.py:5 imports train/loop.py")
