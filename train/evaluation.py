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
from train.losses import acceptance_counts, acceptance_summary, step_masks, step_terms
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
    sums = torch.zeros(5, steps, dtype=torch.float64, device=device)  # ce, topk, trained, valid, correct
    chain = torch.zeros(4, steps, dtype=torch.float64, device=device)
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
            sums[0, j] += float(terms.ce) * batch.weight
            sums[1, j] += float(terms.topk) * batch.weight
            sums[4, j] += terms.correct * batch.weight
            correct.append(logits[j].argmax(-1) == masks.target_draft_id[j])
        sums[2:4] += masks.counts().to(device) * batch.weight
        chain += acceptance_counts(torch.stack(correct), masks.valid).to(device) * batch.weight
    sums = accelerator.reduce(sums, reduction="sum")
    chain = accelerator.reduce(chain, reduction="sum")
    if was_training:
        model.train()
    return summarize(sums, chain, weights, topk_weight)


def summarize(
    sums: torch.Tensor, chain: torch.Tensor, weights: list[float], topk_weight: float
) -> dict[str, Any]:
    ce, topk, trained, valid, correct = (sums[i].cpu() for i in range(5))
    per_step_ce = (ce / trained.clamp_min(1)).tolist()
    per_step_topk = (topk / trained.clamp_min(1)).tolist()
    loss = sum(
        w * (per_step_ce[j] + topk_weight * per_step_topk[j]) for j, w in enumerate(weights[: len(ce)])
    )
    metrics: dict[str, Any] = {
        "eval/loss": loss,
        "eval/positions": int(chain[3, 0]),
    }
    for j in range(len(per_step_ce)):
        metrics[f"eval/ce_{j}"] = per_step_ce[j]
        metrics[f"eval/acc_{j}"] = float(correct[j] / valid[j].clamp_min(1))
    summary = acceptance_summary(chain.cpu())
    metrics["eval/acceptance_length"] = summary["acceptance_length"]
    metrics["eval/acceptance_length_max"] = summary["acceptance_length_max"]
    for j, rate in enumerate(summary["acceptance_conditional"]):
        metrics[f"eval/accept_rate_{j}"] = rate
    return metrics


__all__ = ["evaluate", "summarize"]
