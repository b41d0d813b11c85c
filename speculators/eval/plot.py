"""The evaluation plot: per-position acceptance of every run, acceptance length against k for the chains (the
speed-ups when only one k ran) and, when several suites ran, acceptance length per suite; titled by the draft's
recipe and algorithm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from speculators.atomic import fsync_replace, temp_sibling
from speculators.local_paths import public_name


def algorithm_name(algorithm: str | None) -> str:
    """``hass`` → ``HASS``: how papers and the model card spell a training algorithm (its unit's declared display
    name, speculators.algorithms.display_name), upper-cased when no unit declares it."""
    from speculators import algorithms

    if not algorithm:
        return "draft"
    return algorithms.display_name(str(algorithm)) or str(algorithm).upper()


def plot_title(results: dict[str, Any]) -> str:
    """``<recipe> (<algorithm>) on <verifier>``: a draft is known by what trained it, not by its directory (the
    directory of an export is usually just ``export``). Older results without ``draft_name`` keep the dir name."""
    draft = results.get("draft_name") or Path(str(results["draft"])).name
    return f"{draft} on {public_name(str(results['verifier']))}"


def build_figure(results: dict[str, Any]):
    """Left: conditional per-position acceptance per run. Right, with two or more chain lengths: acceptance length
    (global and per-sample mean) vs k, with vLLM's where it ran. With one k a curve would be a single point, so the
    right panel shows the speed-up of every run over plain decoding instead (acceptance length when no baseline
    ran)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = results["runs"]
    suites = per_suite_acceptance(results)
    fig, axes = plt.subplots(1, 3 if suites else 2, figsize=(16.5 if suites else 11, 4.2))
    left, right = axes[0], axes[1]
    if suites:
        _per_suite(axes[2], suites)
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
    if len({r["k"] for r in chains}) >= 2:
        _acceptance_vs_k(right, chains, results.get("vllm") or {})
    else:
        _speedups(right, runs, results.get("vllm") or {})
    fig.suptitle(plot_title(results), fontsize=10)
    fig.tight_layout()
    return fig


def per_suite_acceptance(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{run: {suite: acceptance length}}`` of our engine's runs when the evaluation ran more than one suite (read
    from ``reports``, computed from the request table); empty otherwise."""
    out = {}
    main = {f"ours/{run['name']}" for run in results.get("runs") or []}  # not the k sweep's other points
    for name, report in ((results.get("reports") or {}).get("runs") or {}).items():
        suites = report.get("per_suite") or {}
        if name in main and len(suites) > 1:
            out[name.removeprefix("ours/")] = {
                suite: figures["acceptance_length_global"]
                for suite, figures in suites.items()
                if figures.get("acceptance_length_global") is not None
            }
    return out


def _per_suite(axis, suites: dict[str, dict[str, float]]) -> None:
    """Grouped bars: acceptance length per suite (MT-Bench, HumanEval, GSM8K, chats), one bar per run."""
    names = list(dict.fromkeys(suite for row in suites.values() for suite in row))
    width = 0.8 / len(suites)
    for index, (run, row) in enumerate(suites.items()):
        xs = [i + (index - (len(suites) - 1) / 2) * width for i in range(len(names))]
        axis.bar(xs, [row.get(name, 0.0) for name in names], width, label=run)
    axis.set_xticks(range(len(names)), names)
    axis.set(ylabel="acceptance length", title="Acceptance length per suite")
    axis.grid(alpha=0.3, axis="y")
    axis.legend(fontsize=8)


def _acceptance_vs_k(axis, chains: list[dict[str, Any]], vllm: dict[str, Any]) -> None:
    ks = [r["k"] for r in chains]
    axis.plot(ks, [r["acceptance_length_global"] for r in chains], marker="o", label="ours, global ratio")
    axis.plot(
        ks,
        [r["acceptance_length_per_sample_mean"] for r in chains],
        marker="s",
        linestyle="--",
        label="ours, per-sample mean",
    )
    points = [
        (r["k"], vllm[r["name"]]["acceptance_length"])
        for r in chains
        if isinstance(vllm.get(r["name"]), dict) and vllm[r["name"]].get("acceptance_length")
    ]
    if points:
        axis.plot(*zip(*points, strict=True), marker="^", label="vLLM")
    axis.plot(ks, [k + 1 for k in ks], color="grey", linestyle=":", label="ceiling k + 1")
    axis.set_xticks(ks)
    axis.set(xlabel="speculative tokens k", ylabel="acceptance length", title="Acceptance length vs k")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)


def _speedups(axis, runs: list[dict[str, Any]], vllm: dict[str, Any]) -> None:
    """One bar per run (and per vLLM run beside it): tokens/s over plain decoding, labelled with the acceptance
    length that bought it. Without a plain baseline (``--no-plain``), the acceptance lengths against k + 1."""
    names = [run["name"] for run in runs]
    ours = [run.get("speedup") for run in runs]
    theirs = [(vllm.get(name) or {}).get("speedup_vs_vllm_plain") for name in names]
    if any(v is not None for v in ours):
        width = 0.38 if any(v is not None for v in theirs) else 0.6
        xs = list(range(len(names)))
        bars = axis.bar([x - (width / 2 if width < 0.6 else 0) for x in xs], [v or 0 for v in ours], width,
                        label="ours")  # fmt: skip
        for bar, run in zip(bars, runs, strict=True):
            axis.annotate(
                f"{run.get('speedup') or 0:.2f}x\nAL {run['acceptance_length_global']:.2f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        if width < 0.6:
            axis.bar([x + width / 2 for x in xs], [v or 0 for v in theirs], width, label="vLLM")
        axis.axhline(1.0, color="grey", linestyle=":", label="plain decoding")
        axis.set_xticks(xs, names)
        axis.set(ylabel="speed-up (tokens/s over plain)", title="Speed-up over plain decoding")
    else:
        bars = axis.bar(
            names, [run["acceptance_length_global"] for run in runs], 0.6, label="acceptance length"
        )
        for bar, run in zip(bars, runs, strict=True):
            axis.annotate(f"{run['acceptance_length_global']:.2f} of {run['k'] + 1}",
                          (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                          fontsize=8)  # fmt: skip
        axis.set(
            ylabel="acceptance length",
            title="Acceptance length (no plain baseline: no speed-up)",
        )
    axis.grid(alpha=0.3, axis="y")
    axis.legend(fontsize=8)


def plot_acceptance(results: dict[str, Any], path: Path) -> Path:
    """:func:`build_figure` written as a PNG atomically (temp name, then rename)."""
    import matplotlib.pyplot as plt

    fig = build_figure(results)
    temp = temp_sibling(path)
    try:
        fig.savefig(temp, dpi=110, format="png")
        fsync_replace(temp, path)
    finally:
        plt.close(fig)
        temp.unlink(missing_ok=True)
    return path
