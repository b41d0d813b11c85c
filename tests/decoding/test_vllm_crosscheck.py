"""Our acceptance length agrees with vLLM's for the same exported draft, verifier, prompts and k (greedy, fp32).

The verifier is a small random Llama that vLLM's CPU attention accepts (head_dim 64) and the draft is fitted to it
briefly, so acceptance is neither 0 nor 100% and differs between prompts. Both engines get the same token prompts
via ``speculators eval --vllm`` (the ``evaluate`` API), which also exercises that option end to end. The same holds
for a DFlash (block) draft fitted to the same verifier, causal and bidirectional, with k below its block too."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import require_consumer
from tests.support.tiny_models import single_thread

pytestmark = pytest.mark.consumer

KS = [1, 3]
TOLERANCE = 0.02  # relative difference of the acceptance lengths (measured here: identical to 4 decimals)


@pytest.fixture(scope="module")
def served_pair(tmp_path_factory, smollm2_tokenizer, chat_prompts):
    from speculators.verifier import load_verifier
    from tests.support.quickfit import fit_draft
    from tests.support.verifiers import build_tiny_verifier

    root = tmp_path_factory.mktemp("vllm-crosscheck")
    verifier_dir = build_tiny_verifier(
        root / "verifier",
        arch="llama",
        seed=3,
        tokenizer=smollm2_tokenizer,
        vocab_size=len(smollm2_tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    verifier = load_verifier(str(verifier_dir), dtype="float32")[0]
    with single_thread():
        draft, _ = fit_draft(
            verifier,
            chat_prompts[:8],
            name_or_path=str(verifier_dir),
            draft_vocab_size=512,
            max_new_tokens=32,
            steps=60,
            lr=5e-3,
        )
    draft_dir = draft.save_pretrained(root / "draft", dtype=torch.float32)
    return verifier_dir, draft_dir


def test_acceptance_length_matches_vllm(served_pair, tmp_path):
    from speculators.eval.evaluation import EvalSettings, evaluate
    from speculators.serving.vllm_bridge import vllm_available

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    verifier_dir, draft_dir = served_pair
    settings = EvalSettings(ks=KS, max_new_tokens=32, max_prompts=12, batch_size=4, vllm=True)
    results = evaluate(draft_dir, str(verifier_dir), settings=settings, output_dir=tmp_path, dtype="float32")
    assert_agrees_with_vllm(results)
    # vLLM without the draft ran on the same prompts: the baseline of the tokens/s comparison.
    assert (
        results["vllm"]["plain"]["tokens_per_s"] > 0 and results["vllm"]["plain"]["acceptance_length"] is None
    )


def assert_agrees_with_vllm(results: dict) -> None:
    """Every run's acceptance (overall and per position) and outputs equal vLLM's for the same k."""
    for run in results["runs"]:
        theirs = results["vllm"][run["name"]]
        ours = run["acceptance_length_global"]
        print(
            f"{run['name']}: ours {ours:.4f}, vLLM {theirs['acceptance_length']:.4f}, "
            f"identical outputs {theirs['outputs_identical_to_ours']:.0%}"
        )
        assert theirs["outputs_identical_to_ours"] >= 0.9  # fp32 greedy: the same tokens, barring rare ties
        assert 1.2 < ours < run["k"] + 0.9, ours  # mixed acceptance: the comparison is not trivially 1 or k+1
        assert abs(ours - theirs["acceptance_length"]) <= TOLERANCE * ours, (run["name"], ours, theirs)
        per_position = zip(
            run["per_position_acceptance_unconditional"],
            theirs["per_position_acceptance_unconditional"],
            strict=True,
        )
        assert all(abs(a - b) <= TOLERANCE for a, b in per_position), (run, theirs)
        assert theirs["speedup_vs_vllm_plain"] > 0


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_dflash_acceptance_matches_vllm(served_pair, chat_prompts, tmp_path, causal):
    """A DFlash draft (4 draft slots) fitted to the same verifier: our block drafting equals vLLM's, with the whole
    block (k = 4) and with fewer slots than it has (k = 2: vLLM then runs a block of 1 + k slots)."""
    from speculators.eval.evaluation import EvalSettings, evaluate
    from speculators.serving.vllm_bridge import vllm_available
    from speculators.verifier import load_verifier
    from tests.support.quickfit_block import fit_block_draft

    require_consumer(vllm_available(), "the vLLM virtualenv", "vllm-env")
    verifier_dir, _ = served_pair
    verifier = load_verifier(str(verifier_dir), dtype="float32")[0]
    with single_thread():
        draft, _ = fit_block_draft(
            verifier, chat_prompts[:8], str(verifier_dir), block_size=5, block_causal=causal, steps=300
        )
    draft_dir = draft.save_pretrained(tmp_path / "dflash", dtype=torch.float32)
    settings = EvalSettings(ks=[4, 2], max_new_tokens=32, max_prompts=12, batch_size=4, vllm=True)
    results = evaluate(draft_dir, str(verifier_dir), settings=settings, dtype="float32")
    assert_agrees_with_vllm(results)
