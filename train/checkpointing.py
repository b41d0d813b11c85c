"""Writing the run directory (its layout, completeness rule and best/latest logic live in :mod:`speculators.runs`,
which the exporter reads with): step checkpoints, exact resume, pruning, the saved recipe.

What a step holds::

    checkpoints/step-<N>/draft/              a speculators-format directory written by
                                             Eagle3DraftModel.save_pretrained: fp32, FULL weights (gathered even
                                             under ZeRO-3, fp32 master weights under bf16), d2t/t2d set from the
                                             draft vocab; not yet validated against the verifier
    checkpoints/step-<N>/state/              accelerate / DeepSpeed state (model, optimizer, RNG of every rank)
    checkpoints/step-<N>/trainer_state.json  {"step", "epoch", "step_in_epoch", "samples_seen", "tokens_seen",
                                              "train_seconds", "world_size", "global_batch", "metrics", "best"}

``N`` is the number of optimizer steps done. A step directory is written under ``checkpoints/.step-<N>.partial``
and renamed into place only when complete, so any ``step-<N>`` the trainer wrote is whole; a run killed mid-write
leaves only a ``.partial`` directory, which the next start deletes. Auto-resume loads the highest complete step and
continues from exactly there: the data position is the step number (see ``data_gen.batch_plan.BatchPlan``), the learning
rate a function of the step, and model/optimizer/RNG come from ``state/``. Old step directories beyond
``train.keep_checkpoints`` are pruned, never the best one.
"""

from __future__ import annotations

import copy
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from speculators import algorithms, runs
from speculators.atomic import atomic_write_json, atomic_write_text
from speculators.format.config import DraftConfig


def remove_partials(run_dir: Path) -> None:
    """Delete the ``.step-<N>.partial`` directories a killed run left behind."""
    root = runs.checkpoints_dir(run_dir)
    if root.is_dir():
        for path in root.glob(".step-*.partial"):
            shutil.rmtree(path, ignore_errors=True)


def prune(run_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` step directories plus the best one."""
    if keep <= 0:
        return
    best_step = runs.read_best(run_dir).get("step")
    found = runs.list_checkpoints(run_dir)
    for step, path in found[:-keep]:
        if step != best_step:
            shutil.rmtree(path, ignore_errors=True)


# ---- gathering full fp32 weights ----------------------------------------------------------------------------
def write_run_config(run_dir: Path, cfg: Any, overrides: list[str]) -> None:
    """``<run_dir>/config.yaml``: every setting of the run, resolved, with the command-line overrides on top."""
    header = "# resolved recipe of this run; overrides: " + (" ".join(overrides) or "(none)") + "\n"
    atomic_write_text(Path(run_dir) / runs.RECIPE_NAME, header + recipe_yaml(cfg))


def recipe_yaml(cfg: Any) -> str:
    """The resolved recipe as ``config.yaml`` holds it (a resume compares its own recipe in this form)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg, resolve=True)


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


def write_draft(directory: Path, config: DraftConfig, state: dict[str, torch.Tensor]) -> None:
    """Write a speculators checkpoint through the draft type's ``save_pretrained`` in fp32 (no extra copy: the
    model is built on the meta device and takes the gathered tensors as they are)."""
    model_class = algorithms.get(config.SPECULATORS_MODEL_TYPE).model_class
    with torch.device("meta"):
        model = model_class(copy.deepcopy(config))
    model.load_state_dict(state, strict=True, assign=True)
    model.save_pretrained(directory, dtype=torch.float32)


def save_step(
    accelerator, model, run_dir: Path, step: int, config: DraftConfig, trainer_state: dict[str, Any]
) -> Path:
    """Write ``checkpoints/step-<step>`` atomically (collective: every rank calls it)."""
    staging, final = runs.partial_dir(run_dir, step), runs.step_dir(run_dir, step)
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging / runs.STATE_DIR))
    # Every rank writes its own RNG file into staging/state; the main process renames staging below, so it must
    # wait for the slowest rank's write first (outside DeepSpeed nothing else here is collective).
    accelerator.wait_for_everyone()
    state = gather_draft_state(accelerator, model)
    if accelerator.is_main_process:
        write_draft(staging / runs.DRAFT_DIR, config, state)
        atomic_write_json(staging / runs.STATE_NAME, trainer_state)
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    accelerator.wait_for_everyone()
    return final


# What a damaged state file raises from the readers accelerate and DeepSpeed use (safetensors, torch.load's zip
# reader, pickle): none of them names the checkpoint or says what to do.
DAMAGED_STATE_ERRORS = (SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError, OSError)


def load_step(accelerator, path: Path) -> dict[str, Any]:
    """Restore model, optimizer and every rank's RNG from ``path/state``; returns its trainer state. A state that
    cannot be read (truncated by a full disk, a killed copy) is a ValueError naming the checkpoint and the way on,
    not the reader's own error (the recipe was compared before: train.resume_guard)."""
    trainer_state = runs.require_resumable(path)
    try:
        accelerator.load_state(str(path / runs.STATE_DIR))
    except DAMAGED_STATE_ERRORS as exc:
        run = runs.run_of(path)
        earlier = [str(step) for _, step in runs.list_checkpoints(run) if step != path] if run else []
        raise ValueError(
            f"{path / runs.STATE_DIR} cannot be loaded ({type(exc).__name__}: {str(exc)[:200]}): the checkpoint is "
            "damaged (truncated by a full disk or a killed copy?); resume an earlier one with train.resume=<path>"
            + (f" ({', '.join(earlier[-3:])})" if earlier else "")
            + f", or start a new run from its weights with train.init_from={path}"
        ) from exc
    return trainer_state


__all__ = [
    "gather_draft_state",
    "load_step",
    "prune",
    "recipe_yaml",
    "remove_partials",
    "save_step",
    "write_draft",
    "write_run_config",
]
