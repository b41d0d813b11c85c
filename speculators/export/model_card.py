"""The ``README.md`` model card of an exported draft: what it drafts for, how it was trained, how well it does, and
the two ways to serve it with vLLM. Everything shown is read from the run directory; sections without data are
left out rather than filled with placeholders.

A card is written for strangers: it names models by hub id (or the name the user gave) and shows paths relative
to the run directory at most, never an absolute local path (``speculators.local_paths``; ``push`` checks).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators import algorithms
from speculators.local_paths import is_local_path, public_name, public_path, scrub

EVAL_WORDS = ("eval", "acceptance", "bench")
SKIPPED_RUN_SUBDIRS = ("checkpoints", "hydra", "wandb", ".hydra")
TIME_KEYS = (
    "train_seconds",
    "elapsed_seconds",
    "training_seconds",
    "train_runtime",
    "wall_seconds",
    "elapsed",
)


@dataclass
class EvalArtifacts:
    """Evaluation results found in a run directory: JSON files rendered as tables, PNG plots copied alongside."""

    tables: list[tuple[str, str]] = field(default_factory=list)  # (title, markdown table)
    plots: dict[str, Path | bytes] = field(
        default_factory=dict
    )  # file name in the export -> source file or PNG
    results_files: set[Path] = field(default_factory=set)  # `speculators eval` outputs shown (resolved paths)


@dataclass
class CardInfo:
    """What a card shows. Its title is not given: it is said from the config (``card_title``), since the export
    directory's name (typically ``export``) tells a stranger nothing."""

    config: dict[str, Any]
    verifier_ref: str  # what the user named (e.g. "smollm2"); config holds the resolved name_or_path
    source: str  # one line: where the weights came from
    verifier_note: str | None = None  # whose weights the verifier is, when not the published ones
    recipe: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    evals: EvalArtifacts = field(default_factory=EvalArtifacts)
    run_dir: Path | None = None  # paths inside it are shown relative to it; any other local path by name only
    # what every vLLM answers when asked to serve a draft for this verifier's family (Family.vllm_refusal)
    vllm_refusal: str | None = None
    lineage: dict[str, Any] | None = (
        None  # an adapted draft's parent and traffic window (speculators.lineage)
    )


# ---- gathering ---------------------------------------------------------------------------------------------
def read_metrics(run_dir: Path | None) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (malformed lines, e.g. one cut by a crash, are skipped)."""
    path = (run_dir / "metrics.jsonl") if run_dir else None
    if path is None or not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def training_summary(
    run_dir: Path | None, trainer_state: dict[str, Any], best: dict[str, Any]
) -> dict[str, Any]:
    """Steps, training time, last losses and the best acceptance length, from whatever the run recorded."""
    records = read_metrics(run_dir)
    summary: dict[str, Any] = {}
    seconds = _first_number(trainer_state, TIME_KEYS)
    if seconds is None and records:
        seconds = _first_number(records[-1], TIME_KEYS)
        stamps = [r["timestamp"] for r in records if isinstance(r.get("timestamp"), (int, float))]
        if seconds is None and len(stamps) > 1:
            seconds = max(stamps) - min(stamps)
    if seconds is not None:
        summary["training time"] = format_duration(seconds)
    steps = [r.get("step") for r in records if isinstance(r.get("step"), int)]
    if steps:
        summary["steps logged"] = f"{len(records)} records, last step {max(steps)}"
    last_losses = {}
    for record in records:
        last_losses.update({k: v for k, v in record.items() if "loss" in k and isinstance(v, (int, float))})
    summary.update({f"last {k}": _fmt(v) for k, v in sorted(last_losses.items())})
    accept = [r for r in records if any("accept" in k for k in r)]
    if best.get("acceptance_length") is not None:
        summary["best acceptance length"] = (
            f"{_fmt(best['acceptance_length'])} (step {best.get('step', '?')})"
        )
    elif accept:
        key = next(k for k in accept[-1] if "accept" in k)
        summary[f"last {key}"] = _fmt(accept[-1][key])
    for key in ("epoch", "samples_seen", "tokens_seen"):
        if isinstance(trainer_state.get(key), (int, float)):
            summary[key] = _fmt(trainer_state[key])
    return summary


def find_eval_artifacts(run_dir: Path | None) -> EvalArtifacts:
    """JSON results and PNG plots whose names mention eval/acceptance/bench, outside checkpoints/ and hydra/."""
    found = EvalArtifacts()
    if run_dir is None or not run_dir.is_dir():
        return found
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir)
        if rel.parts[0] in SKIPPED_RUN_SUBDIRS or len(rel.parts) > 4 or not path.is_file():
            continue
        if not any(word in str(rel).lower() for word in EVAL_WORDS):
            continue
        if path.suffix == ".json":
            try:
                data = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if is_eval_results(data):
                found.tables += eval_results_tables(data, str(rel), table_reports(path, data))
                found.results_files.add(path.resolve())
            elif table := json_table(data):
                found.tables.append((f"From `{rel}`:", table))
        elif path.suffix == ".png":
            found.plots["_".join(rel.parts)] = path
    return found


def read_eval_results(path: str | Path, flag: str = "--eval-results") -> dict[str, Any]:
    """The ``results.json`` of ``speculators eval`` at ``path``, or an error naming the flag, the file and the fix.
    The exporter calls it before converting any weight, so a mistyped ``--eval-results`` costs no conversion."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file; run `speculators eval ... --output DIR` first")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{flag} {path}: not JSON ({exc}); pass the results.json `speculators eval` wrote"
        ) from exc
    if not is_eval_results(data):
        raise ValueError(
            f"{flag} {path}: not the results.json of `speculators eval` (no runs with acceptance_length_global)"
        )
    return data


def add_eval_results(evals: EvalArtifacts, path: str | Path) -> None:
    """Add a ``results.json`` written by ``speculators eval`` (and the ``acceptance.png`` beside it) to ``evals``,
    so that a card made after the evaluation carries what it measured. The same file found in the run directory
    is not shown twice."""
    path = Path(path)
    data = read_eval_results(path)
    if path.resolve() in evals.results_files:
        return
    evals.tables += eval_results_tables(data, public_path(path), table_reports(path, data))
    evals.results_files.add(path.resolve())
    plot = path.with_name("acceptance.png")
    shown = {p.resolve() for p in evals.plots.values() if isinstance(p, Path)}
    if plot.is_file() and plot.resolve() not in shown:
        name = (
            "eval_acceptance.png"
            if "eval_acceptance.png" not in evals.plots
            else "eval_results_acceptance.png"
        )
        evals.plots[name] = plot


def k_from_sweep(path: str | Path, concurrency: int = 1) -> tuple[int, dict[str, Any]]:
    """The k to serve: the one with the most tokens/s at ``concurrency`` in the k x concurrency sweep of a
    ``speculators eval --concurrency ...`` results.json (``reports.k_sweep``), and the sweep itself."""
    data = read_eval_results(path, "--k-from-eval")
    sweep = (data.get("reports") or {}).get("k_sweep") or {}
    best = sweep.get("best_k") or {}
    if str(concurrency) not in best:
        raise ValueError(
            f"--k-from-eval {path}: no k sweep at concurrency {concurrency} (measured at {sorted(best) or 'none'}); "
            f"run `speculators eval DRAFT -k 1 2 3 4 --concurrency {concurrency} ...` and pass its results.json"
        )
    measured = sweep_ks(sweep, concurrency)
    if len(measured) < 2:
        what = f"only k={measured[0]} was" if measured else "no k was"
        raise ValueError(
            f"--k-from-eval {path}: {what} measured at concurrency {concurrency}, so there is "
            f"nothing to choose from; run `speculators eval DRAFT -k 1 2 3 --concurrency {concurrency} ...` and pass "
            "its results.json, or set k with --speculative-tokens"
        )
    return int(best[str(concurrency)]), sweep


def sweep_ks(sweep: dict[str, Any], concurrency: int) -> list[int]:
    """The k values a sweep measured (with a speed) at ``concurrency``: one k is a measurement, not a choice, and
    a card calling it "the k with the most tokens/s" would claim a comparison that never ran."""
    return sorted(
        {
            int(point["k"])
            for point in sweep.get("points") or []
            if isinstance(point, dict)
            and point.get("concurrency") == concurrency
            and point.get("tokens_per_s") is not None
            and "k" in point
        }
    )


def k_sweep_table(sweep: dict[str, Any], concurrency: int, origin: str) -> tuple[str, str]:
    """The model card's account of how ``speculative_tokens`` was chosen: every (concurrency, k) point measured."""
    chosen = int(sweep["best_k"][str(concurrency)])
    rows = [
        {
            "concurrency": point["concurrency"],
            "k": point["k"],
            "tokens/s": point.get("tokens_per_s"),
            "speedup vs plain at this concurrency": point.get("speedup"),
            "acceptance length": point.get("acceptance_length"),
            "chosen": "**served**" if (point["concurrency"], point["k"]) == (concurrency, chosen) else "",
        }
        for point in sweep.get("points", [])
    ]
    title = (
        f"`speculative_tokens` = {chosen}: the k with the most tokens/s at concurrency {concurrency} in the k x "
        f"concurrency sweep of `speculators eval` (`{public_path(origin)}`, our engine, the same prompts at each point):"
    )
    return title, markdown_table(_drop_empty_columns(rows))


def is_eval_results(data: Any) -> bool:
    """Whether ``data`` has the layout ``speculators eval`` writes (``runs`` of measured decoding runs)."""
    runs = data.get("runs") if isinstance(data, dict) else None
    return bool(runs) and all(isinstance(r, dict) and "acceptance_length_global" in r for r in runs)


def table_reports(results_path: Path, results: dict[str, Any]) -> dict[str, Any]:
    """The reports of an evaluation, recomputed from its request table (``requests.jsonl`` beside
    ``results.json``) when it is there, so the card's per-suite figures are a function of the recorded requests;
    else the ``reports`` results.json carries (the same function of the same rows, computed when it was written).
    An unreadable table is an error naming the file, never silently replaced by the summary."""
    from speculators.eval.table import REQUESTS_NAME, read_requests, reports

    table = results_path.with_name(REQUESTS_NAME)
    if table.is_file():
        return reports(read_requests(table))
    return results.get("reports") or {}


ENGINE_LABELS = {"ours": "our engine", "vllm": "vLLM's per-request counters"}
MAX_CARD_CATEGORIES = 24  # more categories than this (a suite of many): the per-suite table alone


def suite_tables(reports: dict[str, Any], origin: str, runs: set[str]) -> list[tuple[str, str]]:
    """Per suite, and per category when there are few enough to read, of each of our engine's runs: acceptance
    length, tokens per verify step and conditional per-position acceptance, the way papers and other cards report
    them (MT-Bench, HumanEval, GSM8K). Nothing when the evaluation had one suite of one category: the run table
    says it all; ``runs``: the evaluation's own runs (the k sweep's other points are in the sweep table). A pure
    function of the reports (themselves of the request table)."""
    tables = []
    for name, report in (reports.get("runs") or {}).items():
        engine, _, run = name.partition("/")
        if (
            engine not in ENGINE_LABELS
            or run not in runs
            or len(report.get("per_suite") or {}) + len(report.get("per_category") or {}) <= 2
        ):
            continue
        categories = report.get("per_category") or {}
        views = [("suite", report["per_suite"])]
        if len(categories) <= MAX_CARD_CATEGORIES:
            views.append(("suite/category", categories))
        for label, groups in views:
            rows = [
                {
                    label: key,
                    "requests": figures.get("num_requests"),
                    "prompt tokens (mean)": figures.get("prompt_tokens_mean"),
                    "acceptance length": figures.get("acceptance_length_global"),
                    "tokens per verify step": figures.get("tokens_per_verify_step"),
                    "per-position acceptance": _rates(figures.get("per_position_acceptance_conditional")),
                }
                for key, figures in groups.items()
            ]
            title = (
                f"{run} ({ENGINE_LABELS[engine]}) per {label.replace('/', ' and ')}, from the request table of "
                f"`{public_path(origin)}` (`requests.jsonl`: one row per request):"
            )
            tables.append((title, markdown_table(_drop_empty_columns(rows))))
    return tables


def eval_results_tables(
    results: dict[str, Any], origin: str, reports: dict[str, Any] | None = None
) -> list[tuple[str, str]]:
    """What ``speculators eval`` measured, as tables: acceptance lengths, per-position acceptance and speed-ups of
    our engine (with the plain-decoding baseline), per suite and category when it ran several (``reports``,
    :func:`table_reports`; default: the ones results.json carries), then vLLM's own counters when it ran."""
    prompts = results.get("prompts") or {}
    settings = results.get("settings") or {}
    temperature = settings.get("temperature", 0)
    title = (
        f"Measured by `speculators eval` (`{public_path(origin)}`): {prompts.get('count', '?')} prompts from "
        f"`{public_path(prompts.get('source', '?'))}`, up to {settings.get('max_new_tokens', '?')} new tokens, "
        f"{'greedy' if not temperature else f'temperature {temperature}'}, {settings.get('dtype', '?')} on "
        f"{settings.get('device', '?')}, draft `{results.get('draft_name') or public_name(results.get('draft', '?'))}`, "
        f"verifier `{public_name(results.get('verifier', '?'))}`. Acceptance length = tokens per verify step (vLLM's mean "
        "acceptance length); per-position acceptance j = P(draft j accepted | drafts before it accepted); "
        "speedup = tokens/s against plain decoding of the same prompts:"
    )
    rows = []
    if isinstance(results.get("plain"), dict):
        rows.append({"run": "plain (no draft)", "tokens/s": results["plain"].get("tokens_per_s")})
    for run in results["runs"]:
        rows.append(
            {
                "run": run["name"],
                "k": run.get("k"),
                "acceptance length": run.get("acceptance_length_global"),
                "per-sample mean": run.get("acceptance_length_per_sample_mean"),
                "per-position acceptance": _rates(run.get("per_position_acceptance_conditional")),
                "tokens/s": run.get("tokens_per_s"),
                "speedup": run.get("speedup"),
                "identical to plain": _percent(run.get("matches_plain")),
            }
        )
    tables = [(title, markdown_table(_drop_empty_columns(rows)))]
    names = {run["name"] for run in results["runs"]}
    tables += suite_tables(results.get("reports") or {} if reports is None else reports, origin, names)
    vllm = results.get("vllm")
    if isinstance(vllm, dict) and isinstance(vllm.get("skipped"), str):
        tables.append((f"vLLM was not run: {vllm['skipped']}.", ""))
    elif isinstance(vllm, dict) and isinstance(vllm.get("failed"), str):
        tables.append((f"vLLM failed on these prompts: {vllm['failed']}.", ""))
    elif isinstance(vllm, dict) and vllm:
        tables.append(("The same prompts through vLLM (its own acceptance counters):", vllm_table(vllm)))
    return tables


def vllm_table(vllm: dict[str, Any]) -> str:
    rows = [
        {
            "run": "plain (no draft)" if name == "plain" else name,
            "acceptance length": run.get("acceptance_length"),
            "per-position acceptance (of all drafts)": _rates(
                run.get("per_position_acceptance_unconditional")
            ),
            "tokens/s": run.get("tokens_per_s"),
            "speedup vs vLLM without the draft": run.get("speedup_vs_vllm_plain"),
            "our acceptance length": run.get("ours_acceptance_length"),
            "outputs identical to ours": _percent(run.get("outputs_identical_to_ours")),
        }
        for name, run in vllm.items()
        if isinstance(run, dict)
    ]
    return markdown_table(_drop_empty_columns(rows))


def _rates(values: Any) -> str | None:
    if not isinstance(values, list) or not values:
        return None
    return ", ".join("-" if v is None else f"{v:.2f}" for v in values)


def _percent(value: Any) -> str | None:
    return f"{value:.0%}" if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _drop_empty_columns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows without the columns no row has a value for (no vLLM comparison, no plain baseline...)."""
    columns = max((list(row) for row in rows), key=len, default=[])  # the order of the fullest row
    filled = [c for c in columns if any(row.get(c) is not None for row in rows)]
    return [{c: ("" if row.get(c) is None else row[c]) for c in filled} for row in rows]


def validation_artifacts(run_dir: Path | None, step: int | None, evals: EvalArtifacts) -> None:
    """Add the trainer's held-out validation (``kind: eval`` records of metrics.jsonl) to ``evals``: the metrics at
    the exported step (else the last evaluation) as a table, and acceptance length over steps as a plot."""
    records = [r for r in read_metrics(run_dir) if r.get("kind") == "eval" and isinstance(r.get("step"), int)]
    if not records:
        return
    chosen = next((r for r in reversed(records) if r["step"] == step), records[-1])
    rows = [
        {"metric": k.removeprefix("eval/"), "value": v}
        for k, v in chosen.items()
        if k.startswith("eval/") and isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    if rows:
        title = f"Held-out validation at step {chosen['step']} (the trainer's simulated acceptance, metrics.jsonl):"
        evals.tables.append((title, markdown_table(rows)))
    curve = [(r["step"], r["eval/acceptance_length"]) for r in records if "eval/acceptance_length" in r]
    if len(curve) >= 2:
        evals.plots["acceptance_length.png"] = acceptance_plot(curve)


def acceptance_plot(curve: list[tuple[int, float]]) -> bytes:
    """A small PNG of the simulated acceptance length per evaluated step."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3), dpi=100)
    axis.plot([s for s, _ in curve], [a for _, a in curve], marker="o")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("acceptance length (held-out)")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


# ---- rendering ---------------------------------------------------------------------------------------------
def json_table(data: Any) -> str:
    """A markdown table for the common result shapes: a list of row dicts, ``{"results"|"rows": [...]}``, a dict of
    per-dataset dicts, or a flat dict of metrics. Anything else gives ``""``."""
    if isinstance(data, dict):
        for key in ("results", "rows", "datasets", "summary"):
            if isinstance(data.get(key), (list, dict)):
                nested = json_table(data[key])
                if nested:
                    return nested
        if data and all(isinstance(v, dict) for v in data.values()):
            rows = [{"name": k, **{kk: vv for kk, vv in v.items() if _scalar(vv)}} for k, v in data.items()]
            return markdown_table(rows)
        scalars = {k: v for k, v in data.items() if _scalar(v)}
        return markdown_table([{"metric": k, "value": v} for k, v in scalars.items()]) if scalars else ""
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        return markdown_table([{k: v for k, v in r.items() if _scalar(v)} for r in data])
    return ""


def markdown_table(rows: list[dict[str, Any]]) -> str:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    if not columns:
        return ""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def render_model_card(info: CardInfo) -> str:
    """The card's markdown. Every absolute local path left in what it shows (a recipe value, a source directory, a
    results file) is replaced on the way out: relative to ``info.run_dir`` inside it, else by its name only."""
    config = info.config
    spec = config["speculators_config"]
    local_verifier = is_local_path(spec["verifier"]["name_or_path"])
    verifier = public_name(spec["verifier"]["name_or_path"])
    k = spec["proposal_methods"][0]["speculative_tokens"]
    layer = config["transformer_layer_config"]
    from speculators.format.validate import algorithm_of

    unit = algorithm_of(config)
    kind = algorithm_display_name(config)
    article = unit.article_of(config) if unit is not None else "A"
    legacy = algorithms.get(algorithms.LEGACY_TYPE)  # what a config without a type is read as
    method = unit.vllm_method if unit is not None else legacy.vllm_method
    aux_key = (unit or legacy).aux_layer_key
    # the draft's own layers as its config class counts them (MTP's layer config is the verifier's whole config)
    draft_layers = (
        unit.config_class.from_dict(config).num_layers
        if unit is not None
        else layer.get("num_hidden_layers", 1)
    )
    own_keys = unit.card_keys if unit is not None else ()
    parts = [
        f"# {card_title(info)}",
        "",
        f"{article} {kind} speculative-decoding draft for "
        f"`{shown_verifier(info)}`, in the standard `speculators` checkpoint "
        "format"
        + (
            f". vLLM does not serve it: {unit.vllm_unserved}; the speculators engine (`speculators eval`) serves it."
            if unit is not None and unit.vllm_unserved
            else ". vLLM does not serve it: its model for this verifier family lacks the EAGLE-3 aux-hidden-state "
            f'interface ("{info.vllm_refusal}"); the speculators engine (`speculators eval`) serves it.'
            if info.vllm_refusal
            else ": vLLM serves it as it is."
        )
        + " The draft proposes tokens; the verifier checks them, so the output is exactly the verifier's.",
        *(
            ["", f"**Verifier weights:** trained and measured against {info.verifier_note}."]
            if info.verifier_note
            else []
        ),
        "",
        "## Model",
        "",
        markdown_table(
            [
                {"": "verifier", "value": f"`{verifier}`"},
                {"": "verifier architectures", "value": ", ".join(spec["verifier"]["architectures"])},
                *([{"": "verifier weights", "value": info.verifier_note}] if info.verifier_note else []),
                {
                    "": "draft",
                    "value": f"{draft_layers} {layer['model_type']} decoder layer(s), "
                    f"hidden {layer['hidden_size']}",
                },
                {
                    "": "vocabulary",
                    "value": f"{config.get('draft_vocab_size', layer['vocab_size'])} draft tokens of "
                    f"{layer['vocab_size']}",
                },
                {
                    "": "aux hidden-state layers",
                    "value": f"{config.get(aux_key)} (vLLM convention: the residual stream entering layer k)",
                },
                {"": "speculative tokens", "value": k},
                *({"": key, "value": config[key]} for key in own_keys if key in config),
                {"": "weights", "value": config.get("torch_dtype")},
                {"": "source", "value": info.source},
            ]
        ),
        "",
        *(
            []
            if info.vllm_refusal or (unit is not None and unit.vllm_unserved)
            else [serving_section(verifier, k, local_verifier, method)]
        ),
    ]
    if info.lineage:
        from speculators.lineage import lineage_section

        parts += ["", lineage_section(info.lineage, markdown_table)]
    if info.training or info.recipe:
        parts += ["", training_section(info)]
    if info.evals.tables or info.evals.plots:
        parts += ["", evaluation_section(info.evals)]
    return scrub("\n".join(parts).rstrip() + "\n", info.run_dir)


def algorithm_display_name(config: dict[str, Any]) -> str:
    """How people name the config's algorithm (``P-EAGLE``, ``EAGLE-3.1``): its unit's name for it (a declared
    variant whose keys the config sets, else the unit's display name), else the type as written."""
    from speculators.format.validate import algorithm_of

    unit = algorithm_of(config)
    return unit.name_of(config) if unit is not None else str(config.get("speculators_model_type"))


def shown_verifier(info: CardInfo) -> str:
    """The verifier as a stranger can look it up: the hub id, or for a local directory the name the user gave."""
    name_or_path = info.config["speculators_config"]["verifier"]["name_or_path"]
    return public_name(info.verifier_ref) if is_local_path(name_or_path) else public_name(name_or_path)


def card_title(info: CardInfo) -> str:
    """What the draft is, from its validated config: ``P-EAGLE draft for Qwen/Qwen3-8B``."""
    return f"{algorithm_display_name(info.config)} draft for {shown_verifier(info)}"


def serving_section(verifier: str, k: int, local_verifier: bool, method: str) -> str:
    """How to serve the draft. ``verifier`` is its public name; ``local_verifier``: the config names a directory
    on the exporting machine, which the reader must point at their own copy; ``method``: vLLM's speculative
    method for the draft's type."""
    spec_config = json.dumps(
        {"method": method, "model": "<this directory or repo id>", "num_speculative_tokens": k}
    )
    local_note = (
        f"\n`speculators_config.verifier.name_or_path` is a directory (`{verifier}`) on the machine that exported "
        "this draft: point it at your copy of the verifier (or a hub id) before `vllm serve <draft>`.\n"
        if local_verifier
        else ""
    )
    return f"""## Serving with vLLM

The draft names its verifier, so vLLM can start from the draft alone (model and tokenizer come from the verifier):

```bash
vllm serve <this directory or repo id>
```

Or serve the verifier and attach the draft explicitly:

```bash
vllm serve {verifier} \\
  --speculative-config '{spec_config}'
```

In Python, `LLM(model="<draft>")` or
`LLM(model="{verifier}", speculative_config={{"method": "{method}", "model": "<draft>", "num_speculative_tokens": {k}}})`;
`llm.get_metrics()` reports `vllm:spec_decode_num_accepted_tokens` and `vllm:spec_decode_num_drafts`
(mean acceptance length = 1 + accepted / drafts).
{local_note}"""


def training_section(info: CardInfo) -> str:
    recipe = info.recipe
    rows = []
    if recipe.get("recipe_name"):
        rows.append({"": "recipe", "value": f"`{recipe['recipe_name']}`"})
    if isinstance(recipe.get("data"), dict):
        data = recipe["data"]
        name = data.get("name") or data.get("source") or data.get("path") or data.get("dataset")
        rows.append({"": "data", "value": f"`{name}`" if name else "see the recipe below"})
    rows += [{"": key, "value": value} for key, value in info.training.items()]
    text = ["## Training", "", markdown_table(rows) if rows else ""]
    if recipe:
        import yaml

        public = scrub(recipe, info.run_dir)
        dumped = yaml.safe_dump(public, sort_keys=False, default_flow_style=False).strip()
        text += [
            "",
            "<details><summary>Resolved recipe</summary>",
            "",
            "```yaml",
            dumped,
            "```",
            "",
            "</details>",
        ]
    return "\n".join(text)


def evaluation_section(evals: EvalArtifacts) -> str:
    text = ["## Evaluation"]
    for title, table in evals.tables:
        text += ["", title] + (["", table] if table else [])
    for name in evals.plots:
        text += ["", f"![{name}]({name})"]
    return "\n".join(text)


def format_duration(seconds: float) -> str:
    """``42 s``, ``4.0 min`` or ``2.50 h``: the one duration format (model cards, the trainer's console ETA)."""
    seconds = max(0.0, float(seconds))
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _first_number(record: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool):
            return float(record[key])
    return None


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value).replace("|", "\\|")
