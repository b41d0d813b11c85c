"""A resume continues the same run, or it is refused before anything is set up or written (issue 40).

A checkpoint holds weights, optimizer state and a step; the recipe that trained them is its run's ``config.yaml``.
Resumed under another recipe (another draft vocabulary, algorithm, ``ttt_steps``, lr or seed), a run either fails
deep inside ``load_state`` after its run directory was rewritten, or trains one run under two recipes and says
nothing. So before the trainer builds anything, the recipe this launch resolved is compared with the one the
checkpoint's run saved: only the keys of :data:`RESUME_MAY_CHANGE` may differ (said in one line); any other
difference is refused, listing every differing key and the ways on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from speculators import runs
from train.settings import TrainSettings

# The keys a resume may change, by dotted key or group prefix, with why that is safe: how long, how often, where and
# with which resources the run goes on, never what it learns from or how. Every other key of the recipe must equal
# the saved one.
RESUME_MAY_CHANGE: dict[str, str] = {
    "train.epochs": "the run's length (the lr schedule is recomputed over it)",
    "train.max_steps": "the run's length (the lr schedule is recomputed over it)",
    "train.max_cpu_seconds": "the CPU budget (a length it already fitted is kept)",
    "train.cpu_budget_hold": "whether the CPU budget is re-fitted on a busier machine",
    "train.resume": "which checkpoint this launch continues",
    "train.dry_run": "a dry run trains nothing",
    "train.eval_every": "evaluation cadence",
    "train.save_every": "checkpoint cadence",
    "train.keep_checkpoints": "how many old checkpoints are kept",
    "train.num_workers": "DataLoader processes: the same batches",
    "train.cpu_threads": "torch threads: the same computation",
    "train.attention_chunk": "the same attention, computed in query chunks of another size",
    "train.stream.spool_dir": "where producers write: the same items",
    "train.stream.max_spool_gb": "spool back-pressure",
    "train.stream.local_producers": "how many producers capture the same items",
    "train.stream.producer_threads": "producer threads",
    "train.stream.producer_timeout_s": "producer liveness",
    "train.stream.max_restarts": "producer restarts",
    "data_gen.output_dir": "data_gen's output; the trainer reads train.data_dir, which is compared",
    "data_gen.verify_resumed_shards": "data_gen only",
    "data_gen.barrier_timeout_hours": "data_gen only",
    "logging": "console, metrics.jsonl and wandb output",
    "memory_plan": "the hardware a dry run checks",
    "run_dir": "where the run lives (paths under it follow a moved run)",
    "output_root": "where the run lives",
    "hydra": "Hydra's own launch settings",
}
LENGTH_KEYS = ("train.epochs", "train.max_steps")
ABSENT = "(absent)"


def resume_source(settings: TrainSettings, run_dir: Path) -> Path | None:
    """The checkpoint this launch continues (``train.resume``), or None for a fresh start. ``never`` in a run that
    already has checkpoints is refused here, before anything is written."""
    resume = settings.train.resume
    if resume == "never":
        if runs.list_checkpoints(run_dir):
            raise FileExistsError(
                f"{run_dir} already has checkpoints and train.resume=never; choose another run_dir or "
                "set train.resume=auto to continue it"
            )
        return None
    return runs.latest_checkpoint(run_dir) if resume == "auto" else Path(resume)


def check_same_run(settings: TrainSettings, run_dir: Path, checkpoint: Path | None) -> str | None:
    """Refuse resuming ``checkpoint`` under a recipe other than its run's (a ValueError naming every differing
    key); returns the line to say when the resume goes ahead with allowed changes or unchecked, else None.
    A checkpoint path that does not exist is left to :func:`speculators.runs.require_resumable`."""
    if checkpoint is None or not checkpoint.exists():
        return None
    source = runs.run_of(checkpoint) or run_dir
    saved = runs.read_recipe(source)
    if not saved:
        return (
            f"resuming {checkpoint}: {source / runs.RECIPE_NAME} is missing, so its recipe cannot be checked "
            "against this launch's"
        )
    changes = recipe_changes(saved, comparable(settings.resolved))
    refused = {key: change for key, change in changes.items() if not may_change(key)}
    if refused:
        raise ValueError(refusal(source / runs.RECIPE_NAME, checkpoint, refused))
    return allowed_line(changes) if changes else None


def comparable(recipe: dict[str, Any]) -> dict[str, Any]:
    """``recipe`` as ``config.yaml`` stores it (the same YAML round trip), so values compare type for type."""
    import yaml

    from train.checkpointing import recipe_yaml

    return yaml.safe_load(recipe_yaml(recipe)) or {}


def recipe_changes(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every dotted key whose value differs, ``key -> (saved, now)`` (:data:`ABSENT` on a side that lacks it).
    Paths under the saved run dir are read as under this launch's, so a moved run dir is the same run."""
    before = relocated(flat(saved), saved.get("run_dir"), now.get("run_dir"))
    after = flat(now)
    keys = sorted(set(before) | set(after))
    return {
        key: (before.get(key, ABSENT), after.get(key, ABSENT))
        for key in keys
        if before.get(key, ABSENT) != after.get(key, ABSENT)
    }


def flat(recipe: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested groups as dotted keys; lists and empty groups are values."""
    out: dict[str, Any] = {}
    for key, value in recipe.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def relocated(values: dict[str, Any], old_root: Any, new_root: Any) -> dict[str, Any]:
    """``values`` with every path under ``old_root`` moved under ``new_root``."""
    if not isinstance(old_root, str) or not isinstance(new_root, str) or old_root == new_root:
        return values
    old = old_root.rstrip("/")

    def move(value: Any) -> Any:
        if isinstance(value, str) and (value == old or value.startswith(old + "/")):
            return new_root.rstrip("/") + value[len(old) :]
        return value

    return {key: move(value) for key, value in values.items()}


def may_change(key: str) -> bool:
    """Whether ``key`` (dotted) is one of :data:`RESUME_MAY_CHANGE` or lies in a group listed there."""
    return any(key == allowed or key.startswith(allowed + ".") for allowed in RESUME_MAY_CHANGE)


def refusal(recipe_file: Path, checkpoint: Path, refused: dict[str, tuple[Any, Any]]) -> str:
    lines = [
        f"train.resume: {checkpoint} was trained under {recipe_file}, and this launch's recipe differs from it in "
        f"{len(refused)} key(s) a resume may not change (saved -> now):",
        *(f"  - {key}: {show(old)} -> {show(new)}" for key, (old, new) in refused.items()),
        "resume with the run's own recipe, or start a new run_dir, or set "
        f"train.init_from={checkpoint} to start a new run from its weights",
    ]
    return "\n".join(lines)


def allowed_line(changes: dict[str, tuple[Any, Any]]) -> str:
    said = ", ".join(f"{key} {show(old)} -> {show(new)}" for key, (old, new) in changes.items())
    note = " (the lr schedule now spans the new length)" if any(key in changes for key in LENGTH_KEYS) else ""
    return f"resuming with changed: {said}{note}"


def show(value: Any) -> str:
    """A value as the recipe writes it (null, true, 1e-3, a list), strings bare."""
    return value if isinstance(value, str) else json.dumps(value)


__all__ = [
    "RESUME_MAY_CHANGE",
    "check_same_run",
    "recipe_changes",
    "resume_source",
]
