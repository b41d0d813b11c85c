"""Where a command may write: no command deletes what it did not write.

``speculators export``, ``convert`` and ``eval`` each write one directory of their own, replaced whole and
atomically (:func:`speculators.atomic.atomic_directory`). Replacing a directory deletes what was in it, so before any
work starts (and again just before the swap) the target is checked against the command's :class:`OutputKind`:

* a target that is, or contains, one of the command's sources is refused (``speculators export RUN RUN`` used to
  delete the run it exported);
* a target that is a file is refused (a directory cannot replace it without losing it);
* a non-empty directory is replaced only when it holds an earlier output of the same command and nothing else
  (an earlier export: said in the command's output; earlier evaluation results: only with ``--overwrite``);
* anything else in the way is refused, naming what is there and the fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from speculators.atomic import atomic_directory


class UnsafeOutputError(ValueError):
    """The output target holds something the command did not write; nothing was written."""


@dataclass(frozen=True)
class OutputKind:
    """What one command writes into its output directory.

    ``what``: how messages name an earlier output (``an earlier export``); ``owns``: whether a file name is one the
    command writes; ``is_earlier_output``: whether a directory holds a complete earlier output of the command;
    ``replace_flag``: the flag a user passes to replace an earlier output (``None``: replaced, and said)."""

    what: str
    owns: Callable[[str], bool]
    is_earlier_output: Callable[[Path], bool]
    replace_flag: str | None = None


# ---- the kinds -------------------------------------------------------------------------------------------------
_EXPORT_FILES = re.compile(
    r"^(config\.json|model\.safetensors|model\.safetensors\.index\.json|model-\d+-of-\d+\.safetensors|README\.md"
    r"|[^/]+\.png)$"
)


def _is_speculators_checkpoint(directory: Path) -> bool:
    """A draft directory this package writes: config.json naming a speculators model type, and its weights."""
    config = directory / "config.json"
    weights = any(
        (directory / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")
    )
    if not (config.is_file() and weights):
        return False
    try:
        return bool(json.loads(config.read_text()).get("speculators_model_type"))
    except (json.JSONDecodeError, OSError, AttributeError):
        return False


EXPORT_OUTPUT = OutputKind(
    what="an earlier export",
    owns=lambda name: bool(_EXPORT_FILES.match(name)),
    is_earlier_output=_is_speculators_checkpoint,
)

EVAL_FILES = ("results.json", "requests.jsonl", "acceptance.png")
EVAL_OUTPUT = OutputKind(
    what="earlier evaluation results",
    owns=lambda name: name in EVAL_FILES,
    is_earlier_output=lambda directory: any((directory / name).is_file() for name in EVAL_FILES[:2]),
    replace_flag="--overwrite",
)


# ---- the rule --------------------------------------------------------------------------------------------------
def _contains(outer: Path, inner: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_output_dir(
    target: str | Path,
    kind: OutputKind,
    sources: Iterable[str | Path | None] = (),
    overwrite: bool = False,
) -> bool:
    """Refuse (``UnsafeOutputError``, one line naming the target, what is there and the fix) a target whose
    replacement would delete something the command did not write. Returns True when the target holds an earlier
    output of ``kind`` that the write will replace, False when it is new or empty."""
    target = Path(target)
    resolved = target.resolve()
    for source in sources:
        if source is None or not Path(source).exists():  # a hub id, or nothing: nothing here to delete
            continue
        source_path = Path(source).resolve()
        if _contains(resolved, source_path):
            relation = "is" if resolved == source_path else "contains"
            raise UnsafeOutputError(
                f"{target} {relation} the source {source}: writing there would delete it; write to a new "
                f"directory instead (e.g. {target / 'export'})"
            )
    if not target.exists() and not target.is_symlink():
        return False
    if not target.is_dir():
        raise UnsafeOutputError(
            f"{target} is a file, not a directory: writing the output there would delete it; choose a directory "
            "path that does not exist yet"
        )
    entries = sorted(entry.name for entry in target.iterdir())
    if not entries:
        return False
    foreign = [name for name in entries if not kind.owns(name) or (target / name).is_dir()]
    if foreign or not kind.is_earlier_output(target):
        shown = ", ".join((foreign or entries)[:5]) + (" …" if len(foreign or entries) > 5 else "")
        raise UnsafeOutputError(
            f"{target} is not empty and does not hold {kind.what} (it holds {shown}): replacing it would delete "
            "what is there; choose a new or empty directory"
        )
    if kind.replace_flag and not overwrite:
        raise UnsafeOutputError(
            f"{target} holds {kind.what} ({', '.join(entries)}); pass {kind.replace_flag} to replace them, or "
            "choose another directory"
        )
    return True


@contextmanager
def output_directory(
    target: str | Path,
    kind: OutputKind,
    sources: Iterable[str | Path | None] = (),
    overwrite: bool = False,
) -> Iterator[Path]:
    """:func:`speculators.atomic.atomic_directory` for a command's output: ``target`` is checked
    (:func:`check_output_dir`) before the caller writes anything, and again just before the swap (a long write may
    end after someone put files there)."""
    sources = tuple(sources)
    check_output_dir(target, kind, sources, overwrite)
    with atomic_directory(target, lambda now: check_output_dir(now, kind, sources, overwrite)) as staging:
        yield staging


__all__ = [
    "EVAL_OUTPUT",
    "EXPORT_OUTPUT",
    "OutputKind",
    "UnsafeOutputError",
    "check_output_dir",
    "output_directory",
]
