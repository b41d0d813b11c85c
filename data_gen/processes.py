"""The process group of a data-generation run, with a collective timeout sized for the job.

With regeneration on, one rank can finish its shards hours after another; the waiting ranks sit in the final
barrier all that time. torch's default collective timeout (30 min for gloo, 10 min for NCCL) would abort them and
no manifest would be written, so the timeout comes from the recipe (``data_gen.barrier_timeout_hours``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def data_gen_state(barrier_timeout_hours: float, cpu: bool | None = None) -> Any:
    """accelerate's ``PartialState`` whose process group (if several processes run) waits up to the given hours
    in every collective. ``cpu`` (default: ``ACCELERATE_USE_CPU`` or no CUDA) forces gloo: ``PartialState``,
    unlike ``Accelerator``, ignores ``ACCELERATE_USE_CPU``, and without it ranks launched on a CPU-only host each
    run as a lone process and race on the same shards."""
    import torch
    from accelerate import PartialState
    from accelerate.utils import InitProcessGroupKwargs, parse_flag_from_env

    if cpu is None:
        cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    timeout = InitProcessGroupKwargs(timeout=timedelta(hours=float(barrier_timeout_hours)))
    return PartialState(cpu=cpu, **timeout.to_kwargs())


__all__ = ["data_gen_state"]
