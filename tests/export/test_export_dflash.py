"""Export of DFlash drafts: a trainer run (the trainer's checkpoint contract: ``step-N/draft`` written by the
draft's ``save_pretrained``, possibly with a training wrapper's ``draft.`` prefix) → the standard DFlash directory
that vLLM 0.32 and speculators 0.9.0 read: their config keys, unprefixed names, embed_tokens and lm_head always,
d2t/t2d exactly when the draft vocabulary is reduced."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators import algorithms
from speculators.algorithms.dflash.model import DFlashDraftModel
from speculators.cli import main as cli_main
from speculators.export import ExportWarning, export_checkpoint
from speculators.format import load_checkpoint, validate_checkpoint
from speculators.format.checkpoint import read_config
from speculators.format.validate import errors
from tests.export.conftest import make_run
from tests.support.dflash import build_dflash_draft, context_logits


@pytest.fixture(scope="module")
def reduced(verifier_dir) -> DFlashDraftModel:
    return build_dflash_draft(verifier_dir, draft_vocab_size=512, block_causal=False, seed=3)


@pytest.fixture(scope="module")
def full_vocab(verifier_dir) -> DFlashDraftModel:
    return build_dflash_draft(verifier_dir, block_causal=True, seed=4)


def run_of(root: Path, verifier_dir: Path, model: DFlashDraftModel, tokens: int = 3) -> Path:
    return make_run(
        root, str(verifier_dir), {10: model}, best_step=10, speculative_tokens=tokens
    )  # a recipe's export.speculative_tokens


def aux_and_tokens(model: DFlashDraftModel, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
    aux = torch.randn(2, 9, len(config.aux_layer_ids) * config.verifier_hidden_size, generator=gen)
    return aux, tokens


def test_reduced_vocab_export_holds_what_the_consumers_read(reduced, verifier_dir, tmp_path):
    out = tmp_path / "dflash"
    result = export_checkpoint(run_of(tmp_path / "run", verifier_dir, reduced), out)
    config, tensors = load_checkpoint(out)
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
    for key, value in {
        "aux_hidden_state_layer_ids": [2, 4, 5],
        "mask_token_id": reduced.config.vocab_size - 1,
        "block_size": 4,
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "draft_vocab_size": 512,
        "torch_dtype": "bfloat16",
    }.items():
        assert config[key] == value, key
    assert "eagle_aux_hidden_state_layer_ids" not in config and "norm_before_residual" not in config
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    assert config["speculators_config"]["algorithm"] == "dflash"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    expected = reduced.export_state_dict(torch.bfloat16)
    assert set(tensors) == set(expected)
    assert {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d", "hidden_norm.weight"} <= set(tensors)
    for name, tensor in tensors.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert errors(validate_checkpoint(out, read_config(verifier_dir))) == []
    assert result.findings == []
    card = (out / "README.md").read_text()
    assert "A DFlash speculative-decoding draft" in card and '"method": "dflash"' in card
    assert "| block_size | 4 |" in card


def test_full_vocab_export_has_no_vocab_mapping_and_reloads_with_the_same_logits(
    full_vocab, verifier_dir, tmp_path
):
    out = tmp_path / "dflash-full"
    export_checkpoint(run_of(tmp_path / "run", verifier_dir, full_vocab), out)
    config, tensors = load_checkpoint(out)
    assert "d2t" not in tensors and "t2d" not in tensors
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(tensors)
    assert config["transformer_layer_config"]["layer_types"] == ["sliding_attention"]
    assert config["sliding_window_non_causal"] is False
    aux, tokens = aux_and_tokens(full_vocab)
    reloaded = DFlashDraftModel.from_pretrained(out, dtype=torch.bfloat16)
    assert torch.equal(
        context_logits(reloaded, aux, tokens),
        context_logits(copy.deepcopy(full_vocab).bfloat16(), aux, tokens),
    )


def test_wrapped_trainer_names_are_stripped(reduced, verifier_dir, tmp_path):
    """A training wrapper holding the draft as ``draft`` (as EAGLE-3's TTTDraft does) prefixes every name."""
    run = run_of(tmp_path / "run", verifier_dir, reduced)
    weights = run / "checkpoints" / "step-10" / "draft" / "model.safetensors"
    save_file({"draft." + k: v for k, v in load_file(str(weights)).items()}, str(weights))
    with pytest.warns(ExportWarning, match="stripped the prefix 'draft.'"):
        export_checkpoint(run, tmp_path / "out")
    _, tensors = load_checkpoint(tmp_path / "out")
    assert set(tensors) == set(reduced.export_state_dict())


def test_speculative_tokens_beyond_the_block_are_refused(reduced, verifier_dir, tmp_path, capsys):
    run = run_of(tmp_path / "run", verifier_dir, reduced, tokens=5)
    assert cli_main(["export", str(run), str(tmp_path / "out")]) == 1
    assert "speculative_tokens 5 must be in [1, 3] for block_size 4" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_shorter_bidirectional_block_exports_with_a_warning(reduced, verifier_dir, tmp_path):
    result = export_checkpoint(
        run_of(tmp_path / "run", verifier_dir, reduced), tmp_path / "out", speculative_tokens=2
    )
    assert [f.severity for f in result.findings] == ["warning"]
    assert "vLLM runs a block of 3 slots" in result.findings[0].message


def test_zero_shards_without_any_draft_config_are_explained(reduced, verifier_dir, tmp_path):
    from speculators.export.exporter import infer_draft_config

    tensors = {"draft." + k: v for k, v in reduced.export_state_dict().items()}
    recipe = {"train": {"algorithm": "dflash"}}  # the run's recorded algorithm names the unit
    with pytest.raises(ValueError, match="DFlash draft, whose config cannot be rebuilt"):
        infer_draft_config(tensors, read_config(verifier_dir), str(verifier_dir), recipe)


def test_a_checkpoint_without_embed_tokens_takes_the_verifiers_as_the_consumers_do(
    full_vocab, verifier_dir, tmp_path
):
    """speculators 0.9.0 saves no ``embed_tokens`` for DFlash and rebuilds it from the verifier on load (vLLM shares
    the target's): such a checkpoint validates, and our loader takes the verifier's embedding, giving the draft's
    logits. EAGLE-3 keeps the rule that it must be written (older speculators releases loaded garbage)."""
    out = tmp_path / "dflash-full"
    export_checkpoint(run_of(tmp_path / "run", verifier_dir, full_vocab), out)
    tensors = load_file(out / "model.safetensors")
    del tensors["embed_tokens.weight"]
    save_file(tensors, out / "model.safetensors")
    assert not errors(validate_checkpoint(out))
    aux, tokens = aux_and_tokens(full_vocab)
    reloaded = algorithms.load_draft(out, dtype=torch.bfloat16)
    assert torch.equal(
        context_logits(reloaded, aux, tokens),
        context_logits(copy.deepcopy(full_vocab).bfloat16(), aux, tokens),
    )
    config = read_config(out)
    config["speculators_config"]["verifier"]["name_or_path"] = str(tmp_path / "no-such-verifier")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="stores no embed_tokens.weight and its verifier"):
        algorithms.load_draft(out)
