"""Each family's declarations hold on a real (tiny) model of it: the stack, layers and final norm are where it
says; aux id 0 is the embedding times its declared scale; the last pre-norm state through the final norm, the
lm_head and the family's logit transform gives the model's own logits; configs are read through text_config."""

from __future__ import annotations

import json

import pytest
import torch

from data_gen.capture import FeatureCapture
from speculators import draft_layer_types, families
from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.verifier import load_verifier, verifier_config_dict
from tests.support.families import TINY_FAMILIES
from train.targets import TargetHead

NAMES = sorted(TINY_FAMILIES)


def test_registry_and_shipped_configs():
    from tests.support.families import shipped_config

    for name in families.names():
        family = families.get(name)
        shipped = shipped_config(family)
        assert shipped["model_type"] == name
        assert family.num_layers(shipped) == int(family.text_config(shipped)["num_hidden_layers"])
        assert draft_layer_types.is_known(family.draft_layer_type)
    assert families.get("gemma4_text") is families.get("gemma4")
    undeclared = families.of_config({"model_type": "phi3"})
    assert not undeclared.declared and undeclared.stack_path == ("model",)
    with pytest.raises(ValueError, match="no declared family"):
        families.get("phi3")


@pytest.mark.parametrize("name", NAMES)
def test_declared_layout_embedding_scale_and_head(family_verifier, name):
    directory = family_verifier(name)
    family = families.get(name)
    model, tokenizer = load_verifier(str(directory), "float32")
    assert families.of_model(model) is family
    assert len(family.layers(model)) == 8
    flat = verifier_config_dict(str(directory))
    assert flat["model_type"] == name and flat["num_hidden_layers"] == 8 and flat["hidden_size"] == 64
    ids = torch.tensor([tokenizer("The capital of France is Paris.")["input_ids"]])
    capture = FeatureCapture(model, [0, 4, 8])
    out = capture.capture(ids)
    stack = family.stack(model)
    scale = family.embedding_scale(flat)
    embedding = stack.embed_tokens.weight[ids[0]] if hasattr(stack.embed_tokens, "weight") else None
    # aux id 0 is the embedding entering layer 0: the raw row times the family's declared scale
    torch.testing.assert_close(out["aux_hidden"][0, :, :64], embedding * scale, rtol=1e-5, atol=1e-5)
    # the family's head: final norm (+ offset), lm_head, logit transform == the model's own logits
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    head = TargetHead.from_model(model, torch.arange(flat["vocab_size"]))
    torch.testing.assert_close(head.draft_logits(out["last_hidden"]), logits, rtol=1e-4, atol=1e-4)
    files_head = TargetHead.from_verifier_files(
        str(directory), json.loads((directory / "config.json").read_text()), torch.arange(flat["vocab_size"])
    )
    torch.testing.assert_close(files_head.draft_logits(out["last_hidden"]), logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_draft_config_is_read_through_the_family(family_verifier, name):
    directory = family_verifier(name)
    raw = json.loads((directory / "config.json").read_text())
    config = Eagle3Config.from_verifier(raw, str(directory))
    family = families.get(name)
    layer = config.transformer_layer_config
    assert layer["model_type"] == family.draft_layer_type
    assert layer["hidden_size"] == 64 and layer["vocab_size"] == 512
    assert config.eagle_aux_hidden_state_layer_ids == family.default_aux_layer_ids(raw) == [2, 4, 5]
    assert isinstance(layer["rope_theta"], float | int)
