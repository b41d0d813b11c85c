"""Atomic file writes: a reader (or a run killed mid-write) sees the old file or the new one, never half of one.

Every stage of the project that writes a file other stages read (best.json, manifests, results, recipes) goes
through these two functions, so there is one rule: write a temporary sibling, fsync it, rename it into place.
"""

from __future__ import annotations

import json
import os
import tempfile
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


__all__ = ["atomic_write_json", "atomic_write_text", "fsync_replace", "temp_sibling"]
