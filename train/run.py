"""Train a draft: ``accelerate launch [--multi_gpu --num_processes N] train/run.py recipe=<name> [overrides]``.

Single process: ``python train/run.py recipe=eagle3_smollm2``. On CPU hosts ``--multi_gpu`` is required for N > 1
(``accelerate launch --num_processes 2`` alone silently runs ONE process); DeepSpeed is chosen by the recipe
(``deepspeed=zero2``), not by accelerate flags.

Sweeps (one clean run directory per job under ``${run_dir}/multirun/<time>/<job>``, sharing the recipe's data):

* ``python train/run.py --multirun recipe=... optim.lr=1e-4,3e-4`` — single-process jobs run one after another in
  this process; each job tears down its process group and accelerate state, so job 2 starts clean.
* ``python train/run.py --multirun hydra/launcher=accelerate hydra.launcher.num_processes=2 ...`` — each job in
  its own ``accelerate launch`` (multi-process jobs). Do NOT put ``--multirun`` inside ``accelerate launch``:
  every rank would run its own sweep.

Only the main process writes: other ranks get no Hydra output directory or log file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, open_dict


def is_main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def quiet_other_ranks(argv: list[str]) -> list[str]:
    """Ranks > 0 run the same composition but write nothing of Hydra's (no .hydra/, no log, no run dir)."""
    if is_main_rank():
        return argv
    extra = ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    if not any(a.startswith("hydra.run.dir=") for a in argv):
        extra.append("hydra.run.dir=.")
    return argv + extra


def finalize_config(cfg: DictConfig) -> DictConfig:
    """In a multirun job, give the job its own run dir but keep the recipe's data directory."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        data_dir = str(cfg.train.data_dir)
        with open_dict(cfg):
            cfg.run_dir = hydra_cfg.runtime.output_dir
            cfg.train.data_dir = data_dir
            if "data_gen" in cfg and "output_dir" in cfg.data_gen:
                cfg.data_gen.output_dir = data_dir
    return cfg


@hydra.main(config_path="../recipes", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from speculators.cli import USER_ERRORS, user_errors_as_one_line
    from train.objectives import train_settings
    from train.settings import SettingsError

    cfg = finalize_config(cfg)
    run_dir = Path(str(cfg.run_dir))
    # a user's mistake (the recipe, a path, a refused resume, a full disk) is one line, not a traceback
    with user_errors_as_one_line((*USER_ERRORS, SettingsError)):
        settings = train_settings(cfg)  # every problem of the recipe, before anything starts
        if settings.train.dry_run:  # the memory plan only: no data, no DeepSpeed, no weights
            from train.memory_plan import write_plan

            write_plan(settings, run_dir)
            return None
        from train.trainer import train  # refuses a resume of another recipe before it writes anything

        result = train(settings, run_dir)
    best = result.get("best", {}).get("acceptance_length")
    return float(best) if best is not None else None  # what a Hydra sweeper would optimise


if __name__ == "__main__":
    sys.argv = quiet_other_ranks(sys.argv)
    main()
