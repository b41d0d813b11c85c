"""Which samples every optimizer step trains on: the one plan the trainer (:mod:`train.data`) and the streamed
capture producers (:mod:`data_gen.spool`) both follow, so a producer captures exactly the items a
trainer rank will read. It lives in data_gen because producers need it and data_gen never imports the trainer.

:class:`BatchPlan` decides the samples from ``(seed, epoch, step)`` alone: the epoch permutation is split into
global batches of ``micro_batch_size × grad_accum × world_size`` samples, and micro group ``c`` of a global batch
goes to rank ``c % world`` at accumulation index ``c // world``. The data position is therefore just the step
number (exact resume), and 1 process with micro batch 4 sees the same global batch as 2 processes with micro
batch 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchPlan:
    """The deterministic global-batch plan of a run (see the module docstring)."""

    num_samples: int
    micro_batch_size: int
    grad_accum: int
    world_size: int
    seed: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        self._orders: dict[int, torch.Tensor] = {}
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{self.num_samples} training samples cannot fill one global batch of {self.global_batch} "
                f"(micro_batch_size {self.micro_batch_size} × grad_accum {self.grad_accum} × "
                f"{self.world_size} processes); lower train.micro_batch_size / train.grad_accum or add data"
            )

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch  # the incomplete last global batch is dropped

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._orders = {epoch: torch.randperm(self.num_samples, generator=gen)}
            else:
                self._orders = {epoch: torch.arange(self.num_samples)}
        return self._orders[epoch]

    def micro_indices(self, epoch: int, step: int, accum: int, rank: int) -> list[int]:
        """Sample indices of one micro group (rank ``rank``, accumulation index ``accum``)."""
        group = accum * self.world_size + rank
        start = step * self.global_batch + group * self.micro_batch_size
        return self.order(epoch)[start : start + self.micro_batch_size].tolist()


__all__ = ["BatchPlan"]
