"""Loss terms against hand computations: alignment of targets and masks, soft CE, HASS top-K, acceptance."""

from __future__ import annotations

import math
from functools import partial

import torch

from train.losses import (
    acceptance_counts,
    acceptance_summary,
    step_masks,
    step_terms,
    step_weights,
)
from train.objectives.eagle3 import topk_distillation


def test_step_weights():
    assert step_weights(3, 0.8) == [1.0, 0.8, 0.8**2]
    assert step_weights(2, 1.0) == [1.0, 1.0]


def test_masks_shift_per_step_and_stay_inside_documents():
    # one row: document 0 = positions 0..4, document 1 = positions 5..7, then padding
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, -1]])
    loss = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    argmax_draft = torch.tensor([[5, 6, 7, -1, 9, 1, 2, 3, 0]])  # -1: verifier argmax outside the draft vocab
    masks = step_masks(loss, doc, argmax_draft, steps=2, mask_out_of_vocab=True)
    # step 0 at t predicts x_{t+2}: valid where loss[t+2] and t+2 in the same document
    assert masks.valid[0, 0].tolist() == [1, 1, 1, 0, 0, 1, 0, 0, 0]
    # its target is the verifier at t+1; position 2 targets u=3 whose argmax is out of vocab -> not trained
    assert masks.target_draft_id[0, 0].tolist() == [6, 7, -1, 9, 1, 2, 3, 0, -1]
    assert masks.trained[0, 0].tolist() == [1, 1, 0, 0, 0, 1, 0, 0, 0]
    # step 1 predicts x_{t+3} from the verifier at t+2
    assert masks.valid[1, 0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert masks.target_draft_id[1, 0].tolist() == [7, -1, 9, 1, 2, 3, 0, -1, -1]
    assert masks.trained[1, 0].tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0]
    counts = masks.counts()
    assert counts.tolist() == [[3, 1], [4, 2]]
    unmasked = step_masks(loss, doc, argmax_draft, steps=2, mask_out_of_vocab=False)
    assert torch.equal(unmasked.trained, unmasked.valid)


def test_step_terms_match_hand_computation():
    torch.manual_seed(0)
    batch, length, vocab, k = 1, 6, 12, 3
    draft = torch.randn(batch, length, vocab, requires_grad=True)
    verifier = torch.randn(batch, length, vocab) * 3
    doc = torch.zeros(batch, length, dtype=torch.long)
    loss = torch.ones(batch, length, dtype=torch.bool)
    masks = step_masks(loss, doc, verifier.argmax(-1), steps=2)
    step = 1
    terms = step_terms(draft, verifier, masks, step, partial(topk_distillation, k=k))
    ce_ref, top_ref, correct = 0.0, 0.0, 0
    for t in range(length):
        if not masks.trained[step, 0, t]:
            continue
        p = torch.softmax(verifier[0, t + 1 + step].double(), -1)
        logq = torch.log_softmax(draft[0, t].detach().double(), -1)
        ce_ref += float(-(p * logq).sum())
        top = torch.argsort(p, descending=True)[:k]
        top_ref += float(-sum(p[i] * logq[i] for i in top))
        correct += int(draft[0, t].argmax() == verifier[0, t + 1 + step].argmax())
    assert math.isclose(float(terms.ce.detach()), ce_ref, rel_tol=1e-5)
    assert math.isclose(float(terms.topk.detach()), top_ref, rel_tol=1e-5)
    assert float(terms.correct) == correct
    assert masks.trained[step].sum() == length - 2 - step


def test_topk_distillation_by_hand():
    target = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draft = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25]]))
    expected = -(0.5 * math.log(0.25) + 0.3 * math.log(0.25))
    assert math.isclose(float(topk_distillation(draft, target, 2)), expected, rel_tol=1e-6)
    # K larger than the vocabulary: the whole soft cross-entropy
    full = -(sum(p * math.log(0.25) for p in (0.5, 0.3, 0.15, 0.05)))
    assert math.isclose(float(topk_distillation(draft, target, 10)), full, rel_tol=1e-6)


def test_acceptance_is_conditional_and_in_order():
    # 4 positions, 3 steps. valid everywhere except step 2 at position 3 (end of document).
    correct = torch.tensor(
        [
            [[1, 1, 0, 1]],  # step 0
            [[1, 0, 1, 1]],  # step 1 (position 2's step-1 hit does not count: step 0 failed)
            [[0, 1, 1, 1]],  # step 2
        ],
        dtype=torch.bool,
    )
    valid = torch.ones_like(correct)
    valid[2, 0, 3] = False
    counts = acceptance_counts(correct, valid)
    # accepted chains: pos0 -> 2 tokens, pos1 -> 1, pos2 -> 0, pos3 -> 2 (cut by the document end)
    assert counts[0].tolist() == [3, 2, 0]
    assert counts[1].tolist() == [4, 3, 1]  # eligible: alive before step j and step j has a target
    assert counts[2].tolist() == [4, 4, 3]  # reachable
    summary = acceptance_summary(counts)
    assert math.isclose(summary["acceptance_length"], 1 + 5 / 4)
    assert math.isclose(summary["acceptance_length_max"], 1 + 11 / 4)
    assert summary["acceptance_conditional"] == [0.75, round(2 / 3, 6), 0.0]
