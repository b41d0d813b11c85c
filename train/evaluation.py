"""Held-out validation: loss, per-step top-1 accuracy and the simulated acceptance length.

The simulated acceptance length unrolls the draft ``eval.k`` steps at every held-out position t with the TTT
attention (what the draft sees at inference when its earlier proposals were accepted) and accepts draft token j
when it and all earlier ones equal the verifier's greedy token — conditional, in-order acceptance.
τ = 1 + accepted / drafts, a global ratio over all positions that start a draft (every position followed by an
assistant token). ``acceptance_length_max`` is the ceiling on this data (drafts cut by document ends).
Checkpoints are selected by τ, not by loss: acceptance can peak while the loss still falls.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from train.data import MicroBatch
from train.objectives import Objective
from train.step_stats import StepStats
from train.targets import TargetHead


@torch.no_grad()
def evaluate(
    accelerator,
    model,
    objective: Objective,
    head: TargetHead,
    batches: Iterable[MicroBatch],
    steps: int,
) -> dict[str, Any]:
    """Metrics over this rank's batches, summed over all ranks (collective: every rank must call it). The
    objective drafts ``steps`` positions from every held-out position and scores them."""
    device = accelerator.device
    was_training = model.training
    model.eval()
    stats = StepStats(steps, device)
    for batch in batches:
        objective.evaluate(model, batch.to(device), head, stats, steps)
    total = stats.all_reduce(accelerator)
    if was_training:
        model.train()
    return summarize(total, objective.weights, objective.topk_weight)


def summarize(stats: StepStats, weights: list[float], topk_weight: float) -> dict[str, Any]:
    """The ``eval/*`` metrics of all-reduced statistics (the names the logs, best.json and the model card read)."""
    return {
        "eval/loss": stats.loss(weights, topk_weight),
        "eval/positions": stats.drafts_started,
        **stats.per_step_metrics("eval"),
        **stats.acceptance("eval"),
    }


__all__ = ["evaluate", "summarize"]
