"""Atomic writes: a reader (or a run killed mid-write) sees the old file or directory or the new one, never half.

Every stage of the project that writes a file other stages read (best.json, manifests, results, recipes) goes
through these functions, so there is one rule: write a temporary sibling, fsync it, rename it into place. A
directory (a checkpoint, evaluation results) is staged whole beside its target and swapped in with one atomic
exchange, so a kill at any moment leaves the earlier directory or the new one at the target.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def temp_sibling(target: Path) -> Path:
    """An empty temporary file beside ``target`` (same file system, so the final rename is atomic)."""
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    os.chmod(name, 0o644)  # mkstemp's 0600 would make results unreadable to the group that shares a run
    return Path(name)


def fsync_replace(tmp: Path, target: Path) -> None:
    """Flush ``tmp`` to disk, then rename it over ``target``."""
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, target)


def atomic_write_text(target: str | Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, fsync, rename: readers see the old file or the new one, never half."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(target)
    try:
        tmp.write_text(text)
        fsync_replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_json(target: str | Path, payload: Any, indent: int = 1) -> None:
    """``payload`` as JSON (``indent`` spaces, a final newline), written atomically."""
    atomic_write_text(target, json.dumps(payload, indent=indent) + "\n")


# ---- directories ------------------------------------------------------------------------------------------------
_RENAME_EXCHANGE = 2  # linux/fs.h; renameat2 swaps two paths in one step


def _libc_renameat2() -> Callable[..., int] | None:
    """glibc's ``renameat2`` (Linux >= 3.15, glibc >= 2.28), or None. Hand-written through ctypes: neither the
    standard library nor a maintained package exposes the atomic exchange of two directories."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _libc_renameat2()
_AT_FDCWD = -100


def exchange_paths(first: Path, second: Path) -> bool:
    """Swap two existing paths atomically; False where the system cannot (another OS, a file system without it)."""
    if _RENAMEAT2 is None:
        return False
    status = _RENAMEAT2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if status == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, f"cannot swap {first} into {second}: {os.strerror(code)}")


def replace_directory(staging: Path, target: Path) -> None:
    """Put the complete ``staging`` directory at ``target``; an earlier ``target`` is swapped out in one step and
    deleted afterwards. Without the exchange it is renamed aside first (a kill between the two renames leaves it
    as ``.NAME.old-<pid>`` beside the target)."""
    if not target.exists() and not target.is_symlink():
        staging.rename(target)
        return
    if exchange_paths(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # now the earlier directory
        return
    backup = target.with_name(f".{target.name}.old-{os.getpid()}")
    target.rename(backup)
    staging.rename(target)
    shutil.rmtree(backup, ignore_errors=True)


@contextmanager
def atomic_directory(
    target: str | Path, before_replace: Callable[[Path], Any] | None = None
) -> Iterator[Path]:
    """Yield an empty hidden sibling of ``target`` to write into; when the block finishes without an exception it
    replaces ``target`` whole (:func:`replace_directory`), else it is deleted and ``target`` is untouched.
    ``before_replace(target)`` runs just before the swap: the caller's last check of what is there now (a long
    evaluation may end after someone put files at the target)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    staging.chmod(0o755)
    try:
        yield staging
        if before_replace is not None:
            before_replace(target)
        replace_directory(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


__all__ = [
    "atomic_directory",
    "atomic_write_json",
    "atomic_write_text",
    "exchange_paths",
    "fsync_replace",
    "replace_directory",
    "temp_sibling",
]
