"""Levers bench (issue 21): which training choices buy the most held-out acceptance per CPU-second, on the demo
recipe's data (``eagle3_smollm2``), every lane at the same training CPU budget.

Stages (each a subprocess, skipped when its done-marker exists: bench/acceptance_bench.py's stage runner):

1. data, two lanes side by side at one thread each: the recipe's features from the conversations' own answers
   (``data_gen``, its defaults), and a smaller set whose answers the verifier regenerates
   (``data_gen.regenerate.enabled=true``). Each one's data-generation CPU-seconds are recorded.
2. training lanes, two side by side at one thread each, every one with ``train.max_cpu_seconds`` = the same budget
   (the trainer measures its CPU-seconds per step after a few steps and fits the run and its lr schedule to the
   budget) and enough epochs that the budget, not the data, ends it:

   - ``baseline``: the recipe with TTT 3 (evaluated every few steps: the AL-vs-training-tokens points);
   - ``muon``: ``optim=muon`` (Muon on the 2-D hidden matrices, AdamW on the rest) vs AdamW;
   - ``vocab_16k`` / ``vocab_32k``: ``model.draft_vocab_size`` 16384 / 32768 vs the recipe's 8192, with the draft's
     own cost per drafting step (one token, one thread) measured after training;
   - ``ttt_2``: 2 training-time-test steps vs 3;
   - ``regenerated``: the regenerated-answer data; ``own_same_samples``: as many own-answer samples;
     ``own_equal_data_cpu``: as many own-answer samples as the regenerated data's generation CPU buys (capped at
     the data there is). Every lane is validated on the same held-out set (the own-answer data's: the regenerated
     lane trains from a view of its data directory with that held-out split).

Metric: the trainer's own held-out simulated acceptance length at k = 3 (``eval.k=3`` for every lane, so TTT 2 is
measured at k = 3 too) at the end of the budget and the best seen, training tokens, tokens/s and CPU-seconds. Other
processes' CPU during every wave is recorded, and the machine (CPU model, flags) — runs on other processors are
never compared unawares. The result lands in bench/results/levers.json (quick: levers_quick.json), written only
here, atomically, without local paths.

    .venv/bin/python bench/levers_bench.py             # ~30 min on 2 cores
    .venv/bin/python bench/levers_bench.py --quick     # < 6 min: proves the script end to end
    .venv/bin/python bench/levers_bench.py --override train.dtype=bf16 --root outputs/levers_bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import learning_curve
from bench.acceptance_bench import run_wave
from bench.machine_load import LoadWindow
from bench.record import REPO, as_measured, machine, num, pct
from speculators.atomic import atomic_write_json
from speculators.local_paths import scrub

PY = sys.executable
RECIPE = "eagle3_smollm2"
EVAL_K = 3
BASE_VOCAB = 8192  # the recipe's model.draft_vocab_size (the lanes name theirs relative to it)
# every lane but ttt_2 trains 3 TTT steps: levers.json made 2 the recipe's default, and a re-run must still compare
# each lever against the same baseline and 3 against 2
BASE_TTT = 3
GOAL_AL = 2.0
NEVER = 10**9  # an eval/save cadence no run reaches: only the last step evaluates and saves


@dataclass(frozen=True)
class Size:
    """How big a run is: quick proves the script end to end; full produces the figures."""

    root: str
    out: str
    data: list[str]  # overrides of both data sets
    regen: list[str]  # overrides of the regenerated set only
    train: list[str]  # overrides of every training lane
    budget_cpu_s: float  # training CPU-seconds per lane
    epochs: int  # an upper bound the budget cuts short
    curve_eval_every: int  # the baseline lane's evaluation cadence (optimizer steps)
    draft_step_repeats: int


QUICK = Size(
    root="outputs/levers_quick",
    out="bench/results/levers_quick.json",
    data=["data.max_conversations=32", "data.max_length=256", "data.heldout_fraction=0.2"],
    regen=[
        "data.max_conversations=8",
        "data_gen.regenerate.backend=transformers",
        "data_gen.regenerate.max_new_tokens=32",
        "data_gen.regenerate.batch_size=8",
    ],
    train=["eval.max_samples=6", "train.max_length=256"],
    budget_cpu_s=25,  # the first 10 steps measure the cost per step: the budget must outlast them
    epochs=50,
    curve_eval_every=10,  # not before the cost probe ends (an evaluation in it would shorten the run)
    draft_step_repeats=5,
)
FULL = Size(
    root="outputs/levers",
    out="bench/results/levers.json",
    data=["data.max_conversations=200"],  # the data its results were measured on (512 tokens each)
    regen=[
        "data.max_conversations=48",
        "data_gen.regenerate.backend=vllm",  # as the acceptance bench regenerates
        "data_gen.regenerate.threads=1",  # one core: the own-answer capture runs on the other
    ],
    train=[],
    budget_cpu_s=300,  # about one epoch of the demo data at today's defaults, one thread
    epochs=20,
    curve_eval_every=30,  # after the trainer's 10-step cost probe
    draft_step_repeats=50,
)


@dataclass(frozen=True)
class Lane:
    """One training run: what it tests, its overrides and which data it trains on (``own`` or ``regenerated``)."""

    name: str
    what: str
    overrides: list[str] = field(default_factory=list)
    data: str = "own"


def lanes(regenerated_samples: int, equal_cpu_samples: int) -> list[Lane]:
    """Every lane; the data lanes' sample counts come from the data stage (see :func:`equal_cpu_samples`)."""
    return [
        Lane("baseline", "eagle3_smollm2 with AdamW, draft vocab 8192, TTT 3"),
        Lane("muon", "optim=muon: Muon on the 2-D hidden matrices, AdamW on the rest", ["optim=muon"]),
        Lane("vocab_16k", "draft vocabulary 16384", ["model.draft_vocab_size=16384"]),
        Lane("vocab_32k", "draft vocabulary 32768", ["model.draft_vocab_size=32768"]),
        Lane("ttt_2", "2 training-time-test steps (evaluated at k=3 like every lane)", ["train.ttt_steps=2"]),
        Lane("regenerated", "answers regenerated by the verifier", [], "regenerated"),
        Lane(
            "own_same_samples",
            "own answers, as many samples as the regenerated data",
            [f"train.max_samples={regenerated_samples}"],
        ),
        Lane(
            "own_equal_data_cpu",
            "own answers, as many samples as the regenerated data's generation CPU buys (capped at the data there is)",
            [f"train.max_samples={equal_cpu_samples}"],
        ),
    ]


def equal_cpu_samples(regen_cpu_s: float, own_cpu_s: float, own_samples: int) -> tuple[int, bool]:
    """Own-answer samples whose capture costs the regenerated set's generation CPU (at the own data's CPU per
    sample), capped at ``own_samples``; also whether the cap bit."""
    wanted = round(regen_cpu_s * own_samples / max(own_cpu_s, 1e-9))
    return max(1, min(wanted, own_samples)), wanted > own_samples


def queues(all_lanes: list[Lane], count: int = 2) -> list[list[Lane]]:
    """The lanes dealt round-robin into ``count`` queues that run side by side (one thread each)."""
    return [all_lanes[i::count] for i in range(count)]


def train_command(lane: Lane, size: Size, data_dir: Path, run_dir: Path, extra: list[str]) -> list[str]:
    """The lane's training command: the same recipe, budget, thread and evaluation for every lane."""
    # one evaluation at the end (and a checkpoint), but the baseline's curve: epoch ends would cost the small-data
    # lanes an evaluation per epoch
    every = size.curve_eval_every if lane.name == "baseline" else NEVER
    curve = [f"train.eval_every={every}", f"train.save_every={NEVER}"]
    own_ttt = any(o.startswith("train.ttt_steps=") for o in lane.overrides)
    ttt = [] if own_ttt else [f"train.ttt_steps={BASE_TTT}"]
    return [
        PY,
        "train/run.py",
        f"recipe={RECIPE}",
        *as_measured(RECIPE),
        f"train.data_dir={data_dir}",
        f"run_dir={run_dir}",
        "logging=disabled",
        "logging.log_every=1",  # a CPU reading every step: the cost per step
        "train.cpu_threads=1",
        f"train.max_cpu_seconds={size.budget_cpu_s}",
        f"train.epochs={size.epochs}",
        f"eval.k={EVAL_K}",
        *ttt,
        "train.keep_checkpoints=1",
        *size.train,
        *curve,
        *lane.overrides,
        *extra,
    ]


def merged(base: list[str], later: list[str]) -> list[str]:
    """``base`` then ``later``, a key set in both given once, as ``later`` sets it."""
    keys = {override.split("=", 1)[0] for override in later}
    return [o for o in base if o.split("=", 1)[0] not in keys] + later


def data_command(output: Path, overrides: list[str], extra: list[str]) -> list[str]:
    return [PY, "data_gen/run.py", f"recipe={RECIPE}", f"data_gen.output_dir={output}", *overrides, *extra]


# ---- the data -------------------------------------------------------------------------------------------------
def manifest(data_dir: Path, split: str = "train") -> dict[str, Any]:
    return json.loads((data_dir / split / "manifest.json").read_text())


def data_summary(data_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    train, heldout = manifest(data_dir), manifest(data_dir, "heldout")
    cpu = float(record.get("cpu_s") or 0.0)
    return {
        "command": record.get("command"),
        "data_gen_cpu_s": cpu,
        "data_gen_wall_s": record.get("wall_s"),
        "train_samples": int(train["num_samples"]),
        "train_tokens": int(train["num_tokens"]),
        "train_loss_tokens": int(train.get("num_loss_tokens", 0)),
        "heldout_samples": int(heldout["num_samples"]),
        "train_tokens_per_data_gen_cpu_s": round(int(train["num_tokens"]) / max(cpu, 1e-9), 2),
    }


def heldout_view(train_from: Path, heldout_from: Path, view: Path) -> Path:
    """A data directory whose training split (and token counts) are ``train_from``'s and whose held-out split is
    ``heldout_from``'s, by symlinks: lanes on different training data are validated on the same held-out set."""
    view.mkdir(parents=True, exist_ok=True)
    links = {
        "train": train_from / "train",
        "token_counts.safetensors": train_from / "token_counts.safetensors",
        "run_identity.json": train_from / "run_identity.json",
        "heldout": heldout_from / "heldout",
        "heldout_conversations.jsonl": heldout_from / "heldout_conversations.jsonl",
    }
    for name, target in links.items():
        link = view / name
        if target.exists() and not link.is_symlink():
            link.symlink_to(target.resolve())
    return view


# ---- reading a lane -------------------------------------------------------------------------------------------
def lane_result(run_dir: Path, budget: float, data_gen_cpu_s: float) -> dict[str, Any]:
    """The lane's figures from its ``metrics.jsonl``: AL at the end of the budget and the best seen, training
    tokens, tokens/s and CPU-seconds, and its AL-vs-training-tokens points (CPU-hours include ``data_gen_cpu_s``)."""
    records = learning_curve.read_metrics(run_dir)
    trains = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    totals = learning_curve.training_totals(records)
    tokens, steps, cpu = totals["tokens"], totals["steps"], totals["cpu_s_at_last_step"]
    seconds = sum(float(r["tokens"]) / r["tokens_per_s"] for r in trains if r.get("tokens_per_s"))
    per_step = None if totals["cpu_s_per_step"] is None else round(totals["cpu_s_per_step"], 3)
    final = evals[-1] if evals else {}
    best = max((r.get("eval/acceptance_length") or 0.0 for r in evals), default=None)
    return {
        "heldout_simulated_al_k3": final.get("eval/acceptance_length"),
        "best_heldout_simulated_al_k3": best,
        "heldout_acc": [final[k] for k in sorted(final) if k.startswith("eval/acc_")],
        "heldout_positions": final.get("eval/positions"),
        "steps": steps,
        "training_tokens": int(tokens),
        "training_tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "process_cpu_s_at_last_step": round(cpu, 1),
        "cpu_s_per_step": per_step,
        "training_cpu_budget_s": budget,
        "curve_points": learning_curve.curve_points(records, {}, data_gen_cpu_s),
    }


def draft_step_ms(run_dir: Path, repeats: int) -> float | None:
    """Median milliseconds of one drafting step (one token, batch 1, one thread) of the lane's final draft: what a
    larger draft vocabulary costs at every drafted token (mostly the LM head)."""
    import torch

    from speculators import runs
    from speculators.algorithms.eagle3.model import Eagle3DraftModel

    checkpoint = runs.latest_checkpoint(run_dir)
    if checkpoint is None:
        return None
    draft = Eagle3DraftModel.from_pretrained(runs.resolve_draft_dir(checkpoint)).eval()
    hidden = torch.randn(1, 1, draft.config.hidden_size)
    ids, positions = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    times = []
    with torch.no_grad():
        for i in range(repeats + 3):
            start = time.perf_counter()
            draft(ids, hidden, positions)
            if i >= 3:  # warm-up excluded
                times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 3)


def data_share(lane: Lane, own_samples: int) -> float:
    """The share of its data set's generation CPU a lane uses: a ``train.max_samples`` prefix of the own data
    costs its share; every other lane uses the whole set."""
    for override in lane.overrides:
        if override.startswith("train.max_samples="):
            return min(1.0, int(override.split("=", 1)[1]) / max(own_samples, 1))
    return 1.0


SPEED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def machine_info() -> dict[str, Any]:
    """The acceptance bench's machine record plus the CPU flags that decide fp32/bf16 speed."""
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        line = next((x for x in cpuinfo.read_text().splitlines() if x.startswith("flags")), "")
        flags = set(line.partition(":")[2].split())
    return {**machine(), "cpu_flags": [flag for flag in SPEED_FLAGS if flag in flags]}


def al_change(lane: dict[str, Any], base: dict[str, Any]) -> float | None:
    a, b = lane.get("heldout_simulated_al_k3"), base.get("heldout_simulated_al_k3")
    return round(100 * (a / b - 1), 2) if a and b else None


def comparisons(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline pairs, AL at k = 3 at the same training CPU."""

    def al(name: str) -> float | None:
        return (results.get(name) or {}).get("heldout_simulated_al_k3")

    return {
        "muon_vs_adamw": {"muon": al("muon"), "adamw": al("baseline")},
        "draft_vocab": {
            size: {
                "al": al(name),
                "draft_step_ms": (results.get(name) or {}).get("draft_step_ms"),
                "cpu_s_per_training_step": (results.get(name) or {}).get("cpu_s_per_step"),
            }
            for size, name in (("8k", "baseline"), ("16k", "vocab_16k"), ("32k", "vocab_32k"))
        },
        "ttt_steps": {"3": al("baseline"), "2": al("ttt_2")},
        "answers": {
            "regenerated": al("regenerated"),
            "own_same_samples": al("own_same_samples"),
            "own_equal_data_cpu": al("own_equal_data_cpu"),
        },
    }


def wave_load(window: LoadWindow, stage_cpu_s: float) -> dict[str, Any]:
    """Other processes' CPU while a wave ran: the machine's busy CPU minus the wave's stages (their own CPU, from
    ``wait4``) and this process."""
    if window.machine_busy_s is None:
        return {"wall_s": round(window.wall_s, 1), "others_cpu_s": None}
    others = max(0.0, window.machine_busy_s - stage_cpu_s - (window.ours_s or 0.0))
    return {
        "wall_s": round(window.wall_s, 1),
        "stages_cpu_s": round(stage_cpu_s, 1),
        "others_cpu_s": round(others, 1),
        "others_core_share": round(others / max(window.wall_s, 1e-9), 3),
    }


def run_measured_wave(
    name: str, lanes_: list[list[tuple[str, list[str], Path]]], logs: Path
) -> tuple[dict, dict]:
    """:func:`acceptance_bench.run_wave` with the other processes' CPU while it ran, kept beside the logs: a re-run
    that skips every stage reports the load of the run that produced them; one that ran some says so."""
    with LoadWindow() as window:
        records = run_wave(lanes_, logs)
    saved = logs / f"load_{name}.json"
    ran = [r for r in records.values() if not r.get("skipped")]
    if not ran and saved.is_file():
        return records, json.loads(saved.read_text())
    load = wave_load(window, sum(float(r.get("cpu_s") or 0.0) for r in ran))
    load["stages_skipped"] = len(records) - len(ran)  # run by an earlier, interrupted run: not in this window
    atomic_write_json(saved, load)
    return records, load


# ---- the bench ------------------------------------------------------------------------------------------------
def make_data(size: Size, root: Path, logs: Path, extra: list[str]) -> tuple[dict, dict, dict]:
    """Both data sets side by side (skipped when done); their summaries, stage records and the wave's load."""
    own_dir, regen_dir = root / "data_own", root / "data_regenerated"
    regen = merged(size.data, ["data_gen.regenerate.enabled=true", *size.regen])
    wave = [
        [("data_own", data_command(own_dir, size.data, extra), own_dir)],
        [("data_regenerated", data_command(regen_dir, regen, extra), regen_dir)],
    ]
    records, load = run_measured_wave("data", wave, logs)
    data = {
        "own": {"dir": str(own_dir), **data_summary(own_dir, records["data_own"])},
        "regenerated": {"dir": str(regen_dir), **data_summary(regen_dir, records["data_regenerated"])},
    }
    own, regenerated = data["own"], data["regenerated"]
    equal, capped = equal_cpu_samples(
        regenerated["data_gen_cpu_s"], own["data_gen_cpu_s"], own["train_samples"]
    )
    data["own_equal_data_cpu"] = {"train_samples": equal, "capped_at_own_data": capped}
    data["own_tokens_per_cpu_over_regenerated"] = round(
        own["train_tokens_per_data_gen_cpu_s"] / max(regenerated["train_tokens_per_data_gen_cpu_s"], 1e-9), 2
    )
    return data, records, load


def train_lanes(
    all_lanes: list[Lane], data_dirs: dict[str, Path], size: Size, root: Path, logs: Path, extra: list[str]
) -> tuple[dict, dict]:
    """Every lane, two queues side by side; their stage records and the wave's load."""

    def stages(queue: list[Lane]) -> list[tuple[str, list[str], Path]]:
        run_dirs = [root / "runs" / lane.name for lane in queue]
        return [
            (f"train_{lane.name}", train_command(lane, size, data_dirs[lane.data], run_dir, extra), run_dir)
            for lane, run_dir in zip(queue, run_dirs, strict=True)
        ]

    return run_measured_wave("training", [stages(queue) for queue in queues(all_lanes)], logs)


def read_lanes(
    all_lanes: list[Lane], data: dict, records: dict, size: Size, root: Path
) -> dict[str, dict[str, Any]]:
    """Each lane's figures, its draft's step cost, and its CPU including its share of data generation."""
    import torch

    torch.set_num_threads(1)
    own_samples = data["own"]["train_samples"]
    results: dict[str, dict[str, Any]] = {}
    for lane in all_lanes:
        run_dir, record = root / "runs" / lane.name, records[f"train_{lane.name}"]
        data_cpu = data[lane.data]["data_gen_cpu_s"] * data_share(lane, own_samples)
        with LoadWindow() as window:
            step_ms = draft_step_ms(run_dir, size.draft_step_repeats)
        results[lane.name] = {
            "what": lane.what,
            "data": lane.data,
            "overrides": lane.overrides,
            "command": record["command"],
            "stage_cpu_s": record["cpu_s"],
            "stage_wall_s": record["wall_s"],
            **lane_result(run_dir, size.budget_cpu_s, data_cpu),
            "data_gen_cpu_s": round(data_cpu, 1),
            "total_cpu_s": round(data_cpu + float(record["cpu_s"] or 0.0), 1),
            "draft_step_ms": step_ms,
            "draft_step_load": window.report(),
        }
    for result in results.values():
        result["al_vs_baseline_pct"] = al_change(result, results["baseline"])
    return results


def curve(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The baseline lane's AL-vs-training-tokens points refit with bench/learning_curve.py, and every other
    lane's final point beside them."""
    points = results["baseline"]["curve_points"]
    fit = learning_curve.log_fit(points, "simulated_al")
    needed = learning_curve.tokens_for(fit, GOAL_AL)
    return {
        "lane": "baseline",
        "points": points,
        "other_lanes_final_points": {
            name: r["curve_points"][-1]
            for name, r in results.items()
            if r["curve_points"] and name != "baseline"
        },
        "log_fit": fit,
        "goal_al": GOAL_AL,
        "training_tokens_for_goal_if_trend_held": round(needed) if needed else None,
        "note": "learning_curve.log_fit over the baseline lane's evaluations: AL = a + b log10(training tokens); "
        "far outside the points it is an extrapolation",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (< 6 min), outputs/levers_quick")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Hydra override appended to every data_gen and training command (e.g. a compute dtype); "
        "use another --root for another setting: finished stages are skipped",
    )
    parser.add_argument("--root", help="where the runs go (default outputs/levers[_quick])")
    parser.add_argument("--out", help="result JSON (default bench/results/levers[_quick].json)")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    size = QUICK if args.quick else FULL
    root = Path(args.root or size.root)
    root = root if root.is_absolute() else REPO / root
    logs = root / "bench_logs"
    os.environ["OMP_NUM_THREADS"] = "1"  # every stage one thread: two lanes side by side on two cores
    started = time.perf_counter()
    load: dict[str, Any] = {}
    data, stage_records, load["data"] = make_data(size, root, logs, args.override)
    own_dir, regen_dir = Path(data["own"]["dir"]), Path(data["regenerated"]["dir"])
    data_dirs = {
        "own": own_dir,
        "regenerated": heldout_view(regen_dir, own_dir, root / "data_regenerated_view"),
    }
    all_lanes = lanes(data["regenerated"]["train_samples"], data["own_equal_data_cpu"]["train_samples"])
    records, load["training"] = train_lanes(all_lanes, data_dirs, size, root, logs, args.override)
    stage_records.update(records)
    results = read_lanes(all_lanes, data, stage_records, size, root)
    flags = [*(["--quick"] if args.quick else []), *[f"--override {o}" for o in args.override]]
    result = {
        "benchmark": "levers at equal training CPU-seconds (issue 21), demo recipe data",
        "mode": "quick" if args.quick else "full",
        "machine": machine_info(),
        "command": " ".join([".venv/bin/python", "bench/levers_bench.py", *flags]),
        "recipe": RECIPE,
        "overrides": args.override,
        "budget": {
            "training_cpu_s_per_lane": size.budget_cpu_s,
            "threads_per_lane": 1,
            "lanes_side_by_side": 2,
            "epochs_upper_bound": size.epochs,
            "how": "train.max_cpu_seconds: after 10 steps the trainer fits the run and its lr schedule to the budget",
        },
        "metric": f"held-out simulated acceptance length at k={EVAL_K} (eval/acceptance_length of the last "
        "evaluation, at the end of the budget), on the own-answer data's held-out split for every lane",
        "data": data,
        "lanes": {name: {k: v for k, v in r.items() if k != "curve_points"} for name, r in results.items()},
        "comparisons": comparisons(results),
        "curve": curve(results),
        "load": load,
        "stages": stage_records,
        "total_wall_s": round(time.perf_counter() - started, 1),
        "notes": "cpu_s of a stage: its own process tree's CPU (wait4), start-up and evaluations included; "
        "process_cpu_s_at_last_step: the trainer's CPU when its budgeted steps were done (start-up included); "
        "cpu_s_per_step: between the first and the last step (the baseline's includes its curve evaluations); "
        "draft_step_ms: one drafting step of the final draft, one token, one thread, timed by this script with "
        "its load beside it. Wall times and tokens/s depend on the machine's load (see load). Wall times of skipped "
        "stages are those of the run that produced them. data_gen_cpu_s of a lane that trains on a prefix of the "
        "own data (train.max_samples) is the own data's CPU pro rata to the samples it uses.",
    }
    out = Path(args.out) if args.out else REPO / size.out
    atomic_write_json(out, scrub(result, REPO))
    print(json.dumps(result["comparisons"], indent=1))
    print(f"[levers] wrote {out} ({result['total_wall_s']:.0f} s)")


__all__ = ["equal_cpu_samples", "lanes", "queues"]


# ---- its section of bench/results/SUMMARY.md ------------------------------------------------------------------
RESULTS = ("levers", "levers_quick")  # the result files this bench writes (bench/results/<stem>.json)


def render(result: dict[str, Any]) -> list[str]:
    """One row per lane at equal training CPU-seconds."""
    budget = result.get("budget") or {}
    lines = [
        f"- mode {result.get('mode')}; {budget.get('training_cpu_s_per_lane')} training CPU-s per lane; "
        f"{result.get('metric')}",
        "",
        "| lane | held-out AL (end) | best | training tokens | tokens/s | CPU-s/step | draft step ms | vs baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, lane in (result.get("lanes") or {}).items():
        lines.append(
            f"| {name} | {num(lane.get('heldout_simulated_al_k3'), 4)} | "
            f"{num(lane.get('best_heldout_simulated_al_k3'), 4)} | {lane.get('training_tokens')} | "
            f"{lane.get('training_tokens_per_s')} | {lane.get('cpu_s_per_step')} | {num(lane.get('draft_step_ms'), 2)} | "
            f"{pct(None if lane.get('al_vs_baseline_pct') is None else lane['al_vs_baseline_pct'] / 100)} |"
        )
    return lines


if __name__ == "__main__":
    run()
