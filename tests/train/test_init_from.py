"""train.init_from (HASS stage 2, or P-EAGLE from an EAGLE-3 run) meets a first stage: a draft vocabulary built for
another tokenizer or size is refused before any weight is loaded (DraftVocab.check_compatible), one built for this run
is accepted; P-EAGLE loads every tensor it shares with an EAGLE-3 draft and starts mask_hidden fresh, and a shape that
does not fit is refused naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.algorithms.eagle3.model import Eagle3DraftModel
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


# ---- P-EAGLE from an EAGLE-3 run -----------------------------------------------------------------------------
def test_an_eagle3_draft_with_other_aux_layers_is_refused_naming_the_tensor(first_stage):
    """P-EAGLE reading three aux layers cannot start from an EAGLE-3 draft that read two: one error names the
    weight file, the tensor and the fix, before anything is loaded."""
    from speculators.algorithms.peagle.config import PEagleConfig
    from speculators.algorithms.peagle.model import PEagleDraftModel

    vocab = vocab_for(TOKENIZER)
    two_aux = Eagle3Config.from_verifier(
        tiny_verifier_config("llama", vocab_size=128).to_dict(),
        "tiny",
        draft_vocab_size=32,
        aux_layer_ids=[2, 5],
    )
    other = Eagle3DraftModel(two_aux)
    other.set_vocab(vocab.d2t, vocab.t2d)
    other.save_pretrained(first_stage / "checkpoints" / "step-5" / "draft", dtype=torch.float32)
    config = PEagleConfig.from_verifier(
        tiny_verifier_config("llama", vocab_size=128).to_dict(), "tiny", mask_token_id=3, draft_vocab_size=32
    )
    draft = PEagleDraftModel(config)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    before = draft.fc.weight.clone()
    with pytest.raises(
        ValueError, match=r"fc\.weight in .*model\.safetensors has shape \[64, 128\].*needs \[64, 192\]"
    ):
        init_from_checkpoint(draft, first_stage, vocab)
    assert torch.equal(draft.fc.weight, before)


@pytest.fixture(scope="module")
def eagle3_run(sharp_verifier, tiny_data, tmp_path_factory) -> Path:
    """A two-step EAGLE-3 run of the tiny recipe: the first stage."""
    from tests.train.conftest import compose, tiny_overrides
    from train.trainer import train

    run_dir = tmp_path_factory.mktemp("eagle3") / "run"
    train(compose(tiny_overrides(sharp_verifier, tiny_data, run_dir, "train.max_steps=2")), run_dir)
    return run_dir


def test_peagle_starts_from_an_eagle3_run(eagle3_run, sharp_verifier, tiny_data, tmp_path, capsys):
    """Every tensor P-EAGLE shares with the EAGLE-3 run is the run's at step 0; mask_hidden, P-EAGLE's own, is
    what a fresh P-EAGLE run starts with; the run says which were loaded and which were new."""
    from speculators.algorithms.peagle.model import PEagleDraftModel
    from speculators.runs import INIT_FROM_NAME, resolve_draft_dir
    from tests.train.conftest import compose, tiny_overrides
    from train.trainer import Trainer

    overrides = tiny_overrides(
        sharp_verifier, tiny_data, tmp_path / "peagle", "train.max_steps=1", f"train.init_from={eagle3_run}"
    )
    overrides[0] = "recipe=tiny_peagle"
    trainer = Trainer(compose(overrides), tmp_path / "peagle")
    try:
        draft = next(m for m in trainer.model.modules() if isinstance(m, PEagleDraftModel))
        first = Eagle3DraftModel.from_pretrained(resolve_draft_dir(eagle3_run)).state_dict()
        step0 = draft.state_dict()
        assert set(step0) - set(first) == {"mask_hidden"}
        for name, tensor in first.items():
            assert torch.equal(step0[name], tensor), name
        torch.manual_seed(trainer.settings.seed)  # what build_draft does before a fresh draft
        assert torch.equal(draft.mask_hidden, PEagleDraftModel(trainer.draft_config).mask_hidden)
        trainer.fit()
    finally:
        trainer.close()
    assert "train.init_from: loaded" in capsys.readouterr().out
    record = json.loads((tmp_path / "peagle" / INIT_FROM_NAME).read_text())
    assert record["source_type"] == "eagle3" and record["new"] == ["mask_hidden"] and record["ignored"] == []
    assert "fc.weight" in record["loaded"] and "layers.0.self_attn.q_proj.weight" in record["loaded"]
