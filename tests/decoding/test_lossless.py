"""Speculative sampling is lossless end to end: with a small-vocabulary verifier, the tokens the engine emits are
distributed exactly as the verifier's own sampling distribution (computed exactly by enumerating every sequence),
and a deliberately broken rule is caught. One batch row = one independent sample, so tens of thousands of samples
cost a few batched forwards. Seeds are fixed; the thresholds leave orders of magnitude of margin either way."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from speculators.decoding import DecodingConfig, RejectionSampler, SpeculativeDecoder, plain_generate
from speculators.decoding.sampling import target_probs
from tests.support.tiny_models import random_draft, tiny_model

VOCAB = 8
PROMPT = [1, 2, 3]
NEW = 4
ROWS = 30_000
PASS_P = 1e-3
FAIL_P = 1e-9


class AcceptAlways(RejectionSampler):
    def accept_probability(self, p_x, q_x):
        return torch.ones_like(p_x)


class ResampleFromTarget(RejectionSampler):
    def residual(self, p, q):
        return p


@pytest.fixture(scope="module")
def pair():
    """A peaked small-vocab verifier and a draft that disagrees with it and lacks two tokens of its vocabulary."""
    verifier = tiny_model(
        VOCAB,
        seed=0,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with torch.no_grad():
        verifier.lm_head.weight.mul_(12.0)
    draft = random_draft(verifier, draft_vocab_size=6, seed=3, target_ids=[0, 1, 2, 4, 5, 7])
    with torch.no_grad():
        draft.lm_head.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(4))
    return verifier, draft


def exact_joint(verifier, temperature: float, top_p: float) -> dict[tuple[int, ...], float]:
    """P(t1..t4 | PROMPT) for every sequence, from full (uncached) forwards."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = verifier(input_ids=ids).logits[:, len(PROMPT) - 1 : -1]
    probs = target_probs(logits, temperature, top_p).double()
    joint = probs.gather(2, seqs[:, :, None])[:, :, 0].prod(dim=1)
    return {tuple(s): float(p) for s, p in zip(seqs.tolist(), joint, strict=True)}


def p_value(samples: list[list[int]], joint: dict, positions: tuple[int, ...]) -> float:
    """Chi-square of the samples' joint over ``positions`` against the exact marginal (small cells pooled); 0 when
    a sequence of probability zero was emitted."""
    expected: dict[tuple[int, ...], float] = {}
    for seq, prob in joint.items():
        key = tuple(seq[i] for i in positions)
        expected[key] = expected.get(key, 0.0) + prob * len(samples)
    observed = dict.fromkeys(expected, 0)
    for sample in samples:
        key = tuple(sample[i] for i in positions)
        observed[key] += 1
    impossible = [k for k in expected if expected[k] == 0]  # outside the top-p nucleus
    if sum(observed[k] for k in impossible):
        return 0.0  # emitted a sequence of probability zero (outside the top-p nucleus): certainly not p
    big = [k for k in expected if expected[k] >= 5]
    small = [k for k in expected if 0 < expected[k] < 5]
    obs = [observed[k] for k in big] + ([sum(observed[k] for k in small)] if small else [])
    exp = [expected[k] for k in big] + ([sum(expected[k] for k in small)] if small else [])
    scale = sum(obs) / sum(exp)  # the fp32 softmaxes sum to 1 only within rounding
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def run(
    pair, config: DecodingConfig, sampler=None, seed: int = 0, check_mixed: bool = False
) -> list[list[int]]:
    verifier, draft = pair
    result = SpeculativeDecoder(verifier, draft, config, sampler).generate(
        [PROMPT] * ROWS, generator=torch.Generator().manual_seed(seed)
    )
    assert all(len(t) == NEW for t in result.tokens)
    if check_mixed:  # both branches of the rule (accept, reject + resample) and the bonus token are exercised
        per_position = result.stats.summary()["per_position_acceptance_unconditional"]
        assert 0.1 < per_position[0] < 0.9, per_position
        assert config.top_p < 1 or per_position[-1] > 0.01, per_position
    return result.tokens


CHAIN = DecodingConfig(method="chain", num_speculative_tokens=2, temperature=1.0, max_new_tokens=NEW)
CHAIN_TOP_P = DecodingConfig(
    method="chain", num_speculative_tokens=3, temperature=0.8, top_p=0.8, max_new_tokens=NEW
)
TREE = DecodingConfig(
    method="tree", tree_topk=2, tree_depth=2, tree_budget=4, temperature=1.0, max_new_tokens=NEW
)


def test_plain_sampling_matches_the_exact_distribution(pair):
    """The harness itself: direct sampling of the verifier passes."""
    joint = exact_joint(pair[0], 1.0, 1.0)
    tokens = plain_generate(
        pair[0], [PROMPT] * ROWS, NEW, 1.0, generator=torch.Generator().manual_seed(1)
    ).tokens
    assert p_value(tokens, joint, (0, 1, 2)) > PASS_P
    assert p_value(tokens, joint, (2, 3)) > PASS_P


@pytest.mark.parametrize("config", [CHAIN, CHAIN_TOP_P, TREE], ids=["chain", "chain-top-p", "tree"])
def test_speculative_sampling_is_lossless(pair, config):
    joint = exact_joint(pair[0], config.temperature, config.top_p)
    tokens = run(pair, config, seed=2, check_mixed=True)
    for positions in [(0, 1, 2), (2, 3)]:
        assert p_value(tokens, joint, positions) > PASS_P, positions


@pytest.mark.parametrize(
    "config, broken",
    [(CHAIN, AcceptAlways()), (TREE, ResampleFromTarget())],
    ids=["chain-accept-always", "tree-resample-from-p"],
)
def test_broken_rules_are_detected(pair, config, broken):
    """(test_rules.py checks every rule × structure combination on the rule alone.)"""
    joint = exact_joint(pair[0], config.temperature, config.top_p)
    tokens = run(pair, config, broken, seed=2)
    assert min(p_value(tokens, joint, positions) for positions in [(0, 1, 2), (2, 3)]) < FAIL_P


if __name__ == "__main__":  # print the p-values (margins) of every case
    built = pair.__wrapped__()
    for cfg, name in [(CHAIN, "chain"), (CHAIN_TOP_P, "chain-top-p"), (TREE, "tree")]:
        exact = exact_joint(built[0], cfg.temperature, cfg.top_p)
        for rule in [RejectionSampler(), AcceptAlways(), ResampleFromTarget()]:
            out = run(built, cfg, rule, seed=2)
            print(name, type(rule).__name__, [p_value(out, exact, pos) for pos in [(0, 1, 2), (2, 3)]])
