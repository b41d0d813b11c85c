"""What a published or committed file may say about the machine that made it: no absolute local path.

A model card, ``results.json``, ``memory_plan.json`` or a committed bench result that names ``/home/alice/...`` or
``/root/.cache/huggingface/...`` leaks a user name and a directory layout, and helps nobody who downloads it: the
path does not exist on their machine. Files written for others therefore name models by hub id (or by the name
the user gave) and show paths relative to the run directory at most (:func:`public_path`, :func:`scrub`), and
``speculators push`` refuses any file that still holds an absolute local path (:func:`find_local_paths`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# An absolute POSIX path of two or more components, not part of a URL ("https://x/y"), a ratio ("tokens/s") or a
# relative path ("eval/results.json"): the character before the leading "/" must not be a word character, "/",
# ":", ".", "~", "<", ">" or "-". Windows drive paths (C:\Users\..., also JSON-escaped) are matched too.
_POSIX_PATH = r"(?<![\w/:.~<>-])/(?:[\w.@+%=-]+/)+[\w.@+%=-]*"
_WINDOWS_PATH = r"(?<![\w])[A-Za-z]:\\{1,2}(?:[\w.@+%=-]+\\{1,2})+[\w.@+%=-]*"  # JSON doubles the \\
ABSOLUTE_PATH = re.compile(f"{_POSIX_PATH}|{_WINDOWS_PATH}")
# Top-level directories where user files live on common machines, flagged even when this machine lacks them (a
# file written on another host); any other top-level directory counts when it exists here.
USER_ROOTS = frozenset(
    {"home", "Users", "root", "tmp", "var", "private", "mnt", "media", "data", "scratch", "work", "workspace"}
    | {"opt", "srv", "gpfs", "lustre", "nfs", "storage", "content", "kaggle", "teamspace", "fsx"}
)
# A Hub repository id: ``name`` or ``owner/name`` (letters, digits, ``-_.``, not starting with a dot or dash).
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
# Kernel and system interfaces (/dev/shm, /proc/cpuinfo): the same on every Linux machine, naming nobody's files.
SYSTEM_ROOTS = frozenset({"dev", "proc", "sys", "etc"})
HF_CACHE_SNAPSHOT = re.compile(r"models--(?P<org>[^/\\]+?)--(?P<name>[^/\\]+)[/\\]snapshots[/\\][0-9a-f]+")
LOCAL_PREFIX = "<local>/"  # how a path outside the run directory is shown: its last component only


def is_local_path(text: str) -> bool:
    """Whether ``text`` is an absolute path that points into somebody's machine (see :data:`USER_ROOTS`)."""
    if re.fullmatch(_WINDOWS_PATH, text):
        return True
    if not text.startswith("/"):
        return False
    top = text.lstrip("/").split("/", 1)[0]
    return bool(top) and top not in SYSTEM_ROOTS and (top in USER_ROOTS or Path("/", top).is_dir())


def find_local_paths(text: str) -> list[str]:
    """Every absolute local path in ``text`` (first occurrence order, no repeats)."""
    found: list[str] = []
    for match in ABSOLUTE_PATH.finditer(text):
        path = match.group(0).rstrip(".")
        if is_local_path(path) and path not in found:
            found.append(path)
    return found


def public_name(name_or_path: str | Path) -> str:
    """A model named for others: a hub id as it is; a Hugging Face cache snapshot directory as the hub id it caches
    (``.../models--org--name/snapshots/<hash>`` → ``org/name``); any other local directory by its folder name only."""
    text = str(name_or_path)
    cached = HF_CACHE_SNAPSHOT.search(text)
    if cached:
        return f"{cached['org']}/{cached['name']}"
    if is_local_path(text):
        return Path(text).name or text
    return text


def public_path(path: str | Path, root: Path | None = None) -> str:
    """``path`` as others may see it: relative to ``root`` (the run directory) when inside it, else the hub id or
    folder name of :func:`public_name` behind ``<local>/`` (a relative path is kept: it names nothing private)."""
    text = str(path)
    if not is_local_path(text):
        return text
    if root is not None:
        # as written first (a symlinked .venv inside the root stays inside it), then with links resolved
        for inner, outer in (
            (os.path.normpath(text), os.path.normpath(root)),
            (Path(text).resolve(), Path(root).resolve()),
        ):
            try:
                return Path(inner).relative_to(outer).as_posix()
            except ValueError:
                continue
    cached = HF_CACHE_SNAPSHOT.search(text)
    return public_name(text) if cached else LOCAL_PREFIX + public_name(text)


def scrub(value: Any, root: Path | None = None) -> Any:
    """``value`` (a string, or dicts and lists of them: a recipe, results) with every absolute local path inside a
    string replaced by :func:`public_path`. Non-string leaves are returned as they are."""
    if isinstance(value, str):
        return ABSOLUTE_PATH.sub(
            lambda m: public_path(m.group(0), root) if is_local_path(m.group(0)) else m.group(0), value
        )
    if isinstance(value, dict):
        return {key: scrub(item, root) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(scrub(item, root) for item in value)
    return value


# ---- files -------------------------------------------------------------------------------------------------------
SAFETENSORS_SUFFIX = ".safetensors"
MAX_SCANNED_BYTES = 64 * 1024 * 1024  # other files above this are scanned in their first and last 1 MiB


def file_text(path: Path) -> str:
    """The text of ``path`` a reader or a tool could see: a safetensors file's header (its metadata; the tensors
    are numbers), the first and last MiB of a huge file, anything else whole; bytes decoded leniently."""
    with open(path, "rb") as handle:
        if path.suffix == SAFETENSORS_SUFFIX:
            size = int.from_bytes(handle.read(8), "little")
            data = handle.read(min(size, MAX_SCANNED_BYTES))
        elif path.stat().st_size > MAX_SCANNED_BYTES:
            data = handle.read(1 << 20)
            handle.seek(-(1 << 20), 2)
            data += b"\n" + handle.read()
        else:
            data = handle.read()
    return data.decode("utf-8", errors="replace")


def local_paths_in_files(files: Iterable[Path], allowed: Iterable[str] = ()) -> dict[Path, list[str]]:
    """``{file: its absolute local paths}`` for the files that hold any, leaving out the ``allowed`` strings."""
    allowed = [a for a in allowed if a]
    found = {}
    for path in files:
        text = file_text(path)
        for value in allowed:
            text = text.replace(value, "")
        paths = find_local_paths(text)
        if paths:
            found[path] = paths
    return found


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a Hub repository id (``owner/name`` or a bare ``name``)."""
    return bool(HUB_ID.fullmatch(name)) and ".." not in name and "--" not in name


def names_local_path(name: str, *bases: Path) -> bool:
    """Whether a ``name_or_path`` names a local directory rather than a hub id: absolute, ``~``/``./``/``../``,
    present relative to the current directory or one of ``bases``, or not a hub id's shape (``models/foo/bar``).
    ``meta-llama/Llama-3.1-8B`` is a hub id; vLLM on another machine could resolve only that."""
    if name in (".", "..") or name.startswith(("~", "./", "../", ".\\", "..\\")):
        return True
    if Path(name).is_absolute() or any((base / name).exists() for base in (Path.cwd(), *bases)):
        return True
    return not is_hub_id(name)


__all__ = [
    "find_local_paths",
    "is_hub_id",
    "is_local_path",
    "local_paths_in_files",
    "names_local_path",
    "public_name",
    "public_path",
    "scrub",
]
