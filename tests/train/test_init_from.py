"""train.init_from (HASS stage 2) meets a first stage's draft vocabulary: one built for another tokenizer or size
is refused before any weight is loaded (DraftVocab.check_compatible), one built for this run is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculators.format.config import Eagle3Config
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.vocab import build_draft_vocab
from tests.support.verifiers import tiny_verifier_config
from train.assemble import init_from_checkpoint

TOKENIZER = "a" * 64


def vocab_for(tokenizer: str, size: int = 32):
    counts = torch.arange(128, dtype=torch.float64)
    return build_draft_vocab(counts, size, {"tokenizer_fingerprint": tokenizer})


def fresh_draft(vocab) -> Eagle3DraftModel:
    config = Eagle3Config.from_verifier(
        tiny_verifier_config("llama", vocab_size=128).to_dict(),
        "tiny",
        draft_vocab_size=vocab.draft_vocab_size,
    )
    draft = Eagle3DraftModel(config)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    return draft


@pytest.fixture
def first_stage(tmp_path) -> Path:
    """A run dir as the trainer leaves it: a step with a draft, and the run's draft vocabulary."""
    vocab = vocab_for(TOKENIZER)
    run = tmp_path / "stage1"
    fresh_draft(vocab).save_pretrained(run / "checkpoints" / "step-5" / "draft", dtype=torch.float32)
    vocab.save(run / "draft_vocab.safetensors")
    return run


def test_a_vocab_built_for_another_tokenizer_is_refused(first_stage):
    vocab = vocab_for("b" * 64)
    with pytest.raises(
        ValueError, match=r"train.init_from=.*draft vocabulary .* was built for tokenizer aaaa"
    ):
        init_from_checkpoint(fresh_draft(vocab), first_stage, vocab)


def test_a_vocab_of_another_size_is_refused(first_stage):
    vocab = vocab_for(TOKENIZER, size=48)
    with pytest.raises(ValueError, match="has 32 draft tokens but the recipe asks for 48"):
        init_from_checkpoint(fresh_draft(vocab), first_stage, vocab)


def test_the_same_vocab_loads_the_first_stage_weights(first_stage):
    vocab = vocab_for(TOKENIZER)
    draft = fresh_draft(vocab)
    init_from_checkpoint(draft, first_stage, vocab)
    saved = Eagle3DraftModel.from_pretrained(first_stage / "checkpoints" / "step-5" / "draft")
    assert torch.equal(draft.fc.weight, saved.fc.weight)
