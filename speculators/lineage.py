"""Where an adapted draft came from: its parent draft and the traffic window it was adapted on, as hashes, counts,
times and figures — never the traffic's text.

``train/adapt.py`` writes ``<run_dir>/lineage.json``; ``speculators export`` copies it into the export's
``config.json`` (top-level key ``lineage``: the speculators package keeps unknown top-level keys and vLLM ignores
them) and renders it as the model card's "Lineage" section. A served log is private to whoever served it, so what
leaves the run directory is built here from a closed set of keys whose values are numbers, hashes and times
(:func:`public_lineage`); a string of any other shape is refused, so no prompt or answer can ride along.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

LINEAGE_NAME = "lineage.json"
HASH = re.compile(r"^(sha256:)?[0-9a-f]{64}$")
# what a lineage may say, and of which type; anything else stays in the run directory
WINDOW_KEYS = {
    "count": int,
    "first_created": (int, float, type(None)),
    "last_created": (int, float, type(None)),
    "sha256": str,
    "ordered_by": str,
}
FIGURE_KEYS = (
    "window_al_before",
    "window_al_after",
    "original_al_before",
    "original_al_after",
    "window_speedup_c1_before",
    "window_speedup_c1_after",
    "k",
)
ORDERINGS = ("created", "line")


def draft_hash(directory: str | Path) -> str:
    """``sha256:<hex>`` over a draft directory's ``config.json`` and weight files (name and bytes, sorted), so two
    drafts with equal hashes serve identically. The model card and the results files are left out: they change
    when a draft is only re-described."""
    from speculators.format.checkpoint import weight_files

    root = Path(directory)
    digest = hashlib.sha256()
    for path in sorted([root / "config.json", *weight_files(root)], key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


def _window(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a traffic window must be an object, not {type(raw).__name__}")
    window = {}
    for key, kind in WINDOW_KEYS.items():
        if key not in raw:
            continue
        value = raw[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{where}.{key}: {type(value).__name__} is not what a lineage holds")
        window[key] = value
    if "sha256" in window and not HASH.match(window["sha256"]):
        raise ValueError(f"{where}.sha256: not a sha256 hex digest")
    if "ordered_by" in window and window["ordered_by"] not in ORDERINGS:
        raise ValueError(f"{where}.ordered_by: {window['ordered_by']!r} is not one of {ORDERINGS}")
    return window


def public_lineage(lineage: dict[str, Any]) -> dict[str, Any]:
    """The part of ``lineage.json`` that may leave the run directory: the parent's hash and algorithm, each
    window's count, time range and hash, the CPU spent and the before/after figures. Raises on a value that is
    not a number, a hash or a known word (a lineage is written by adapt, so that is a bug or a hand edit)."""
    parent = lineage.get("parent") or {}
    parent_hash = parent.get("sha256")
    if not isinstance(parent_hash, str) or not HASH.match(parent_hash):
        raise ValueError(f"{LINEAGE_NAME}: parent.sha256 {parent_hash!r} is not a sha256 digest")
    out: dict[str, Any] = {"parent": {"sha256": parent_hash}}
    algorithm = parent.get("algorithm")
    if isinstance(algorithm, str) and re.fullmatch(r"[a-z0-9_]{1,32}", algorithm):
        out["parent"]["algorithm"] = algorithm
    windows = lineage.get("traffic") or {}
    out["traffic"] = {
        name: _window(windows[name], f"{LINEAGE_NAME}: traffic.{name}")
        for name in ("adapted_on", "heldout")
        if name in windows
    }
    numbers = {
        k: v
        for k, v in (lineage.get("adapt") or {}).items()
        if k in ("cpu_s", "replay_share", "error_replay")
    }
    if any(not isinstance(v, (int, float)) for v in numbers.values()):
        raise ValueError(f"{LINEAGE_NAME}: adapt holds a value that is not a number")
    if numbers:
        out["adapt"] = numbers
    figures = {k: v for k, v in (lineage.get("figures") or {}).items() if k in FIGURE_KEYS}
    if any(v is not None and not isinstance(v, (int, float)) for v in figures.values()):
        raise ValueError(f"{LINEAGE_NAME}: figures holds a value that is not a number")
    if figures:
        out["figures"] = figures
    return out


def read_lineage(run_dir: str | Path | None) -> dict[str, Any] | None:
    """The public lineage of a run directory, None when the run was not adapted (no ``lineage.json``)."""
    if run_dir is None:
        return None
    path = Path(run_dir) / LINEAGE_NAME
    if not path.is_file():
        return None
    try:
        return public_lineage(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}: not valid JSON ({error.msg}); rerun train/adapt.py to rewrite it"
        ) from None


def _when(seconds: float | None) -> str:
    import datetime

    if seconds is None:
        return "?"
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _span(window: dict[str, Any]) -> str:
    if window.get("ordered_by") == "line":
        return "in log order (the log has no times)"
    return f"{_when(window.get('first_created'))} to {_when(window.get('last_created'))}"


def lineage_section(lineage: dict[str, Any], table: Callable[[list[dict[str, Any]]], str]) -> str:
    """The model card's "Lineage" section: parent, windows, and the window's figures before and after. ``table``
    renders rows as markdown: the card's own renderer (speculators.export sits above this module)."""
    parent = lineage["parent"]
    lines = [
        "## Lineage",
        "",
        f"Adapted from the draft `{parent['sha256']}`"
        + (f" ({parent['algorithm']})" if parent.get("algorithm") else "")
        + " on served traffic (`train/adapt.py`). No text of that traffic is in this directory: the windows are "
        "named by count, time range and hash.",
        "",
    ]
    rows = [
        {
            "window": name.replace("_", " "),
            "requests": w.get("count"),
            "time range": _span(w),
            "sha256": w.get("sha256"),
        }
        for name, w in lineage.get("traffic", {}).items()
    ]
    if rows:
        lines += [table(rows), ""]
    figures = lineage.get("figures") or {}
    pairs = [
        ("acceptance length on the held-out window", "window_al_before", "window_al_after"),
        ("acceptance length on the original held-out data", "original_al_before", "original_al_after"),
    ]
    measured = [
        (label, figures.get(a), figures.get(b)) for label, a, b in pairs if figures.get(a) is not None
    ]
    if measured:
        k = figures.get("k")
        lines.append(
            f"Measured with `speculators eval` at k = {k}:" if k else "Measured with `speculators eval`:"
        )
        lines.append("")
        for label, before, after in measured:
            after_text = f"{after:.3f}" if after is not None else "not measured"
            lines.append(f"- {label}: {before:.3f} before, {after_text} after")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


__all__ = ["LINEAGE_NAME", "draft_hash", "lineage_section", "public_lineage", "read_lineage"]
