"""Round trip: a draft built for SmolLM2 saves under the standard names and reloads tensor-for-tensor."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.algorithms.eagle3.rules import expected_shapes
from speculators.format import load_checkpoint, validate_checkpoint
from speculators.format.checkpoint import read_config
from speculators.format.validate import errors
from speculators.vocab import build_draft_vocab


def build_draft(verifier_dir, draft_vocab_size: int = 1024, seed: int = 0, **kwargs) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    verifier = read_config(verifier_dir)
    config = Eagle3Config.from_verifier(
        verifier, str(verifier_dir), draft_vocab_size=draft_vocab_size, **kwargs
    )
    model = Eagle3DraftModel(config)
    counts = torch.randint(0, 1000, (config.vocab_size,))
    vocab = build_draft_vocab(counts, draft_vocab_size)
    model.set_vocab(vocab.d2t, vocab.t2d)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_draft_round_trip(smollm2_dir, tmp_path, dtype):
    model = build_draft(smollm2_dir)
    out = model.save_pretrained(tmp_path / "draft", dtype=dtype)
    config, tensors = load_checkpoint(out)

    assert "model_type" not in config
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(smollm2_dir)
    assert config["transformer_layer_config"]["vocab_size"] == 49152
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # [2, L//2, L-3] for L = 30
    assert set(tensors) == set(expected_shapes(config))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].dtype == dtype
    assert not any(name.startswith("model.") for name in tensors)

    reloaded = Eagle3DraftModel.from_pretrained(out, dtype=dtype)
    original = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    assert errors(validate_checkpoint(out)) == []


def test_round_trip_keeps_unknown_config_keys(smollm2_dir, tmp_path):
    model = build_draft(smollm2_dir)
    model.config.extra["producer_note"] = {"kept": True}
    out = model.save_pretrained(tmp_path / "draft")
    assert json.loads((out / "config.json").read_text())["producer_note"] == {"kept": True}
    assert Eagle3Config.load(out).extra["producer_note"] == {"kept": True}


def test_qwen3_draft_has_qk_norms_and_round_trips(tiny_qwen3_dir, tmp_path):
    model = build_draft(tiny_qwen3_dir, draft_vocab_size=512)
    assert model.config.layer_type == "qwen3"
    out = model.save_pretrained(tmp_path / "qwen3-draft", dtype=torch.float32)
    _, tensors = load_checkpoint(out)
    assert "layers.0.self_attn.q_norm.weight" in tensors
    assert errors(validate_checkpoint(out)) == []
    reloaded = Eagle3DraftModel.from_pretrained(out)
    ids = torch.randint(0, 1000, (1, 6))
    feats = torch.randn(1, 6, 3 * model.config.hidden_size)
    pos = torch.arange(6)[None]
    with torch.no_grad():
        a = model(ids, model.project_features(feats), pos)[0]
        b = reloaded(ids, reloaded.project_features(feats), pos)[0]
    assert torch.equal(a, b)


def test_from_verifier_copies_rope_scaling():
    verifier = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    config = Eagle3Config.from_verifier(verifier, "meta-llama/Llama-3.1-8B-Instruct", draft_vocab_size=256)
    layer = config.transformer_layer_config
    assert layer["rope_scaling"]["rope_type"] == "llama3" and layer["rope_theta"] == 500000.0
    assert config.eagle_aux_hidden_state_layer_ids == [2, 16, 29]
    assert layer["model_type"] == "llama" and config.norm_before_residual is True
    # The draft's rotary embedding must be the verifier's (llama3-scaled), not plain rope.
    model = Eagle3DraftModel(config)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    reference = LlamaRotaryEmbedding(
        LlamaConfig(**{k: v for k, v in verifier.items() if k != "architectures"})
    )
    assert torch.allclose(model.rotary_emb.inv_freq, reference.inv_freq)


@pytest.mark.parametrize(
    ("layers", "expected"),
    [(32, [2, 16, 29]), (30, [2, 15, 27]), (8, [2, 4, 5]), (6, [1, 3, 5]), (4, [1, 2, 3])],
)
def test_default_aux_ids_are_distinct_and_ascending(layers, expected):
    from speculators.format.config import default_aux_layer_ids

    assert default_aux_layer_ids(layers) == expected
