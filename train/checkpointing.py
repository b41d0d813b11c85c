"""The run directory: what a training run writes, how it resumes exactly, and which checkpoint is best.

THE CHECKPOINT CONTRACT (read by ``speculators export`` and anything else downstream)::

    <run_dir>/config.yaml                       the fully resolved recipe of this run (Hydra overrides in a header)
    <run_dir>/metrics.jsonl                     one JSON object per log line / evaluation ({"step", "kind", ...})
    <run_dir>/draft_vocab.safetensors           d2t/t2d built from the data's token counts (with provenance)
    <run_dir>/checkpoints/step-<N>/draft/       a speculators-format directory written by
                                                Eagle3DraftModel.save_pretrained: fp32, FULL weights (gathered
                                                even under ZeRO-3, fp32 master weights under bf16), d2t/t2d set
                                                from the draft vocab; not yet validated against the verifier
    <run_dir>/checkpoints/step-<N>/state/       accelerate / DeepSpeed state (model, optimizer, RNG of every rank)
    <run_dir>/checkpoints/step-<N>/trainer_state.json
                                                {"step", "epoch", "step_in_epoch", "samples_seen", "tokens_seen",
                                                 "train_seconds", "world_size", "global_batch", "metrics", "best"}
    <run_dir>/checkpoints/best.json             {"step": N, "path": "checkpoints/step-<N>" (relative to the run
                                                 dir), "acceptance_length": τ, "metrics": {...}}

``N`` is the number of optimizer steps done. A step directory is written under ``checkpoints/.step-<N>.partial``
and renamed into place only when complete, so any ``step-<N>`` that exists is whole; a run killed mid-write leaves
only a ``.partial`` directory, which the next start deletes. Auto-resume loads the highest complete step and
continues from exactly there: the data position is the step number (see ``train.data.BatchPlan``), the learning
rate a function of the step, and model/optimizer/RNG come from ``state/``. Old step directories beyond
``train.keep_checkpoints`` are pruned, never the best one.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from speculators.format.config import Eagle3Config
from speculators.models.eagle3 import Eagle3DraftModel

CHECKPOINTS = "checkpoints"
STEP_PATTERN = re.compile(r"^step-(\d+)$")
BEST_NAME = "best.json"
STATE_NAME = "trainer_state.json"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step-{step}"


def partial_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f".step-{step}.partial"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete step directories, oldest first."""
    root = checkpoints_dir(run_dir)
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = STEP_PATTERN.match(path.name)
            if match and (path / STATE_NAME).is_file():
                found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def remove_partials(run_dir: str | Path) -> None:
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        for path in root.glob(".step-*.partial"):
            shutil.rmtree(path, ignore_errors=True)


def read_best(run_dir: str | Path) -> dict[str, Any]:
    path = checkpoints_dir(run_dir) / BEST_NAME
    return json.loads(path.read_text()) if path.is_file() else {}


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)


def write_best(run_dir: str | Path, step: int, acceptance_length: float, metrics: dict[str, Any]) -> None:
    write_json_atomic(
        checkpoints_dir(run_dir) / BEST_NAME,
        {
            "step": step,
            "path": f"{CHECKPOINTS}/step-{step}",
            "acceptance_length": acceptance_length,
            "metrics": metrics,
        },
    )


def resolve_draft_dir(source: str | Path) -> Path:
    """A draft directory from: a draft dir, a ``step-<N>`` dir, or a run dir (its best, else latest, checkpoint)."""
    source = Path(source)
    if (source / "config.json").is_file():
        return source
    if (source / "draft" / "config.json").is_file():
        return source / "draft"
    best = read_best(source)
    if best and (source / best["path"] / "draft").is_dir():
        return source / best["path"] / "draft"
    latest = latest_checkpoint(source)
    if latest is not None:
        return latest / "draft"
    raise FileNotFoundError(
        f"{source}: not a draft directory, a checkpoints/step-<N> directory, or a run directory with checkpoints"
    )


def prune(run_dir: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` step directories plus the best one."""
    if keep <= 0:
        return
    best_step = read_best(run_dir).get("step")
    found = list_checkpoints(run_dir)
    for step, path in found[:-keep]:
        if step != best_step:
            shutil.rmtree(path, ignore_errors=True)


# ---- gathering full fp32 weights ----------------------------------------------------------------------------
def write_run_config(run_dir: str | Path, cfg: Any, overrides: list[str]) -> None:
    """``<run_dir>/config.yaml``: every setting of the run, resolved, with the command-line overrides on top."""
    from omegaconf import OmegaConf

    header = "# resolved recipe of this run; overrides: " + (" ".join(overrides) or "(none)") + "\n"
    path = Path(run_dir) / "config.yaml"
    tmp = path.with_name(".config.yaml.tmp")
    tmp.write_text(header + OmegaConf.to_yaml(cfg, resolve=True))
    tmp.replace(path)


def gather_draft_state(accelerator, model) -> dict[str, torch.Tensor] | None:
    """The draft's full fp32 state dict on the main process (``None`` elsewhere). Collective: call on all ranks.

    Under DeepSpeed the trainable weights come from the optimizer's fp32 master copy (``safe_get_full_fp32_param``,
    which also reassembles ZeRO-3 partitions); frozen ZeRO-3 parameters are gathered with ``GatheredParameters``.
    """
    from accelerate.utils import DistributedType

    unwrapped = accelerator.unwrap_model(model)
    draft = unwrapped.draft
    state: dict[str, torch.Tensor] = {}
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in draft.named_parameters():
            full = safe_get_full_fp32_param(param) if param.requires_grad else None
            if full is None and hasattr(param, "ds_id"):
                with deepspeed.zero.GatheredParameters([param]):
                    full = param.data.detach().clone()
            if full is None:
                full = param.data.detach()
            if accelerator.is_main_process:
                state[name] = full.float().cpu().clone()
    else:
        for name, param in draft.named_parameters():
            state[name] = param.detach().float().cpu().clone()
    for name, buffer in draft.named_buffers():
        if name in ("d2t", "t2d"):
            state[name] = buffer.detach().cpu().clone()
    return state if accelerator.is_main_process else None


def write_draft(directory: Path, config: Eagle3Config, state: dict[str, torch.Tensor]) -> None:
    """Write a speculators checkpoint through :meth:`Eagle3DraftModel.save_pretrained` in fp32 (no extra copy:
    the model is built on the meta device and takes the gathered tensors as they are)."""
    with torch.device("meta"):
        model = Eagle3DraftModel(copy.deepcopy(config))
    model.load_state_dict(state, strict=True, assign=True)
    model.save_pretrained(directory, dtype=torch.float32)


def save_step(
    accelerator, model, run_dir: str | Path, step: int, config: Eagle3Config, trainer_state: dict[str, Any]
) -> Path:
    """Write ``checkpoints/step-<step>`` atomically (collective: every rank calls it)."""
    staging, final = partial_dir(run_dir, step), step_dir(run_dir, step)
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging / "state"))
    state = gather_draft_state(accelerator, model)
    if accelerator.is_main_process:
        write_draft(staging / "draft", config, state)
        write_json_atomic(staging / STATE_NAME, trainer_state)
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    accelerator.wait_for_everyone()
    return final


def load_step(accelerator, path: Path) -> dict[str, Any]:
    """Restore model, optimizer and every rank's RNG from ``path/state``; returns its trainer state."""
    accelerator.load_state(str(path / "state"))
    return json.loads((path / STATE_NAME).read_text())


__all__ = [
    "BEST_NAME",
    "CHECKPOINTS",
    "STATE_NAME",
    "gather_draft_state",
    "latest_checkpoint",
    "list_checkpoints",
    "load_step",
    "partial_dir",
    "prune",
    "read_best",
    "remove_partials",
    "resolve_draft_dir",
    "save_step",
    "step_dir",
    "write_best",
    "write_draft",
    "write_run_config",
]
