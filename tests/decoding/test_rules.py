"""The verification rules on their own: tree bookkeeping, greedy walk, and the lossless rejection rule tested
statistically on many independent rows at once (one row = one sample), against deliberately broken rules."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from speculators.algorithms.eagle3.drafter import _select_tree
from speculators.decoding.metrics import DecodingStats
from speculators.decoding.tree import DraftTree, chain_tree
from speculators.decoding.verify import RejectionSampler, verify_greedy

ROWS = 200_000
PASS_P = 1e-3  # a correct rule fails this only by a 1-in-1000 fluke, and the seeds are fixed
FAIL_P = 1e-12  # a broken rule must be rejected overwhelmingly, not borderline


class AcceptAlways(RejectionSampler):
    def accept_probability(self, p_x, q_x):
        return torch.ones_like(p_x)


class ResampleFromTarget(RejectionSampler):
    def residual(self, p, q):
        return p


def _tree(parents: list[int], tokens: list[int], batch: int) -> DraftTree:
    parents_t = torch.tensor(parents)
    depths = torch.zeros(len(parents), dtype=torch.long)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return DraftTree(
        tokens=torch.tensor(tokens).expand(batch, -1).clone(),
        parents=parents_t.expand(batch, -1).clone(),
        depths=depths.expand(batch, -1).clone(),
    )


def test_tree_masks_and_children():
    tree = _tree([-1, 0, 0, 1, 1, 2], [9, 1, 2, 3, 4, 5], batch=2)
    children = tree.children()
    assert children[0, 0].tolist() == [1, 2] and children[0, 1].tolist() == [3, 4]
    assert children[0, 2].tolist() == [5, -1] and children[0, 3].tolist() == [-1, -1]
    mask = tree.ancestor_mask()[0].int()
    assert mask[3].tolist() == [1, 1, 0, 1, 0, 0]
    assert mask[5].tolist() == [1, 0, 1, 0, 0, 1]
    chain = chain_tree(torch.tensor([7]), torch.tensor([[1, 2, 3]]))
    assert chain.ancestor_mask()[0].int().tril().sum() == 10 and chain.max_depth == 3


def test_tree_selection_keeps_parents_before_children():
    # candidates in depth order; candidate 2 (depth 2) has the same score as its parent 0: ties keep the parent first
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    scores = torch.tensor([[-0.1, -0.5, -0.1, -0.7, -3.0]])
    parents = torch.tensor([[-1, -1, 0, 0, 1]])
    depths = torch.tensor([[1, 1, 2, 2, 2]])
    tree = _select_tree(torch.tensor([99]), tokens, scores, parents, depths, budget=3)
    assert tree.tokens.tolist() == [[99, 10, 12, 11]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0]] and tree.depths.tolist() == [[0, 1, 2, 1]]


def test_greedy_walk_follows_argmax_and_appends_correction():
    tree = _tree([-1, 0, 0, 1, 2], [9, 1, 2, 3, 4], batch=2)
    logits = torch.zeros(2, 5, 10)
    logits[0, 0, 2] = logits[0, 2, 4] = logits[0, 4, 7] = 1  # row 0: root→2→4 accepted, then bonus 7
    logits[1, 0, 1] = logits[1, 1, 5] = 1  # row 1: root→1, then 5 ≠ 3: correction 5
    verdict = verify_greedy(tree, logits)
    assert verdict.num_accepted.tolist() == [2, 1]
    assert verdict.emitted(tree) == [[2, 4, 7], [1, 5]]
    assert verdict.path[0].tolist() == [0, 2, 4] and verdict.path[1, :2].tolist() == [0, 1]


def _first_token_counts(
    sampler: RejectionSampler, tree: DraftTree, probs: torch.Tensor, seed: int
) -> torch.Tensor:
    verdict = sampler.verify(tree, probs, torch.Generator().manual_seed(seed))
    first = torch.where(
        verdict.num_accepted > 0, tree.tokens.gather(1, verdict.path[:, 1:2])[:, 0], verdict.next_token
    )
    return torch.bincount(first, minlength=probs.shape[-1]).double()


def _p_value(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return float(chisquare(counts[keep].numpy(), expected[keep].numpy()).pvalue)


P = torch.tensor([0.05, 0.30, 0.10, 0.35, 0.15, 0.05])
Q = torch.tensor([0.40, 0.05, 0.30, 0.05, 0.10, 0.10])


def _sampled_chain(seed: int) -> tuple[DraftTree, torch.Tensor]:
    """One drafted token x ~ Q per row, with the chain's proposal recorded; child target is irrelevant here."""
    drafted = torch.multinomial(Q.expand(ROWS, -1), 1, generator=torch.Generator().manual_seed(seed))
    tree = chain_tree(torch.zeros(ROWS, dtype=torch.long), drafted, Q.expand(ROWS, 1, -1).clone())
    probs = torch.stack([P, torch.full_like(P, 1 / 6)]).expand(ROWS, -1, -1)
    return tree, probs


@pytest.mark.parametrize(
    "sampler, lossless", [(RejectionSampler(), True), (AcceptAlways(), False), (ResampleFromTarget(), False)]
)
def test_chain_rule_is_lossless_and_broken_rules_are_caught(sampler, lossless):
    tree, probs = _sampled_chain(seed=3)
    p_value = _p_value(_first_token_counts(sampler, tree, probs, seed=4), P)
    assert (p_value > PASS_P) if lossless else (p_value < FAIL_P), p_value


@pytest.mark.parametrize(
    "sampler, lossless", [(RejectionSampler(), True), (AcceptAlways(), False), (ResampleFromTarget(), False)]
)
def test_tree_siblings_rule_is_lossless(sampler, lossless):
    # deterministic siblings [3, 0, 5] under the root (point-mass proposals), one grandchild under 3
    tree = _tree([-1, 0, 0, 0, 1], [9, 3, 0, 5, 2], batch=ROWS)
    probs = torch.stack([P, torch.full_like(P, 1 / 6), P, P, P]).expand(ROWS, -1, -1)
    p_value = _p_value(_first_token_counts(sampler, tree, probs, seed=5), P)
    assert (p_value > PASS_P) if lossless else (p_value < FAIL_P), p_value


def test_acceptance_rate_matches_theory():
    """With x ~ q and target p, the acceptance probability is Σ min(p, q)."""
    tree, probs = _sampled_chain(seed=6)
    verdict = RejectionSampler().verify(tree, probs, torch.Generator().manual_seed(7))
    rate = verdict.num_accepted.double().mean().item()
    assert abs(rate - torch.minimum(P, Q).sum().item()) < 0.005


def test_stats_distinguish_global_and_per_sample_acceptance():
    stats = DecodingStats(max_depth=3, accepted=[[3, 3], [0, 0, 0, 0]], generated=[8, 4], wall_s=1.0)
    summary = stats.summary()
    assert summary["acceptance_length_global"] == pytest.approx(1 + 6 / 6)
    assert summary["acceptance_length_per_sample_mean"] == pytest.approx((4 + 1) / 2)
    assert summary["per_position_acceptance_conditional"] == pytest.approx([2 / 6, 1.0, 1.0])
    assert summary["per_position_acceptance_unconditional"] == pytest.approx([2 / 6, 2 / 6, 2 / 6])
