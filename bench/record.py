"""What every bench shares: its result record.

Where a result goes (``bench/results/<name>.json``), the machine it was measured on (:func:`machine`), how it is
written (:func:`write_result`: repo-relative paths, atomically), and the pieces its section of
``bench/results/SUMMARY.md`` is made of (:func:`bullet`, :func:`grid`, :func:`num`, :func:`pct`, :func:`times`,
:func:`flat_figures`), which each bench's ``render`` uses and ``bench/summary.py`` assembles.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PY = sys.executable
MACHINE_KEYS = ("machine", "host", "environment")  # where the bench scripts (old and new) record the machine
# The demo recipe (eagle3_smollm2) as the benches built on it measured it. It now trains make demo's k = 1 draft (TTT 1,
# out-of-vocab targets kept, validated at k = 1); a bench that trains it puts these first, so its lanes keep the TTT-2
# draft with out-of-vocab targets dropped, validated at k = 3, that its results record (its own overrides still win)
DEMO_RECIPE = "eagle3_smollm2"
DEMO_RECIPE_AS_MEASURED = ["train.ttt_steps=2", "train.mask_out_of_vocab=true", "eval.k=3"]


def as_measured(recipe: str) -> list[str]:
    """The overrides a bench puts first when it trains ``recipe``: :data:`DEMO_RECIPE_AS_MEASURED` for the demo
    recipe, nothing for any other (their own files pin what they were measured with)."""
    return list(DEMO_RECIPE_AS_MEASURED) if recipe == DEMO_RECIPE else []


# ---- the machine of a result ---------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    """Where the figures were measured: runs on different processors must never be compared unawares. The CPU
    (model, torch's kernel capability, its bf16/AVX flags), what ``auto`` chooses there and why
    (speculators.precision), and the dtypes a bench's stages run in: capture and training follow the recipe's
    ``auto`` (or SPECULATORS_COMPUTE_DTYPE), our engine and vLLM measure in fp32 (token identity)."""
    from speculators.precision import choose, machine_record

    record = machine_record()
    device = "cuda" if "cuda" in record["auto_dtype"] else "cpu"
    return {
        "platform": platform.platform(),
        "cpu_model": record["cpu"]["model"],
        "cpus": os.cpu_count(),
        "cpu_capability": record["cpu"]["capability"],
        "cpu_flags": record["cpu"]["flags"],
        "native_bf16": sorted(f for f in ("avx512_bf16", "amx_bf16") if record["cpu"]["flags"][f]),
        "auto_dtype": record["auto_dtype"],
        "dtypes": {
            "capture": _decision(choose("auto", device, key="verifier.dtype").to_json()),
            "train": _decision(choose("auto", device, key="train.dtype").to_json()),
            "engine": "float32",
            "vllm": "float32",
        },
        "python": platform.python_version(),
        "torch": record["torch"],
    }


def _decision(record: dict[str, Any]) -> dict[str, Any]:
    """A dtype decision without the CPU facts the machine record already holds."""
    return {key: record[key] for key in ("dtype", "source", "reason")}


# ---- writing a result ----------------------------------------------------------------------------------------
def write_result(path: Path, result: dict[str, Any]) -> Path:
    """Write ``result`` to ``path`` atomically, every path in it made repo-relative (committed results are read by
    strangers: they must not name the machine that produced them)."""
    from speculators.atomic import atomic_write_json
    from speculators.local_paths import scrub

    atomic_write_json(path, scrub(result, REPO))
    return path


def command(script: str, argv: list[str] | None = None) -> str:
    """The command line a result records: the repo's interpreter, ``script`` (repo-relative) and its arguments
    (``argv`` as passed to the bench's ``run``, else this process's own)."""
    return " ".join([".venv/bin/python", script, *(argv if argv is not None else sys.argv[1:])])


# ---- the pieces of a SUMMARY.md section ------------------------------------------------------------------------
def grid(title: str, rows: dict[str, dict[str, Any]], ks: list[str], cell: Callable[[Any], Any]) -> list[str]:
    """A drafter x k markdown table; a k a drafter was not run at is an empty cell."""
    lines = [f"| {title} | " + " | ".join(f"k={k[1:]}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
    for name, row in rows.items():
        lines.append(
            f"| {name} | " + " | ".join("" if k not in row else str(cell(row[k])) for k in ks) + " |"
        )
    return lines


def bullet(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = round(value, 4)
    return f"- {label}: {value}"


def num(value: Any, digits: int = 1) -> float | None:
    return None if value is None else round(float(value), digits)


def pct(value: Any) -> str | None:
    return None if value is None else f"{100 * float(value):+.1f}%"


def times(value: Any) -> str | None:
    return None if value is None else f"{float(value):.2f}x"


def flat_figures(result: dict[str, Any]) -> list[str]:
    """A result's ``summary`` (or its top-level figures), flat: the section of a result no bench renders."""
    source = result.get("summary") if isinstance(result.get("summary"), dict) else result
    return [
        bullet(key, value)
        for key, value in source.items()
        if key not in MACHINE_KEYS and isinstance(value, (int, float, str, bool)) and key != "command"
    ]
