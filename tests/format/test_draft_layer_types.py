"""The draft layer types are declared once (speculators.draft_layer_types) and every reader takes them from there:
the families, the recipe settings, the config builder, the draft model, the validator's shapes and the converter."""

from __future__ import annotations

import pytest

from speculators import draft_layer_types, families
from speculators.algorithms.eagle3.rules import expected_shapes
from speculators.format.validate import decoder_layer_shapes


def test_the_registry_declares_what_vllm_builds():
    assert draft_layer_types.names() == ("llama", "qwen3")
    assert draft_layer_types.get("qwen3").vllm_class == "Eagle3Qwen3ForCausalLM"
    assert not draft_layer_types.get("llama").qk_norm and draft_layer_types.get("qwen3").qk_norm
    assert draft_layer_types.BLOCK_DRAFTER is draft_layer_types.get("qwen3")
    with pytest.raises(ValueError, match="not one vLLM builds"):
        draft_layer_types.get("mistral")


def test_families_and_settings_accept_only_declared_types():
    from train.settings import ModelSettings

    for name in families.names():
        assert draft_layer_types.is_known(families.get(name).draft_layer_type)
    with pytest.raises(ValueError, match="not one vLLM builds"):
        families.register(families.Family("x", "X", "x.json", "mistral", families.ChatFormat()))
    assert not ModelSettings(layer_type="qwen3").problems()
    assert "model.layer_type" in "\n".join(ModelSettings(layer_type="mistral").problems())


def test_validator_shapes_follow_the_declared_q_k_norm():
    layer = {"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16, "vocab_size": 32}
    for layer_type in draft_layer_types.names():
        shapes = decoder_layer_shapes(layer, "", 8, draft_layer_types.has_qk_norm(layer_type))
        assert ("self_attn.q_norm.weight" in shapes) is draft_layer_types.get(layer_type).qk_norm
        config = {"transformer_layer_config": {**layer, "model_type": layer_type}, "draft_vocab_size": 32}
        assert ("layers.0.self_attn.k_norm.weight" in expected_shapes(config)) is draft_layer_types.get(
            layer_type
        ).qk_norm


def test_a_foreign_checkpoint_is_read_by_the_declared_marker_tensors():
    with_norms = {"fc.weight", "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"}
    assert draft_layer_types.of_tensors(with_norms).name == "qwen3"
    assert draft_layer_types.of_tensors({"fc.weight", "layers.0.self_attn.q_proj.weight"}).name == "llama"
