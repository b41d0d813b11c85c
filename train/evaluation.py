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
from train.losses import step_masks, step_terms
from train.step_stats import StepStats
from train.targets import TargetHead, needed_positions, target_draft_ids, target_logits


@torch.no_grad()
def evaluate(
    accelerator,
    model,
    head: TargetHead,
    batches: Iterable[MicroBatch],
    steps: int,
    weights: list[float],
    topk: int,
    topk_weight: float,
    mask_out_of_vocab: bool,
) -> dict[str, Any]:
    """Metrics over this rank's batches, summed over all ranks (collective: every rank must call it)."""
    device = accelerator.device
    was_training = model.training
    model.eval()
    stats = StepStats(steps, device)
    for batch in batches:
        batch = batch.to(device)
        needed = needed_positions(batch.loss_mask)
        verifier_logits = target_logits(head, batch.last_hidden, needed)
        draft_ids = target_draft_ids(head, batch.last_hidden, needed)
        masks = step_masks(batch.loss_mask, batch.document_ids, draft_ids, steps, mask_out_of_vocab)
        logits = model(batch.input_ids, batch.aux_hidden, batch.position_ids, batch.document_ids, steps=steps)
        correct = []
        for j in range(steps):
            terms = step_terms(logits[j], verifier_logits, masks, j, topk if topk_weight else 0)
            stats.add_terms(j, terms, batch.weight)
            correct.append(logits[j].argmax(-1) == masks.target_draft_id[j])
        stats.add_positions(masks, batch.weight)
        stats.add_chain(torch.stack(correct), masks.valid, batch.weight)
    total = stats.all_reduce(accelerator)
    if was_training:
        model.train()
    return summarize(total, weights, topk_weight)


def summarize(stats: StepStats, weights: list[float], topk_weight: float) -> dict[str, Any]:
    """The ``eval/*`` metrics of all-reduced statistics (the names the logs, best.json and the model card read)."""
    return {
        "eval/loss": stats.loss(weights, topk_weight),
        "eval/positions": stats.drafts_started,
        **stats.per_step_metrics("eval"),
        **stats.acceptance("eval"),
    }


__all__ = ["evaluate", "summarize"]
