"""Greedy speculative decoding is token-for-token identical to plain greedy decoding of the verifier (fp32): chain
and tree, batch 1 and batch > 1 (rows accepting different numbers of tokens, finishing at different times), random,
fitted and always-agreeing drafts, Llama and Qwen3 verifiers."""

from __future__ import annotations

import copy

import pytest
import torch

from speculators.decoding import DecodingConfig, SpeculativeDecoder, plain_generate
from tests.support.tiny_models import random_draft, single_thread

NEW = 32
PROMPTS = 32  # all shipped prompts
CONFIGS = {
    "chain-k1": DecodingConfig(method="chain", num_speculative_tokens=1, max_new_tokens=NEW),
    "chain-k4": DecodingConfig(method="chain", num_speculative_tokens=4, max_new_tokens=NEW),
    "tree": DecodingConfig(method="tree", tree_topk=3, tree_depth=4, tree_budget=10, max_new_tokens=NEW),
    # wide enough to hold the all-zeros path of the agreeing draft below: 3 + 9 + 9 + 1 candidates
    "tree-wide": DecodingConfig(method="tree", tree_topk=3, tree_depth=4, tree_budget=22, max_new_tokens=NEW),
}


def batched(decode, prompts, batch_size):
    out = []
    for start in range(0, len(prompts), batch_size):
        out += decode(prompts[start : start + batch_size])
    return out


@pytest.fixture(scope="module")
def prompts(chat_prompts):
    return chat_prompts[:PROMPTS]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    """Plain greedy, one prompt at a time."""
    with single_thread():
        return [plain_generate(tiny_llama, [p], NEW).tokens[0] for p in prompts]


def test_plain_loop_matches_transformers_generate_and_its_own_batching(tiny_llama, prompts, reference):
    for prompt, expected in zip(prompts[:2], reference[:2], strict=True):
        hf = tiny_llama.generate(
            torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None
        )
        assert hf[0, len(prompt) :].tolist() == expected
    assert batched(lambda ps: plain_generate(tiny_llama, ps, NEW).tokens, prompts, 8) == reference


@pytest.mark.parametrize(
    "which, name",
    [
        ("random", "chain-k4"),
        ("random", "tree"),
        ("fitted", "chain-k1"),
        ("fitted", "chain-k4"),
        ("fitted", "tree"),
    ],
)
def test_speculative_greedy_equals_plain_greedy(
    tiny_llama, fitted_llama_draft, prompts, reference, name, which
):
    draft = fitted_llama_draft if which == "fitted" else random_draft(tiny_llama, draft_vocab_size=1024)
    decoder = SpeculativeDecoder(tiny_llama, draft, CONFIGS[name])
    rows = len(prompts) if which == "fitted" else 16  # a random draft accepts ~nothing: fewer rows suffice
    assert batched(lambda ps: decoder.generate(ps).tokens, prompts[:rows], 8) == reference[:rows]
    single = [decoder.generate([p]).tokens[0] for p in prompts[::6]]
    assert single == reference[::6]


def test_fitted_draft_batch_mixes_acceptance_lengths(tiny_llama, fitted_llama_draft, prompts):
    """The batch-identity test above is meaningful: within one batch, rows accept different numbers of tokens at
    the same step (so the caches carry per-row holes), and acceptance is neither all nor nothing."""
    decoder = SpeculativeDecoder(tiny_llama, fitted_llama_draft, CONFIGS["chain-k4"])
    accepted = decoder.generate(prompts[4:12]).stats.accepted
    steps = max(map(len, accepted))
    diverging = [s for s in range(steps) if len({row[s] for row in accepted if len(row) > s}) > 1]
    assert len(diverging) >= 3, accepted
    flat = [count for row in accepted for count in row]
    assert 0 < sum(flat) < 4 * len(flat) and 0 in flat and 4 in flat, accepted


def test_rows_stopping_at_eos_match_plain(tiny_llama, fitted_llama_draft, prompts, reference):
    eos = reference[0][NEW // 2]  # a token that ends some rows mid-way and not others
    config = CONFIGS["tree"]
    expected = plain_generate(tiny_llama, prompts[:8], NEW, eos_token_ids=[eos]).tokens
    got = SpeculativeDecoder(tiny_llama, fitted_llama_draft, config).generate(prompts[:8], [eos]).tokens
    assert got == expected
    assert len({len(t) for t in got}) > 1 and all(t[-1] == eos for t in got if len(t) < NEW)


def agreeing_pair(verifier):
    """docs/format.md's deterministic check: a verifier with a zeroed final norm always emits token 0, a draft with a
    zeroed norm always proposes its draft id 0, and d2t[0] = 0 maps it to token 0: everything is accepted."""
    verifier = copy.deepcopy(verifier)
    with torch.no_grad():
        verifier.model.norm.weight.zero_()
    draft = random_draft(verifier, draft_vocab_size=64)
    with torch.no_grad():
        draft.norm.weight.zero_()
    return verifier, draft


@pytest.mark.parametrize("name", ["chain-k4", "tree-wide"])
def test_always_agreeing_draft_accepts_everything(tiny_llama, prompts, name):
    verifier, draft = agreeing_pair(tiny_llama)
    result = SpeculativeDecoder(verifier, draft, CONFIGS[name]).generate(prompts[:4])
    assert result.tokens == [[0] * NEW] * 4
    summary = result.stats.summary()
    assert summary["per_position_acceptance_conditional"] == [1.0] * 4
    assert summary["acceptance_length_global"] == pytest.approx(5.0)  # 4 accepted drafts + the bonus token


def test_qwen3_verifier(tiny_qwen3_dir, prompts):
    from speculators.verifier import load_verifier

    verifier = load_verifier(str(tiny_qwen3_dir), dtype="float32")[0]
    prompts = prompts[:6]
    expected = [plain_generate(verifier, [p], NEW).tokens[0] for p in prompts]
    draft = random_draft(verifier, draft_vocab_size=512)
    for name in ["chain-k4", "tree"]:
        decoder = SpeculativeDecoder(verifier, draft, CONFIGS[name])
        assert batched(lambda ps, d=decoder: d.generate(ps).tokens, prompts, 3) == expected, name
    verifier, draft = agreeing_pair(verifier)
    for name in ["chain-k4", "tree-wide"]:
        summary = SpeculativeDecoder(verifier, draft, CONFIGS[name]).generate(prompts[:2]).stats.summary()
        assert summary["acceptance_length_global"] == pytest.approx(5.0), name
