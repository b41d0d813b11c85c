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

from data_gen.store import IncompatibleOutputError
from speculators.cli import USER_ERRORS, user_errors_as_one_line

# A recipe value out of range, a missing, unreadable or malformed source file, a chat template without what masking
# needs, an output directory that cannot be made or was made by another configuration: one `error:` line each (the
# messages name the key or file and the fix), not a traceback. The same kinds as the `speculators` commands'
# (ValueError, OSError, KeyError, ImportError); anything else is a bug and keeps its traceback.
USER_MISTAKES = (*USER_ERRORS, IncompatibleOutputError)


@hydra.main(config_path="../recipes", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from data_gen.pipeline import Distributed, GenSettings, format_summary, run_data_gen
    from data_gen.processes import data_gen_state

    config = OmegaConf.to_container(cfg, resolve=True)
    with user_errors_as_one_line(USER_MISTAKES):
        settings = GenSettings.from_mapping(config["data_gen"])
    # ranks finish hours apart when regenerating: the barriers wait as long as the recipe says
    state = data_gen_state(settings.barrier_timeout_hours)
    logging.getLogger("data_gen").setLevel(logging.INFO if state.is_main_process else logging.WARNING)
    dist = Distributed(
        rank=state.process_index,
        world_size=state.num_processes,
        device=state.device,
        barrier=state.wait_for_everyone,
    )
    try:
        with user_errors_as_one_line(USER_MISTAKES):
            summary = run_data_gen(config, dist)
        if state.is_main_process:
            print(format_summary(summary), flush=True)
    finally:
        gc.collect()
        state.destroy_process_group()  # gloo hangs at exit otherwise (docs/environment.md)


if __name__ == "__main__":
    main()
