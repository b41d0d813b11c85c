"""The validator, the converter and the engine read a verifier through its family: a wrapper's text_config gives
the hidden size, vocabulary and layer count the cross-checks use; a SpecForge checkpoint converts against a
Gemma 4 verifier with its output-of-layer ids shifted into vLLM's convention; an undeclared model_type is named in
a warning; a sliding window is refused only when the cache could outgrow it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.decoding.engine import DecodingConfig, check_supported, plain_generate
from speculators.export import convert_checkpoint
from speculators.format.validate import errors, validate_checkpoint
from speculators.verifier import load_verifier
from tests.export.conftest import write_specforge

pytestmark = pytest.mark.filterwarnings("ignore::speculators.export.ExportWarning")


@pytest.fixture(scope="module")
def gemma4_draft(family_verifier, tmp_path_factory):
    """A random EAGLE-3 draft for the tiny Gemma 4 verifier: (model, its directory, the verifier's raw config)."""
    verifier = family_verifier("gemma4")
    raw = json.loads((verifier / "config.json").read_text())
    torch.manual_seed(0)
    model = Eagle3DraftModel(Eagle3Config.from_verifier(raw, str(verifier), torch_dtype="float32"))
    directory = model.save_pretrained(tmp_path_factory.mktemp("gemma4-draft") / "draft", dtype=torch.float32)
    return model, directory, raw


def messages(findings) -> str:
    return "\n".join(str(f) for f in findings)


def test_validator_cross_checks_a_wrapper_through_its_text_config(gemma4_draft):
    _, directory, raw = gemma4_draft
    assert "text_config" in raw and "hidden_size" not in raw  # nothing to read at the top level
    assert errors(validate_checkpoint(directory, raw)) == []
    narrow = copy.deepcopy(raw)
    narrow["text_config"]["hidden_size"] = 128
    assert "the draft must be as wide as the verifier" in messages(
        errors(validate_checkpoint(directory, narrow))
    )
    shallow = copy.deepcopy(raw)
    shallow["text_config"]["num_hidden_layers"] = 4  # ids [2, 4, 5]: 5 is beyond a 4-layer verifier
    assert "outside [0, 4]" in messages(errors(validate_checkpoint(directory, shallow)))
    other_vocab = copy.deepcopy(raw)
    other_vocab["text_config"]["vocab_size"] = 1024
    assert "verifier's vocab_size 1024" in messages(errors(validate_checkpoint(directory, other_vocab)))


def test_an_undeclared_family_is_named_in_a_warning(gemma4_draft):
    _, directory, raw = gemma4_draft
    text = dict(raw["text_config"], model_type="phi3")  # a flat config of a model_type no module declares
    findings = validate_checkpoint(directory, text)
    assert errors(findings) == []
    assert "'phi3' has no declared family" in messages(findings)


def test_specforge_converts_against_a_gemma4_verifier(gemma4_draft, family_verifier, tmp_path):
    model, _, raw = gemma4_draft
    source = write_specforge(tmp_path / "specforge", model, aux_ids=[1, 3, 4])  # output-of-layer convention
    out = tmp_path / "converted"
    result = convert_checkpoint(source, out, verifier=str(family_verifier("gemma4")), dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["transformer_layer_config"]["hidden_size"] == raw["text_config"]["hidden_size"]
    assert config["speculators_config"]["verifier"]["architectures"] == ["Gemma4ForConditionalGeneration"]
    assert errors(result.findings) == []
    converted = Eagle3DraftModel.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, tensor in model.state_dict().items():
        if name != "embed_tokens.weight" and not name.startswith(("d2t", "t2d")):
            torch.testing.assert_close(converted[name], tensor, msg=name)
    # SpecForge ships no embedding: the converter copies the verifier's, found under the wrapper's prefix
    weights = load_file(str(family_verifier("gemma4") / "model.safetensors"))
    torch.testing.assert_close(
        converted["embed_tokens.weight"], weights["model.language_model.embed_tokens.weight"]
    )


def test_sliding_window_is_refused_only_when_the_cache_can_outgrow_it(family_verifier):
    model, _ = load_verifier(str(family_verifier("gpt_oss")), "float32")  # window 512 on half the layers
    chain = DecodingConfig(num_speculative_tokens=3, max_new_tokens=64)  # 260 columns after the prompt
    check_supported(model, chain.max_cache_columns(252))  # 512: the window holds the whole cache
    with pytest.raises(ValueError, match="sliding-window attention"):
        check_supported(model, chain.max_cache_columns(253))
    with pytest.raises(ValueError, match="sliding-window attention"):
        check_supported(model)


def test_sliding_window_refusal_names_the_limit_with_this_runs_numbers(family_verifier):
    """A `speculators eval --vllm` user was told to use --vllm: the refusal names the engine's real limit instead,
    with the numbers that broke it, and what to shorten."""
    model, _ = load_verifier(str(family_verifier("gpt_oss")), "float32")
    chain = DecodingConfig(num_speculative_tokens=3, max_new_tokens=64)
    with pytest.raises(ValueError) as refused:
        check_supported(model, chain.max_cache_columns(400))
    message = str(refused.value)
    assert "prompt + (max_new_tokens + 1)·(k + 1) = 400 + (64 + 1)·(3 + 1) = 660 columns > 512" in message
    assert "--max-prompt-tokens" in message and "--max-new-tokens" in message and "--vllm" not in message
    with pytest.raises(
        ValueError, match=r"prompt \+ max_new_tokens \+ 1 = 500 \+ 20 \+ 1 = 521 columns > 512"
    ):
        plain_generate(model, [[1] * 500], max_new_tokens=20)  # the plain baseline: one column per token
