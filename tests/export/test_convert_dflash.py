"""Conversion of DFlash drafts: the speculators 0.9.0 layout (no embed_tokens, no full-vocabulary lm_head, a
causality flag its own consumers read apart) and z-lab's layout (flat Qwen3 config, ``dflash_config`` with
output-of-layer ``target_layer_ids``, no embed_tokens / lm_head) become our standard DFlash directory, computing
exactly what the source draft computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from speculators.algorithms.dflash.model import DFlashDraftModel
from speculators.cli import main as cli_main
from speculators.export import ExportWarning, convert_checkpoint, detect_layout
from speculators.format import load_checkpoint, validate_checkpoint
from speculators.format.checkpoint import read_config
from speculators.format.validate import errors
from speculators.verifier import LM_HEAD_NAMES, VERIFIER_EMBEDDING_NAMES, read_verifier_tensors
from tests.support.dflash import build_dflash_draft, context_logits, speculators_source, zlab_source


def logits_of(model: DFlashDraftModel, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
    aux = torch.randn(2, 9, len(config.aux_layer_ids) * config.verifier_hidden_size, generator=gen)
    return context_logits(model, aux, tokens)


@pytest.fixture(scope="module")
def verifier_weights(verifier_dir) -> dict[str, torch.Tensor]:
    return read_verifier_tensors(
        str(verifier_dir), {"embed": VERIFIER_EMBEDDING_NAMES, "head": LM_HEAD_NAMES}
    )


@pytest.fixture(scope="module")
def bidirectional(verifier_dir) -> DFlashDraftModel:
    """Full vocabulary, its lm_head the verifier's (what both source layouts hold it to be)."""
    return build_dflash_draft(verifier_dir, block_causal=False, num_layers=2, seed=5)


def convert(src: Path, out: Path, verifier_dir: Path, **kwargs: Any) -> tuple[dict, dict]:
    convert_checkpoint(src, out, verifier=str(verifier_dir), dtype="float32", **kwargs)
    assert errors(validate_checkpoint(out, read_config(verifier_dir))) == []
    return load_checkpoint(out)


def test_zlab_layout_becomes_the_standard_with_the_same_logits(
    bidirectional, verifier_dir, verifier_weights, tmp_path
):
    src = zlab_source(bidirectional, tmp_path / "zlab")
    assert detect_layout(read_config(src), {}, "src") == "dflash-zlab"
    with pytest.warns(ExportWarning) as caught:
        config, tensors = convert(src, tmp_path / "out", verifier_dir)
    messages = "\n".join(str(w.message) for w in caught)
    assert "aux layer ids [1, 3, 4] are in the output-of-layer convention" in messages
    assert (
        "copied the verifier's output head" in messages
        and "copied the verifier's input embedding" in messages
    )
    assert config["speculators_model_type"] == "dflash" and "dflash_config" not in config
    assert config["aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["block_size"] == 4 and config["mask_token_id"] == bidirectional.config.mask_token_id
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert (
        config["sliding_window_non_causal"] is True
        and "layer_types" not in config["transformer_layer_config"]
    )
    assert torch.equal(tensors["embed_tokens.weight"], verifier_weights["embed"].float())
    assert torch.equal(tensors["lm_head.weight"], verifier_weights["head"].float())
    converted = DFlashDraftModel.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(logits_of(converted), logits_of(bidirectional), rtol=0, atol=0)


def test_zlab_sliding_layers_stay_causal_with_their_window(verifier_dir, tmp_path):
    model = build_dflash_draft(verifier_dir, block_causal=True, seed=6)
    src = zlab_source(model, tmp_path / "zlab", layer_types=["sliding_attention"], sliding_window=4096)
    config, _ = convert(src, tmp_path / "out", verifier_dir)
    layer = config["transformer_layer_config"]
    assert config["sliding_window_non_causal"] is False
    assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == 4096
    converted = DFlashDraftModel.from_pretrained(tmp_path / "out")
    assert converted.config.block_causal
    torch.testing.assert_close(logits_of(converted), logits_of(model), rtol=0, atol=0)


def test_zlab_mixed_layer_types_are_refused(bidirectional, verifier_dir, tmp_path):
    src = zlab_source(
        bidirectional,
        tmp_path / "zlab",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=64,
    )
    with pytest.raises(ValueError, match="mixes sliding and full attention"):
        convert_checkpoint(src, tmp_path / "out", verifier=str(verifier_dir))
    assert not (tmp_path / "out").exists()


def test_zlab_model_prefixed_names_are_stripped(bidirectional, verifier_dir, tmp_path):
    src = zlab_source(bidirectional, tmp_path / "zlab")
    from safetensors.torch import load_file

    weights = load_file(str(src / "model.safetensors"))
    save_file({"model." + k: v for k, v in weights.items()}, str(src / "model.safetensors"))
    with pytest.warns(ExportWarning, match="stripped the prefix 'model.'"):
        _, tensors = convert(src, tmp_path / "out", verifier_dir)
    assert set(tensors) == set(bidirectional.export_state_dict()) - {"d2t", "t2d"}


def test_speculators_full_vocab_gets_embedding_head_and_the_flag_its_training_meant(
    bidirectional, verifier_dir, verifier_weights, tmp_path
):
    """speculators 0.9.0 writes sliding_window_non_causal false for full-attention layers it trains (and runs)
    bidirectionally; vLLM would run that causally, so the converter writes true."""
    src = speculators_source(bidirectional, tmp_path / "speculators", non_causal_flag=False)
    assert detect_layout(read_config(src), {}, "src") == "speculators"
    with pytest.warns(ExportWarning, match="trains those bidirectionally but vLLM would run them causally"):
        config, tensors = convert(src, tmp_path / "out", verifier_dir)
    assert config["sliding_window_non_causal"] is True
    assert torch.equal(tensors["lm_head.weight"], verifier_weights["head"].float())
    assert torch.equal(tensors["embed_tokens.weight"], verifier_weights["embed"].float())
    converted = DFlashDraftModel.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(logits_of(converted), logits_of(bidirectional), rtol=0, atol=0)


def test_speculators_reduced_vocab_keeps_its_head_and_mapping(verifier_dir, verifier_weights, tmp_path):
    model = build_dflash_draft(verifier_dir, draft_vocab_size=512, block_causal=True, seed=7)
    src = speculators_source(model, tmp_path / "speculators", non_causal_flag=False)
    config, tensors = convert(src, tmp_path / "out", verifier_dir)
    assert config["draft_vocab_size"] == 512 and config["sliding_window_non_causal"] is False
    for name in ("lm_head.weight", "d2t", "t2d"):
        assert torch.equal(tensors[name], model.export_state_dict(torch.float32)[name]), name
    assert torch.equal(tensors["embed_tokens.weight"], verifier_weights["embed"].float())


def test_speculators_reduced_vocab_without_its_head_is_refused(verifier_dir, tmp_path):
    model = build_dflash_draft(verifier_dir, draft_vocab_size=512, seed=8)
    src = speculators_source(model, tmp_path / "speculators", non_causal_flag=False)
    from safetensors.torch import load_file

    weights = load_file(str(src / "model.safetensors"))
    weights.pop("lm_head.weight")
    save_file(weights, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="needs the draft's own lm_head.weight"):
        convert_checkpoint(src, tmp_path / "out", verifier=str(verifier_dir))


def test_cli_converts_a_zlab_draft(bidirectional, verifier_dir, tmp_path, capsys):
    src = zlab_source(bidirectional, tmp_path / "zlab")
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--verifier", str(verifier_dir)]) == 0
    assert "(dflash-zlab)" in capsys.readouterr().out
    assert cli_main(["validate", str(tmp_path / "out")]) == 0
