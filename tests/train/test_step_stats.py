"""StepStats: the sums the train and eval loops keep, their one all-reduce, and the metrics made from them."""

from __future__ import annotations

import pytest
import torch

from train.losses import StepTerms, step_masks
from train.step_stats import StepStats


def _masks(seed: int):
    gen = torch.Generator().manual_seed(seed)
    loss_mask = torch.randint(0, 2, (2, 12), generator=gen)
    document_ids = torch.zeros(2, 12, dtype=torch.long)
    draft_ids = torch.randint(-1, 5, (2, 12), generator=gen)
    return step_masks(loss_mask, document_ids, draft_ids, 3, mask_out_of_vocab=True)


def _filled() -> StepStats:
    stats = StepStats(3)
    for seed, weight in ((0, 1.0), (1, 2.0)):
        masks = _masks(seed)
        for j in range(3):
            terms = StepTerms(
                torch.tensor(1.5 + j + seed), torch.tensor(0.25 * j), torch.tensor(float(j + seed))
            )
            stats.add_terms(j, terms, weight)
        stats.add_positions(masks, weight)
        stats.add_chain(masks.valid & (masks.target_draft_id == 0), masks.valid, weight)
        stats.add_batch(tokens=24, documents=2)
    return stats


def test_metrics_are_sums_divided_once():
    stats = _filled()
    counts = _masks(0).counts() + 2.0 * _masks(1).counts()
    ce = torch.tensor([1.5 + 2 * 2.5, 2.5 + 2 * 3.5, 3.5 + 2 * 4.5], dtype=torch.float64)
    topk = torch.tensor([0.0, 0.25 * 3, 0.5 * 3], dtype=torch.float64)
    correct = torch.tensor([0.0 + 2 * 1, 1 + 2 * 2, 2 + 2 * 3], dtype=torch.float64)
    per_ce, per_topk = ce / counts[0].clamp_min(1), topk / counts[0].clamp_min(1)
    metrics = stats.per_step_metrics("train", with_topk=True)
    for j in range(3):
        assert metrics[f"train/ce_{j}"] == pytest.approx(float(per_ce[j]), rel=1e-12)
        assert metrics[f"train/topk_{j}"] == pytest.approx(float(per_topk[j]), rel=1e-12)
        assert metrics[f"train/acc_{j}"] == pytest.approx(float(correct[j] / counts[1][j].clamp_min(1)))
    weights = [1.0, 0.8, 0.64]
    expected = sum(w * (per_ce[j] + 0.5 * per_topk[j]) for j, w in enumerate(weights))
    assert stats.loss(weights, 0.5) == pytest.approx(float(expected), rel=1e-12)
    assert list(stats.per_step_metrics("eval")) == [
        "eval/ce_0",
        "eval/acc_0",
        "eval/ce_1",
        "eval/acc_1",
        "eval/ce_2",
        "eval/acc_2",
    ]
    assert float(stats.tokens) == 48 and float(stats.documents) == 4


def test_all_reduce_keeps_every_sum_in_its_place():
    """One collective for all fields: a single process gets back exactly what it added, field by field."""
    from accelerate import Accelerator

    stats = _filled()
    total = stats.all_reduce(Accelerator(cpu=True))
    for name in ("ce", "topk", "trained", "valid", "correct", "chain", "tokens", "documents"):
        assert torch.equal(getattr(total, name), getattr(stats, name)), name
    assert total.acceptance("eval") == stats.acceptance("eval")
    assert total.drafts_started == int(stats.chain[3, 0]) > 0
