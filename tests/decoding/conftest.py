"""Fixtures for the decoding tests: small models built in memory, and tokenised chat prompts."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch


@contextmanager
def single_thread():
    """One intra-op thread: on a machine shared with other jobs every extra OpenMP thread waits out a scheduler
    slice per op; this test group measured 25 s with one thread vs 280 s with two under load."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def one_thread():
    with single_thread():
        yield


def tiny_model(vocab_size: int = 512, seed: int = 0, arch: str = "llama", **overrides):
    """A random fp32 verifier held in memory (sdpa attention)."""
    from transformers import AutoModelForCausalLM

    from tests.support.verifiers import tiny_verifier_config

    torch.manual_seed(seed)
    config = tiny_verifier_config(arch, vocab_size=vocab_size, **overrides)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().requires_grad_(False)


def random_draft(verifier, draft_vocab_size: int | None = None, seed: int = 1, target_ids=None):
    """A random EAGLE-3 draft for ``verifier`` (optionally with a reduced vocabulary mapped to ``target_ids``)."""
    from speculators.format.config import Eagle3Config
    from speculators.models.eagle3 import Eagle3DraftModel

    torch.manual_seed(seed)
    config = Eagle3Config.from_verifier(
        verifier.config.to_dict(), "in-memory", draft_vocab_size=draft_vocab_size, torch_dtype="float32"
    )
    draft = Eagle3DraftModel(config).eval().requires_grad_(False)
    if target_ids is not None:
        target_ids = torch.as_tensor(target_ids)
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[target_ids] = True
        draft.set_vocab(target_ids - torch.arange(len(target_ids)), t2d)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
    return draft


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
