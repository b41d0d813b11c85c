"""Hydra entry point: ``accelerate launch data_gen/run.py recipe=NAME [key=value ...]`` (or plain ``python``).

Reads the ``verifier``, ``data`` and ``data_gen`` sections of the recipe (recipes/config.yaml and its groups), runs
:func:`data_gen.pipeline.run_data_gen` on every rank (each takes the shards ``k % world_size == rank``) and prints
the summary on rank 0. Under ``accelerate launch`` give an explicit ``hydra.run.dir`` so all ranks agree on it.
"""

from __future__ import annotations

import gc
import logging

import hydra
from omegaconf import DictConfig, OmegaConf


@hydra.main(config_path="../recipes", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    import torch
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from data_gen.pipeline import Distributed, format_summary, run_data_gen

    # PartialState (unlike Accelerator) ignores ACCELERATE_USE_CPU: without cpu=True, ranks launched on a CPU-only
    # host each run as a lone process (world size 1) and race on the same shards.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
    logging.getLogger("data_gen").setLevel(logging.INFO if state.is_main_process else logging.WARNING)
    config = OmegaConf.to_container(cfg, resolve=True)
    dist = Distributed(
        rank=state.process_index,
        world_size=state.num_processes,
        device=state.device,
        barrier=state.wait_for_everyone,
    )
    try:
        summary = run_data_gen(config, dist)
        if state.is_main_process:
            print(format_summary(summary), flush=True)
    finally:
        gc.collect()
        state.destroy_process_group()  # gloo hangs at exit otherwise (docs/environment.md)


if __name__ == "__main__":
    main()
