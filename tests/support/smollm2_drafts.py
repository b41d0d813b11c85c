"""SmolLM2 material of the consumer checks (tests/conformance): chat prompts, a counts-based draft vocabulary of
them, and a copy of a verifier whose logits are all zero.

Deterministic acceptance (docs/format.md "Serving and deterministic end-to-end checks"): a copy of a verifier whose
final ``model.norm.weight`` is zero has all-zero logits, so greedy decoding always emits token 0 (not a stop token
of SmolLM2's tokenizer; the runs also set ``ignore_eos``). A draft whose ``norm.weight`` is zero always proposes
draft id 0: with ``d2t[0] == 0`` every proposal is accepted; with every offset shifted by one, none is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from speculators.vocab import DraftVocab, build_draft_vocab

DRAFT_VOCAB = 8192
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "Name three prime numbers."}],
]


def draft_vocab_from_text(tokenizer, texts: list[str]) -> DraftVocab:
    """A real counts-based draft vocabulary (token 0 kept: the zero verifier's only output)."""
    counts = torch.zeros(len(tokenizer), dtype=torch.long)
    for text in texts:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        counts += torch.bincount(ids, minlength=len(tokenizer))
    counts[0] = int(counts.max()) + 1
    return build_draft_vocab(counts, DRAFT_VOCAB, provenance={"source": "tests/consumers"})


def zero_logit_copy(verifier_dir: Path, target: Path) -> Path:
    """The verifier with its final norm zeroed: every logit is 0, greedy decoding always emits token 0."""
    target.mkdir(parents=True)
    for path in verifier_dir.iterdir():
        if path.is_file() and path.name != "model.safetensors":
            shutil.copy2(path, target / path.name)
    weights = load_file(str(verifier_dir / "model.safetensors"))
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target
