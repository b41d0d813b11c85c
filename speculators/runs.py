"""The training run directory: its names, when a checkpoint in it is complete, and which one a caller means.

The trainer writes it (``train/checkpointing.py``); ``speculators export``, ``speculators eval`` and a second
training stage (``train.init_from``) read it. This module is the one owner of the layout::

    <run>/config.yaml                        the resolved recipe of the run
    <run>/metrics.jsonl                      one JSON object per log line / evaluation
    <run>/draft_vocab.safetensors            the draft vocabulary (d2t/t2d with provenance)
    <run>/precision.json                     the compute dtype chosen, by whom and why (speculators.precision)
    <run>/checkpoints/step-<N>/draft/        a speculators directory (fp32, full weights)
    <run>/checkpoints/step-<N>/state/        accelerate / DeepSpeed state (model, optimizer, RNG of every rank)
    <run>/checkpoints/step-<N>/trainer_state.json
    <run>/checkpoints/best.json              {"step", "path": "checkpoints/step-<N>", "acceptance_length", "metrics"}

THE COMPLETENESS RULE. The trainer builds a step under ``checkpoints/.step-<N>.partial`` and renames it to
``step-<N>`` only when everything is written, so the name alone says "whole" for what the trainer wrote. A
``step-<N>`` directory counts as a checkpoint when it also holds something to load: a draft (``draft/`` with
config.json and weights) or training state (``state/``); an empty or foreign ``step-<N>`` directory does not.
Exact resume additionally needs ``state/`` and ``trainer_state.json`` (:func:`require_resumable`).

A run directory means its best checkpoint (``best.json``: checkpoints are selected by acceptance length, not
loss), else its latest complete one; a step directory, or the draft inside it, means itself.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators.atomic import atomic_write_json

CHECKPOINTS = "checkpoints"
BEST_NAME = "best.json"
STATE_NAME = "trainer_state.json"
DRAFT_DIR = "draft"
STATE_DIR = "state"
RECIPE_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
DRAFT_VOCAB_NAME = "draft_vocab.safetensors"
PRECISION_NAME = "precision.json"
INIT_FROM_NAME = "init_from.json"  # train.init_from: the source, the tensors loaded from it and those new
STEP_PATTERN = re.compile(r"^step-(\d+)$")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


# ---- names ----------------------------------------------------------------------------------------------------
def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step-{step}"


def partial_dir(run_dir: Path, step: int) -> Path:
    """Where the trainer builds ``step-<step>`` before renaming it into place."""
    return checkpoints_dir(run_dir) / f".step-{step}.partial"


def step_number(path: Path) -> int | None:
    match = STEP_PATTERN.match(path.name)
    return int(match.group(1)) if match else None


# ---- completeness ---------------------------------------------------------------------------------------------
def is_draft_dir(path: Path) -> bool:
    """A speculators checkpoint directory: config.json and weights."""
    return (path / "config.json").is_file() and any((path / name).is_file() for name in WEIGHT_FILES)


def is_complete_step(path: Path) -> bool:
    """A ``step-<N>`` checkpoint with something to load: ``draft/`` or ``state/`` (the module docstring's rule)."""
    return is_draft_dir(path / DRAFT_DIR) or (path / STATE_DIR).is_dir()


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The complete ``step-<N>`` checkpoints of a run, oldest first."""
    root = checkpoints_dir(run_dir)
    found = []
    if root.is_dir():
        for path in root.iterdir():
            step = step_number(path)
            if step is not None and path.is_dir() and is_complete_step(path):
                found.append((step, path))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def require_resumable(path: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint that exact resume can load, or a FileNotFoundError saying what is wrong: a
    path that does not exist or a run directory (both naming the run's checkpoints), or a step without the state
    exact resume loads (``train.init_from`` can still start a new run from its weights)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"train.resume={path}: the path does not exist{checkpoints_note(run_of(path))}"
        )
    if checkpoints_dir(path).is_dir():
        raise FileNotFoundError(
            f"train.resume={path} is a run directory, not one of its checkpoints{checkpoints_note(path)}"
        )
    missing = [name for name in (STATE_DIR, STATE_NAME) if not (path / name).exists()]
    if missing:
        raise FileNotFoundError(
            f"{path} cannot be resumed exactly: it has no {' and no '.join(missing)}; start a new run from its "
            f"weights with train.init_from={path} instead"
        )
    return json.loads((path / STATE_NAME).read_text())


def checkpoints_note(run_dir: Path | None) -> str:
    """``"; <run> has step-4, step-8: ..."`` naming a run's complete checkpoints and how to resume one, or ``""``."""
    found = list_checkpoints(run_dir) if run_dir is not None else []
    if not found:
        return ""
    names = ", ".join(path.name for _, path in found)
    return (
        f"; {run_dir} has {names}: resume one of them (train.resume={found[-1][1]}), or the newest with "
        f"run_dir={run_dir} train.resume=auto"
    )


# ---- precision ------------------------------------------------------------------------------------------------
def write_precision(run_dir: Path, decisions: dict[str, Any]) -> None:
    """``precision.json``: each decision's dtype, source (recipe / env / auto), reason and the CPU it read. Written
    at every (re)start: a resumed run on another machine says what it runs in now."""
    atomic_write_json(Path(run_dir) / PRECISION_NAME, decisions)


def write_init_from(run_dir: Path, report: dict[str, Any]) -> None:
    """``init_from.json``: what ``train.init_from`` loaded into this run and which tensors started fresh."""
    atomic_write_json(Path(run_dir) / INIT_FROM_NAME, report)


# ---- best -----------------------------------------------------------------------------------------------------
def read_best(run_dir: Path) -> dict[str, Any]:
    """The content of ``checkpoints/best.json``, or ``{}`` when there is none."""
    path = checkpoints_dir(run_dir) / BEST_NAME
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix it or delete it to use the latest") from exc


def write_best(run_dir: Path, step: int, acceptance_length: float, metrics: dict[str, Any]) -> None:
    best = {
        "step": step,
        "path": f"{CHECKPOINTS}/step-{step}",
        "acceptance_length": acceptance_length,
        "metrics": metrics,
    }
    atomic_write_json(checkpoints_dir(run_dir) / BEST_NAME, best)


def best_checkpoint(run_dir: Path, best: dict[str, Any] | None = None) -> Path | None:
    """The complete step directory ``best.json`` points at, or None. Its ``path`` may be absolute, relative to the
    run or to ``checkpoints/`` (or name the draft inside the step); ``step`` alone also works."""
    best = read_best(run_dir) if best is None else best
    candidates = []
    if best.get("path"):
        path = Path(best["path"])
        candidates += (
            [path] if path.is_absolute() else [run_dir / path, checkpoints_dir(run_dir) / path, path]
        )
    if best.get("step") is not None:
        candidates.append(step_dir(run_dir, int(best["step"])))
    for candidate in candidates:
        if candidate.name == DRAFT_DIR and is_draft_dir(candidate):
            candidate = candidate.parent
        if is_complete_step(candidate):
            return candidate.resolve()
    return None


# ---- resolve --------------------------------------------------------------------------------------------------
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


def locate_checkpoint(source: str | Path) -> TrainerCheckpoint:
    """Resolve a run directory, a ``step-<N>`` directory or a standard draft directory to one checkpoint."""
    source = Path(source).resolve()
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist; pass a training run directory or a checkpoint")
    if checkpoints_dir(source).is_dir():
        return _from_run(source)
    if is_complete_step(source):
        return _from_step(source, run_of(source), "given")
    if source.name == DRAFT_DIR and is_draft_dir(source) and is_complete_step(source.parent):
        return _from_step(source.parent, run_of(source.parent), "given")
    if is_draft_dir(source):
        _refuse_a_model(source)
        return TrainerCheckpoint(step_dir=None, draft_dir=source, state_dir=None, run_dir=None)
    raise FileNotFoundError(
        f"{source} is neither a run directory (with checkpoints/), a checkpoints/step-<N> directory (with draft/ "
        "or state/) nor a speculators checkpoint (config.json + model.safetensors)"
    )


def _refuse_a_model(directory: Path) -> None:
    """Raise when ``directory`` holds a model (a verifier) rather than a draft, judged by its config.json alone:
    a verifier has config.json and model.safetensors too, and reading its weights first (16 GB for an 8B model)
    only to fail on the config would cost minutes."""
    from speculators.format.checkpoint import read_config
    from speculators.format.validate import model_not_draft

    problem = model_not_draft(read_config(directory))
    if problem is not None:
        raise ValueError(f"{directory / 'config.json'}: {problem}")


def resolve_draft_dir(source: str | Path) -> Path:
    """The draft directory ``source`` means (see :func:`locate_checkpoint`); the checkpoint must hold a draft."""
    checkpoint = locate_checkpoint(source)
    if checkpoint.draft_dir is None:
        raise FileNotFoundError(
            f"{checkpoint.label} holds only training state (no draft/); export it first with "
            f"`speculators export {checkpoint.label} OUT` and use OUT"
        )
    return checkpoint.draft_dir


def run_of(path: Path) -> Path | None:
    """The run directory of a ``checkpoints/step-<N>`` path, or None for a step kept elsewhere."""
    path = Path(path)
    return path.parent.parent if path.parent.name == CHECKPOINTS else None


def _from_run(run_dir: Path) -> TrainerCheckpoint:
    best = read_best(run_dir)
    best_dir = best_checkpoint(run_dir, best)
    if best_dir is not None:
        return _from_step(best_dir, run_dir, "best", best)
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise FileNotFoundError(
            f"{run_dir}/{CHECKPOINTS} has no complete step-<N> checkpoint (with draft/ or state/)"
        )
    if best:  # the best was pruned or deleted: say so rather than hand over another checkpoint silently
        warnings.warn(
            f"{checkpoints_dir(run_dir) / BEST_NAME} names step {best.get('step')} ({best.get('path')}), which is "
            f"not a complete checkpoint any more; using the latest, {latest.name}, instead",
            stacklevel=3,
        )
    return _from_step(latest, run_dir, "latest", best)


def _from_step(
    path: Path, run_dir: Path | None, selected_by: str, best: dict[str, Any] | None = None
) -> TrainerCheckpoint:
    state_file = path / STATE_NAME
    trainer_state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    step = step_number(path)
    return TrainerCheckpoint(
        step_dir=path,
        draft_dir=path / DRAFT_DIR if is_draft_dir(path / DRAFT_DIR) else None,
        state_dir=path / STATE_DIR if (path / STATE_DIR).is_dir() else None,
        run_dir=run_dir,
        step=step if step is not None else trainer_state.get("step"),
        selected_by=selected_by,
        best=best or {},
        trainer_state=trainer_state,
        recipe=read_recipe(run_dir),
    )


# ---- the saved recipe -----------------------------------------------------------------------------------------
def read_recipe(run_dir: Path | None) -> dict[str, Any]:
    """The resolved recipe the run saved (``config.yaml``), or ``{}``."""
    if run_dir is None or not (run_dir / RECIPE_NAME).is_file():
        return {}
    import yaml  # a transformers dependency; the library never needs hydra to read a saved recipe

    loaded = yaml.safe_load((run_dir / RECIPE_NAME).read_text())
    return loaded if isinstance(loaded, dict) else {}


def recipe_value(recipe: dict[str, Any], dotted: str, default: Any = None) -> Any:
    """``recipe_value(r, "export.speculative_tokens")``: a nested key of the recipe, or ``default``."""
    node: Any = recipe
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


__all__ = [
    "BEST_NAME",
    "CHECKPOINTS",
    "INIT_FROM_NAME",
    "STATE_NAME",
    "TrainerCheckpoint",
    "best_checkpoint",
    "checkpoints_dir",
    "checkpoints_note",
    "is_complete_step",
    "is_draft_dir",
    "latest_checkpoint",
    "list_checkpoints",
    "locate_checkpoint",
    "partial_dir",
    "read_best",
    "read_recipe",
    "recipe_value",
    "require_resumable",
    "run_of",
    "resolve_draft_dir",
    "step_dir",
    "write_best",
    "write_init_from",
]
