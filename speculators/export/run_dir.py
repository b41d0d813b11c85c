"""Finding the checkpoint that ``speculators export RUN_OR_CHECKPOINT`` means.

The trainer's contract: ``<run>/config.yaml`` (the resolved recipe), ``<run>/metrics.jsonl``,
``<run>/checkpoints/step-<N>/{draft/, state/, trainer_state.json}`` and ``<run>/checkpoints/best.json``
(``{"step", "path", "acceptance_length"}``). A run directory means its best checkpoint (checkpoints are selected
by acceptance length, not loss) and falls back to the latest complete one; a step directory or a standard draft
directory means itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_PATTERN = re.compile(r"^step-(\d+)$")


@dataclass
class TrainerCheckpoint:
    """One checkpoint of a training run and what the run directory says about it."""

    step_dir: Path | None  # checkpoints/step-<N>, or None for a bare draft directory
    draft_dir: Path | None  # standard speculators directory written by the trainer (fp32)
    state_dir: Path | None  # accelerate / DeepSpeed state (ZeRO shards)
    run_dir: Path | None
    step: int | None = None
    selected_by: str = "given"  # "best" | "latest" | "given"
    best: dict[str, Any] = field(default_factory=dict)
    trainer_state: dict[str, Any] = field(default_factory=dict)
    recipe: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return str(self.step_dir or self.draft_dir)


def is_draft_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(
        (path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")
    )


def is_step_dir(path: Path) -> bool:
    return is_draft_dir(path / "draft") or (path / "state").is_dir()


def step_dirs(run_dir: Path) -> list[Path]:
    """Complete ``step-<N>`` checkpoints of a run, oldest first (a step without draft/ or state/ is unfinished)."""
    root = run_dir / "checkpoints"
    found = [p for p in root.iterdir() if p.is_dir() and STEP_PATTERN.match(p.name)] if root.is_dir() else []
    return sorted(
        (p for p in found if is_step_dir(p)), key=lambda p: int(STEP_PATTERN.match(p.name).group(1))
    )


def read_best(run_dir: Path) -> tuple[Path | None, dict[str, Any]]:
    """The step directory ``checkpoints/best.json`` points at (its ``path`` may be absolute, relative to the run or
    to ``checkpoints/``; ``step`` alone also works), or ``(None, {})`` when there is none or it points nowhere."""
    best_file = run_dir / "checkpoints" / "best.json"
    if not best_file.is_file():
        return None, {}
    try:
        best = json.loads(best_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{best_file} is not valid JSON ({exc}); fix it or delete it to export the latest"
        ) from exc
    candidates = []
    if best.get("path"):
        path = Path(best["path"])
        candidates += [path] if path.is_absolute() else [run_dir / path, run_dir / "checkpoints" / path, path]
    if best.get("step") is not None:
        candidates.append(run_dir / "checkpoints" / f"step-{int(best['step'])}")
    for candidate in candidates:
        if candidate.name == "draft" and is_draft_dir(candidate):
            candidate = candidate.parent
        if is_step_dir(candidate):
            return candidate.resolve(), best
    return None, best


def read_recipe(run_dir: Path | None) -> dict[str, Any]:
    """The resolved recipe the run saved (``config.yaml``), or ``{}``."""
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        return {}
    import yaml  # a transformers dependency; the library never needs hydra to read a saved recipe

    loaded = yaml.safe_load((run_dir / "config.yaml").read_text())
    return loaded if isinstance(loaded, dict) else {}


def locate_checkpoint(source: str | Path) -> TrainerCheckpoint:
    """Resolve a run directory, a ``step-<N>`` directory or a standard draft directory to one checkpoint."""
    source = Path(source).resolve()
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist; pass a training run directory or a checkpoint")
    if (source / "checkpoints").is_dir():
        return _from_run(source)
    if is_step_dir(source):
        return _from_step(source, _run_of(source), "given")
    if source.name == "draft" and is_draft_dir(source) and is_step_dir(source.parent):
        return _from_step(source.parent, _run_of(source.parent), "given")
    if is_draft_dir(source):
        return TrainerCheckpoint(step_dir=None, draft_dir=source, state_dir=None, run_dir=None)
    raise FileNotFoundError(
        f"{source} is neither a run directory (with checkpoints/), a checkpoints/step-<N> directory (with draft/ "
        "or state/) nor a speculators checkpoint (config.json + model.safetensors)"
    )


def _run_of(step_dir: Path) -> Path | None:
    return step_dir.parent.parent if step_dir.parent.name == "checkpoints" else None


def _from_run(run_dir: Path) -> TrainerCheckpoint:
    best_dir, best = read_best(run_dir)
    if best_dir is not None:
        return _from_step(best_dir, run_dir, "best", best)
    steps = step_dirs(run_dir)
    if not steps:
        raise FileNotFoundError(
            f"{run_dir}/checkpoints has no complete step-<N> checkpoint (with draft/ or state/)"
        )
    return _from_step(steps[-1], run_dir, "latest", best)


def _from_step(
    step_dir: Path, run_dir: Path | None, selected_by: str, best: dict[str, Any] | None = None
) -> TrainerCheckpoint:
    match = STEP_PATTERN.match(step_dir.name)
    state_file = step_dir / "trainer_state.json"
    trainer_state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    draft = step_dir / "draft"
    state = step_dir / "state"
    return TrainerCheckpoint(
        step_dir=step_dir,
        draft_dir=draft if is_draft_dir(draft) else None,
        state_dir=state if state.is_dir() else None,
        run_dir=run_dir,
        step=int(match.group(1)) if match else trainer_state.get("step"),
        selected_by=selected_by,
        best=best or {},
        trainer_state=trainer_state,
        recipe=read_recipe(run_dir),
    )


def recipe_value(recipe: dict[str, Any], dotted: str, default: Any = None) -> Any:
    """``recipe_value(r, "export.speculative_tokens")``: a nested key of the recipe, or ``default``."""
    node: Any = recipe
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node
