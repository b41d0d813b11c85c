"""The evaluation plot: per-position acceptance of every run, and acceptance length against k for the chains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from speculators.atomic import fsync_replace, temp_sibling


def plot_acceptance(results: dict[str, Any], path: Path) -> Path:
    """Left: conditional per-position acceptance per run. Right: acceptance length (global and per-sample mean)
    vs chain length k, with vLLM's where it ran. Written atomically (temp name, then rename)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = results["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in runs:
        rates = run.get("per_position_acceptance_conditional") or []
        xs = [i + 1 for i, r in enumerate(rates) if r is not None]
        left.plot(xs, [r for r in rates if r is not None], marker="o", label=run["name"])
    left.set(
        xlabel="draft position",
        ylabel="P(accepted | earlier accepted)",
        ylim=(0, 1.05),
        title="Conditional per-position acceptance",
    )
    left.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    chains = sorted((r for r in runs if r["method"] == "chain"), key=lambda r: r["k"])
    if chains:
        ks = [r["k"] for r in chains]
        right.plot(
            ks, [r["acceptance_length_global"] for r in chains], marker="o", label="ours, global ratio"
        )
        right.plot(
            ks,
            [r["acceptance_length_per_sample_mean"] for r in chains],
            marker="s",
            linestyle="--",
            label="ours, per-sample mean",
        )
        vllm = results.get("vllm") or {}
        points = [
            (r["k"], vllm[r["name"]]["acceptance_length"])
            for r in chains
            if isinstance(vllm.get(r["name"]), dict) and vllm[r["name"]].get("acceptance_length")
        ]
        if points:
            right.plot(*zip(*points, strict=True), marker="^", label="vLLM")
        right.plot(ks, [k + 1 for k in ks], color="grey", linestyle=":", label="ceiling k + 1")
        right.set_xticks(ks)
    right.set(xlabel="speculative tokens k", ylabel="acceptance length", title="Acceptance length vs k")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(f"{Path(str(results['draft'])).name} on {Path(str(results['verifier'])).name}", fontsize=10)
    fig.tight_layout()
    temp = temp_sibling(path)
    try:
        fig.savefig(temp, dpi=110, format="png")
        fsync_replace(temp, path)
    finally:
        plt.close(fig)
        temp.unlink(missing_ok=True)
    return path
