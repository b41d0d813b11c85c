"""Fixtures for the decoding tests: one thread per test, tokenised chat prompts, the tiny Llama and a draft fitted
to it (the plain builders live in :mod:`tests.support.tiny_models`)."""

from __future__ import annotations

import pytest

from tests.support.tiny_models import single_thread


@pytest.fixture(autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="session")
def chat_prompts(smollm2_tokenizer) -> list[list[int]]:
    """The shipped default prompt set, rendered with SmolLM2's chat template."""
    from speculators.eval.prompts import load_prompts, render_prompts

    return render_prompts(smollm2_tokenizer, load_prompts(None))


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    """The shared tiny Llama verifier (SmolLM2 tokenizer, 49k vocab, hidden 64) in fp32."""
    from speculators.verifier import load_verifier

    return load_verifier(str(tiny_llama_dir), dtype="float32")[0]


@pytest.fixture(scope="session")
def fitted_llama_draft(tiny_llama, chat_prompts):
    """A draft briefly fitted to the tiny Llama's greedy continuations of the first 8 prompts: high acceptance on
    those, lower on the rest, so a batch mixes rows that accept very different numbers of tokens."""
    from tests.support.quickfit import fit_draft

    with single_thread():
        draft, report = fit_draft(
            tiny_llama,
            chat_prompts[:8],
            name_or_path="tiny-llama",
            draft_vocab_size=256,
            max_new_tokens=32,
            steps=60,
            lr=5e-3,
        )
    assert report.losses[-1] < report.losses[0] / 2, report.as_dict()
    return draft.requires_grad_(False)
