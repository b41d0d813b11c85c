"""Small models built in memory for the decoding tests: a random fp32 verifier, a random draft for it, and a
one-thread context. Plain functions, imported by module path (``tests.support.tiny_models``), never from a
``conftest``: which ``conftest`` a bare ``import conftest`` finds depends on collection order."""

from __future__ import annotations

from contextlib import contextmanager

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


def tiny_model(vocab_size: int = 512, seed: int = 0, arch: str = "llama", **overrides):
    """A random fp32 verifier held in memory (sdpa attention)."""
    from transformers import AutoModelForCausalLM

    from tests.support.verifiers import tiny_verifier_config

    torch.manual_seed(seed)
    config = tiny_verifier_config(arch, vocab_size=vocab_size, **overrides)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().requires_grad_(False)


def random_draft(verifier, draft_vocab_size: int | None = None, seed: int = 1, target_ids=None):
    """A random EAGLE-3 draft for ``verifier`` (optionally with a reduced vocabulary mapped to ``target_ids``)."""
    from speculators.algorithms.eagle3.config import Eagle3Config
    from speculators.algorithms.eagle3.model import Eagle3DraftModel

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
