"""Adapt a serving draft to its traffic: ``python train/adapt.py recipe=<parent's recipe> adapt.traffic=LOG
adapt.parent=DRAFT [run_dir=DIR] [adapt.error_replay=true] [overrides]``.

One resumable command from a served log to a refreshed draft (``recipes/adapt/default.yaml`` says every setting):

1. **data**: data_gen reads the log as served traffic (``data.format=auto`` finds the served layouts), orders it by
   time and holds out the latest ``adapt.window`` share; with ``adapt.error_replay`` the serving draft answers in
   our engine and the tokens it got wrong are weighted up (``data_gen.regenerate.backend=engine``).
2. **train**: the parent draft warm-starts the run (``train.init_from``) with its own vocabulary
   (``train.init_vocab=parent``: traffic has other token counts), ``adapt.replay_share`` of the samples come from
   the original training data, within ``adapt.cpu_seconds``.
3. **export** with the lineage (``speculators.lineage``: the parent's hash, the windows' counts, times and hashes).
4. **eval**: the parent and the adapted draft on the held-out window (and on the original held-out data), with
   ``speculators eval`` at the parent's k.
5. **card**: the export again, its card and config carrying the figures before and after.

Each stage is a process of its own (data_gen and the trainer are resumable by themselves; the export and the
evaluations are written atomically), and ``<run_dir>/adapt_state.json`` records the settings and the stages done:
run the same command again after an interruption and it continues; a rerun with other settings is refused before
anything is written. The adapted run never writes into the parent's directory or the replayed data.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parent.parent
STATE_NAME = "adapt_state.json"
STAGES = ("data", "train", "export", "eval", "card")
# what adapt sets in the stages' recipes: a user override of one of these would fight it (set adapt.* instead)
OWNED_KEYS = (
    "run_dir",
    "data.source",
    "data.max_conversations",
    "data.heldout_by",
    "data.heldout_fraction",
    "data.served_model",
    "data_gen.output_dir",
    "data_gen.regenerate.enabled",
    "data_gen.regenerate.backend",
    "data_gen.regenerate.draft",
    "data_gen.regenerate.k",
    "data_gen.regenerate.replay_weight",
    "train.data_dir",
    "train.init_from",
    "train.init_vocab",
    "train.replay.",
    "train.max_cpu_seconds",
    "train.max_samples",
    "train.epochs",
    "train.resume",
)


class AdaptError(ValueError):
    """A user's mistake in the adapt settings: one line."""


@dataclass
class Plan:
    """Everything the stages need, resolved once from the composed config."""

    run_dir: Path
    recipe: str
    parent: Path  # the draft directory served (a run dir's best draft, or an export)
    parent_source: str  # as the user named it
    traffic: Path
    k: int
    replay_data_dir: Path | None
    original_prompts: Path | None
    settings: dict[str, Any]  # the adapt group, resolved
    user_overrides: list[str]

    @property
    def data_dir(self) -> Path:
        return self.run_dir / "data"

    @property
    def export_dir(self) -> Path:
        return self.run_dir / "export"


# ---- resolving the settings -------------------------------------------------------------------------------------
def _parent_run(source: Path) -> Path | None:
    """The training run a parent belongs to: the run directory itself, or the run an export sits in."""
    from speculators.runs import RECIPE_NAME, run_of

    for candidate in (source, source.parent, run_of(source.parent) if source.name == "draft" else None):
        if candidate is not None and (candidate / RECIPE_NAME).is_file():
            return candidate
    return None


def _replay_dir(settings: dict[str, Any], parent: Path) -> Path | None:
    if float(settings["replay_share"]) == 0:
        return None
    if settings.get("replay_data_dir"):
        return Path(settings["replay_data_dir"])
    from speculators.runs import read_recipe, recipe_value

    run = _parent_run(parent)
    data_dir = recipe_value(read_recipe(run), "train.data_dir") if run is not None else None
    if not data_dir:
        raise AdaptError(
            f"adapt.replay_share={settings['replay_share']} but the original training data of {parent} is not "
            "known (the parent is not a run directory nor an export inside one); set adapt.replay_data_dir to "
            "its features, or adapt.replay_share=0"
        )
    path = Path(data_dir)
    return path if path.is_absolute() or path.exists() else (run / ".." / path).resolve()


def _original_prompts(settings: dict[str, Any], replay: Path | None) -> Path | None:
    original = settings["eval"].get("original")
    if original in (None, "null", ""):
        return None
    if original == "auto":
        return replay
    return Path(original)


def _served_k(parent: Path) -> int:
    from speculators.format.checkpoint import read_config

    return int(read_config(parent)["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


def _check_owned(overrides: list[str]) -> None:
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if any(key == owned or key.startswith(owned) for owned in OWNED_KEYS):
            raise AdaptError(
                f"override {override!r}: adapt sets {key} itself; set it through the adapt group "
                "(recipes/adapt/default.yaml: adapt.window, adapt.cpu_seconds, adapt.replay_share, ...)"
            )


def _inside(path: Path, other: Path) -> bool:
    path, other = path.resolve(), other.resolve()
    return path == other or other in path.parents or path in other.parents


def plan_from(cfg: DictConfig, user_overrides: list[str]) -> Plan:
    """The stages' inputs, checked before anything is written (a missing log or parent, a run directory that is or
    holds the parent or the replayed data)."""
    from speculators.runs import resolve_draft_dir

    settings = OmegaConf.to_container(cfg.adapt, resolve=True)
    if OmegaConf.is_missing(cfg.adapt, "traffic") or OmegaConf.is_missing(cfg.adapt, "parent"):
        raise AdaptError("give the served log and the serving draft: adapt.traffic=LOG adapt.parent=DRAFT")
    traffic, parent_source = Path(settings["traffic"]), str(settings["parent"])
    if not traffic.is_file():
        raise AdaptError(f"adapt.traffic={traffic} is not a file; give the served log (JSONL)")
    parent = resolve_draft_dir(parent_source)
    run_dir = Path(str(cfg.run_dir))
    replay = _replay_dir(settings, Path(parent_source))
    for name, path in (
        ("adapt.parent", Path(parent_source)),
        ("the parent's training run", _parent_run(Path(parent_source))),
        ("the replayed data", replay),
        ("adapt.traffic", traffic),
    ):
        if path is not None and _inside(run_dir, path):
            raise AdaptError(
                f"run_dir={run_dir} is, holds or lies inside {name} ({path}); give the adapted run a directory "
                "of its own (run_dir=...)"
            )
    if not 0.0 < float(settings["window"]) < 1.0:
        raise AdaptError(f"adapt.window={settings['window']}: the held-out share must be in (0, 1)")
    if not 0.0 <= float(settings["replay_share"]) < 1.0:
        raise AdaptError(f"adapt.replay_share={settings['replay_share']}: it must be in [0, 1)")
    _check_owned(user_overrides)
    return Plan(
        run_dir=run_dir,
        recipe=recipe_choice(cfg),
        parent=parent,
        parent_source=parent_source,
        traffic=traffic,
        k=int(settings["k"] or _served_k(parent)),
        replay_data_dir=replay,
        original_prompts=_original_prompts(settings, replay),
        settings=settings,
        user_overrides=user_overrides,
    )


# ---- the state file: same settings or refused ----------------------------------------------------------------
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def identity(plan: Plan) -> dict[str, Any]:
    """What makes two adapt runs the same run: the settings, the user's overrides and the inputs' bytes."""
    from speculators.lineage import draft_hash

    return {
        "recipe": plan.recipe,
        "settings": {k: v for k, v in plan.settings.items() if k != "launch"},
        "overrides": plan.user_overrides,
        "parent_sha256": draft_hash(plan.parent),
        "traffic_sha256": file_sha256(plan.traffic),
    }


def read_state(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / STATE_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def write_state(run_dir: Path, state: dict[str, Any]) -> None:
    from speculators.atomic import atomic_write_json

    atomic_write_json(run_dir / STATE_NAME, state)


def check_same_adapt(plan: Plan, mine: dict[str, Any]) -> dict[str, Any]:
    """The state to continue from: a fresh one for an empty run directory, the saved one when it is this run,
    refused (before anything is written) when the directory holds another run."""
    saved = read_state(plan.run_dir)
    if saved is None:
        if plan.run_dir.exists() and any(
            p.name != "hydra" for p in plan.run_dir.iterdir()
        ):  # Hydra's own log
            raise AdaptError(
                f"run_dir={plan.run_dir} holds files but no {STATE_NAME}: it is not an adapt run; give the adapted "
                "run a new directory"
            )
        return {"identity": mine, "done": {}}
    differing = [
        f"{key}: {saved['identity'].get(key)!r} -> {mine.get(key)!r}"
        for key in sorted(set(saved["identity"]) | set(mine))
        if saved["identity"].get(key) != mine.get(key)
    ]
    if differing:
        raise AdaptError(
            f"{plan.run_dir} holds an adapt run with other settings or inputs ({'; '.join(differing)}); rerun with "
            "its settings to continue it, or give a new run_dir"
        )
    return saved


# ---- the stages ---------------------------------------------------------------------------------------------
def data_overrides(plan: Plan) -> list[str]:
    """The recipe overrides every stage shares: the run, the log as the data source, the time split."""
    s = plan.settings
    out = [
        f"recipe={plan.recipe}",
        f"run_dir={plan.run_dir}",
        f"data.source={plan.traffic}",
        "data.max_conversations=null",  # every request of the log: adapt.max_requests limits the training
        "data.heldout_by=time",
        f"data.heldout_fraction={s['window']}",
        f"data_gen.output_dir={plan.data_dir}",
    ]
    if s.get("served_model"):
        out.append(f"data.served_model={s['served_model']}")
    if s["error_replay"]:
        out += [
            "data_gen.regenerate.enabled=true",
            "data_gen.regenerate.backend=engine",
            f"data_gen.regenerate.draft={plan.parent}",
            f"data_gen.regenerate.k={plan.k}",
            f"data_gen.regenerate.replay_weight={s['replay_weight']}",
        ]
    elif s["regenerate"]:
        out.append("data_gen.regenerate.enabled=true")
    return out


def train_overrides(plan: Plan) -> list[str]:
    s = plan.settings
    out = [
        f"train.data_dir={plan.data_dir}",
        f"train.init_from={plan.parent}",
        "train.init_vocab=parent",
        f"train.max_cpu_seconds={s['cpu_seconds']}",
        f"train.epochs={s['epochs']}",
    ]
    if plan.replay_data_dir is not None:
        out += [f"train.replay.data_dir={plan.replay_data_dir}", f"train.replay.share={s['replay_share']}"]
    if s.get("max_requests"):
        out.append(f"train.max_samples={s['max_requests']}")
    return out


def launcher(plan: Plan) -> list[str]:
    return shlex.split(plan.settings["launch"]) if plan.settings.get("launch") else [sys.executable]


def run_stage(command: list[str], what: str) -> None:
    """One stage as a child process; its own output (progress bars included) goes straight to the terminal."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    status = subprocess.run(command, cwd=REPO, env=env, check=False).returncode
    if status != 0:
        raise AdaptError(
            f"{what} failed (exit status {status}; its error is above); fix it and rerun this command"
        )


def eval_command(plan: Plan, draft: Path, prompts: Path, output: Path) -> list[str]:
    e = plan.settings["eval"]
    command = [
        sys.executable, "-m", "speculators", "eval", str(draft), "--prompts", str(prompts),
        "--max-new-tokens", str(e["max_new_tokens"]), "--max-prompt-tokens", str(e["max_prompt_tokens"]),
        "--k", str(plan.k), "--batch-size", "1", "--no-oracle", "--threads", str(e["threads"]),
        "--dtype", str(e["dtype"]), "--overwrite", "--output", str(output),
    ]  # fmt: skip
    if e.get("max_prompts"):
        command += ["--max-prompts", str(e["max_prompts"])]
    if e.get("vllm"):
        command.append("--vllm")
    return command


def evaluations(plan: Plan) -> list[tuple[str, Path, Path, Path]]:
    """``(name, draft, prompts, output)`` of every evaluation: window and original domain, before and after."""
    out = [
        ("window_before", plan.parent, plan.data_dir, plan.run_dir / "eval" / "window_before"),
        ("window_after", plan.export_dir, plan.data_dir, plan.run_dir / "eval" / "window_after"),
    ]
    if plan.original_prompts is not None:
        out += [
            (
                "original_before",
                plan.parent,
                plan.original_prompts,
                plan.run_dir / "eval" / "original_before",
            ),
            (
                "original_after",
                plan.export_dir,
                plan.original_prompts,
                plan.run_dir / "eval" / "original_after",
            ),
        ]
    return out


def acceptance_length(results: dict[str, Any]) -> float | None:
    """Our engine's acceptance length at the evaluated k (vLLM's when eval ran it: what serving sees)."""
    for name, run in (results.get("vllm") or {}).items():
        if name != "plain" and isinstance(run, dict) and run.get("acceptance_length"):
            return float(run["acceptance_length"])
    runs = results.get("runs") or []
    return float(runs[0]["acceptance_length_global"]) if runs else None


def vllm_speedup_c1(results: dict[str, Any]) -> float | None:
    for name, run in (results.get("vllm") or {}).items():
        if name != "plain" and isinstance(run, dict) and run.get("speedup_vs_vllm_plain_one_at_a_time"):
            return float(run["speedup_vs_vllm_plain_one_at_a_time"])
    return None


# ---- lineage -------------------------------------------------------------------------------------------------
def traffic_windows(data_dir: Path) -> dict[str, Any]:
    """The adapted-on and held-out windows as data_gen recorded them (count, time range, hash)."""
    manifest = json.loads((data_dir / "train" / "manifest.json").read_text())
    windows = manifest.get("data", {}).get("source_report", {}).get("windows") or {}
    return {"adapted_on": windows.get("train", {}), "heldout": windows.get("heldout", {})}


def write_lineage(plan: Plan, figures: dict[str, Any] | None = None) -> dict[str, Any]:
    from speculators import algorithms
    from speculators.atomic import atomic_write_json
    from speculators.format.checkpoint import read_config
    from speculators.lineage import LINEAGE_NAME, draft_hash, public_lineage

    lineage = {
        "parent": {
            "sha256": draft_hash(plan.parent),
            "algorithm": algorithms.of_config(read_config(plan.parent)).name,
        },
        "traffic": traffic_windows(plan.data_dir),
        "adapt": {
            "cpu_s": float(plan.settings["cpu_seconds"]),
            "replay_share": float(plan.settings["replay_share"]) if plan.replay_data_dir else 0.0,
            "error_replay": int(bool(plan.settings["error_replay"])),
        },
        "figures": figures or {},
    }
    public_lineage(lineage)  # refuse here, not at export, a lineage that could not leave the run
    atomic_write_json(plan.run_dir / LINEAGE_NAME, lineage)
    return lineage


# ---- the run -------------------------------------------------------------------------------------------------
def banner(index: int, what: str, started: float) -> None:
    elapsed = time.strftime("%M:%S", time.gmtime(time.time() - started))
    print(f"\n\033[1m==> adapt [{elapsed}] {index}/{len(STAGES)} {what}\033[0m", flush=True)


def adapt(plan: Plan) -> dict[str, Any]:
    """Run (or continue) the stages; returns the before/after figures."""
    state = check_same_adapt(plan, identity(plan))
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    write_state(plan.run_dir, state)
    started = time.time()
    shared = data_overrides(plan) + plan.user_overrides

    def stage(name: str, what: str, work: Any) -> None:
        banner(STAGES.index(name) + 1, what, started)
        if state["done"].get(name):
            print(f"   done in an earlier attempt ({state['done'][name]})", flush=True)
            return
        work()
        state["done"][name] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_state(plan.run_dir, state)

    stage(
        "data",
        f"data_gen: {plan.traffic.name} -> {plan.data_dir} (latest {plan.settings['window']} held out)",
        lambda: run_stage([*launcher(plan), str(REPO / "data_gen" / "run.py"), *shared], "data_gen"),
    )
    stage(
        "train",
        f"training from the serving draft within {plan.settings['cpu_seconds']} CPU-s -> {plan.run_dir}",
        lambda: run_stage(
            [*launcher(plan), str(REPO / "train" / "run.py"), *shared, *train_overrides(plan)], "training"
        ),
    )

    def export() -> None:
        write_lineage(plan)
        run_stage(
            [
                sys.executable,
                "-m",
                "speculators",
                "export",
                str(plan.run_dir),
                str(plan.export_dir),
                "--speculative-tokens",
                str(plan.k),
            ],
            "export",
        )

    stage("export", f"export with its lineage -> {plan.export_dir}", export)
    stage(
        "eval",
        f"evaluation before and after at k = {plan.k}",
        lambda: [
            run_stage(eval_command(plan, draft, prompts, out), f"evaluation {name}")
            for name, draft, prompts, out in evaluations(plan)
        ],
    )
    figures = collect_figures(plan)

    def card() -> None:
        write_lineage(plan, figures)
        run_stage(
            [
                sys.executable,
                "-m",
                "speculators",
                "export",
                str(plan.run_dir),
                str(plan.export_dir),
                "--speculative-tokens",
                str(plan.k),
                "--eval-results",
                str(plan.run_dir / "eval" / "window_after" / "results.json"),
            ],
            "export with the card",
        )

    stage("card", "export again: the card and config carry the figures before and after", card)
    print_summary(figures, plan)
    return figures


def collect_figures(plan: Plan) -> dict[str, Any]:
    figures: dict[str, Any] = {"k": plan.k}
    for name, _, _, output in evaluations(plan):
        path = output / "results.json"
        if path.is_file():
            results = json.loads(path.read_text())
            figures[f"{name.split('_')[0]}_al_{name.split('_')[1]}"] = acceptance_length(results)
            if name.startswith("window"):
                figures[f"window_speedup_c1_{name.split('_')[1]}"] = vllm_speedup_c1(results)
    return figures


def print_summary(figures: dict[str, Any], plan: Plan) -> None:
    def pair(name: str) -> str:
        before, after = figures.get(f"{name}_al_before"), figures.get(f"{name}_al_after")
        if before is None or after is None:
            return "not measured"
        gain = (after - 1) / (before - 1) if before > 1 else float("nan")
        return f"{before:.3f} -> {after:.3f} (AL - 1 x{gain:.2f})"

    print(f"\nadapted draft: {plan.export_dir}")
    print(f"  acceptance length on the held-out window: {pair('window')}")
    print(f"  acceptance length on the original held-out data: {pair('original')}")
    before, after = figures.get("window_speedup_c1_before"), figures.get("window_speedup_c1_after")
    if before and after:
        print(f"  vLLM speed-up one request at a time on the window: {before:.2f}x -> {after:.2f}x")


def recipe_choice(cfg: DictConfig) -> str:
    """The recipe file the user chose (``recipe=NAME``), which the stages compose again."""
    from hydra.core.hydra_config import HydraConfig

    return str(HydraConfig.get().runtime.choices.get("recipe") or cfg.recipe_name)


def user_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return [
        o
        for o in HydraConfig.get().overrides.task
        if not o.split("=", 1)[0].lstrip("+~").startswith(("adapt.", "adapt=", "recipe", "run_dir", "hydra"))
    ]


@hydra.main(config_path="../recipes", config_name="adapt", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from speculators.cli import USER_ERRORS, user_errors_as_one_line

    with user_errors_as_one_line((*USER_ERRORS, AdaptError)):
        plan = plan_from(cfg, user_overrides())
        adapt(plan)


if __name__ == "__main__":
    main()
