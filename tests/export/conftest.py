"""Builders for the export tests: drafts, trainer-style run directories (following the trainer's checkpoint
contract), and small checkpoints in each foreign layout with real names and random weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file

from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.format.checkpoint import read_config
from speculators.vocab import build_draft_vocab
from tests.support.verifiers import build_tiny_verifier

DRAFT_VOCAB = 512


def build_draft(
    verifier_dir: Path,
    draft_vocab_size: int = DRAFT_VOCAB,
    seed: int = 0,
    keep_token: int | None = None,
    drop_token: int | None = None,
    **kwargs: Any,
) -> Eagle3DraftModel:
    """A random fp32 draft for ``verifier_dir`` (norm weights random too, not the init ones) whose draft
    vocabulary surely keeps ``keep_token`` / surely leaves out ``drop_token``."""
    torch.manual_seed(seed)
    verifier = read_config(verifier_dir)
    config = Eagle3Config.from_verifier(
        verifier, str(verifier_dir), draft_vocab_size=draft_vocab_size, **kwargs
    )
    model = Eagle3DraftModel(config)
    counts = torch.randint(1, 1000, (config.vocab_size,))
    if keep_token is not None:
        counts[keep_token] = 10**6
    if drop_token is not None:
        counts[drop_token] = 0  # every other id was seen, so the unseen one is never padded back in
    vocab = build_draft_vocab(counts, draft_vocab_size)
    model.set_vocab(vocab.d2t, vocab.t2d)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def make_run(
    root: Path,
    verifier_ref: str,
    drafts: dict[int, Eagle3DraftModel | None],
    best_step: int | None = None,
    best_path: str | None = None,
    speculative_tokens: int = 4,
    extra_recipe: dict[str, Any] | None = None,
) -> Path:
    """A run directory by the trainer's contract: config.yaml, metrics.jsonl, checkpoints/step-<N>/{draft/,
    trainer_state.json} (a None draft makes a step with only state/, filled by the caller) and best.json."""
    recipe = {
        "recipe_name": "eagle3_test",
        "seed": 0,
        "verifier": {"name_or_path": verifier_ref, "dtype": "auto", "aux_layer_ids": None},
        "data": {"name": "sharegpt_builtin", "max_samples": 64},
        "export": {"speculative_tokens": speculative_tokens},
        **(extra_recipe or {}),
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    records = [
        {"step": s, "loss": 3.0 / (1 + s), "timestamp": 1_700_000_000 + 6 * s} for s in range(0, 41, 10)
    ]
    (root / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    for step, model in drafts.items():
        step_dir = root / "checkpoints" / f"step-{step}"
        step_dir.mkdir(parents=True, exist_ok=True)
        if model is not None:
            model.save_pretrained(step_dir / "draft", dtype=torch.float32)
        (step_dir / "trainer_state.json").write_text(
            json.dumps({"step": step, "epoch": 1.0, "elapsed_seconds": 240})
        )
    if best_step is not None:
        path = best_path if best_path is not None else f"checkpoints/step-{best_step}"
        best = {"step": best_step, "path": path, "acceptance_length": 1.75}
        (root / "checkpoints" / "best.json").write_text(json.dumps(best))
    return root


def state_dict_of(model: Eagle3DraftModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "rotary_emb" not in k}


def draft_logits(model: Eagle3DraftModel, seed: int = 1) -> torch.Tensor:
    """Logits of two drafting steps on fixed random inputs (exercises fc, layer 0, norms, lm_head, recurrence)."""
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    n_aux = len(config.eagle_aux_hidden_state_layer_ids)
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=gen)
    aux = torch.randn(2, 7, n_aux * config.verifier_hidden_size, generator=gen)
    positions = torch.arange(7)[None].expand(2, 7)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        logits, hidden = model(ids, model.project_features(aux.to(dtype)), positions)
        logits2, _ = model(ids, hidden, positions)
    return torch.cat([logits, logits2], dim=-1)


# ---- foreign layouts ---------------------------------------------------------------------------------------
def flat_llama_config(model: Eagle3DraftModel, architectures: list[str], **extra: Any) -> dict[str, Any]:
    """The flat Llama config.json EAGLE-3 (SafeAILab) and SpecForge ship with a draft."""
    layer = model.config.transformer_layer_config
    return {
        "architectures": architectures,
        "bos_token_id": layer.get("bos_token_id", 1),
        "eos_token_id": layer.get("eos_token_id", 2),
        "hidden_act": "silu",
        "hidden_size": layer["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": layer["intermediate_size"],
        "max_position_embeddings": 256,  # smaller than the verifier's, as the released EAGLE-3 config is
        "model_type": "llama",
        "num_attention_heads": layer["num_attention_heads"],
        "num_key_value_heads": layer["num_key_value_heads"],
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": layer["rms_norm_eps"],
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": layer["vocab_size"],
        "draft_vocab_size": model.config.draft_vocab_size,
        **extra,
    }


def midlayer_tensors(model: Eagle3DraftModel, with_embed: bool) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, tensor in state_dict_of(model).items():
        if name == "embed_tokens.weight" and not with_embed:
            continue
        tensors[name.replace("layers.0.", "midlayer.")] = tensor.contiguous()
    return tensors


def write_eagle3_original(directory: Path, model: Eagle3DraftModel, as_bin: bool = True) -> Path:
    """SafeAILab/EAGLE's EAGLE-3 layout: flat config, midlayer.* names, no embed_tokens, pytorch_model.bin."""
    directory.mkdir(parents=True)
    config = flat_llama_config(model, ["LlamaForCausalLM"])
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tensors = midlayer_tensors(model, with_embed=False)
    if as_bin:
        torch.save(tensors, directory / "pytorch_model.bin")
    else:
        save_file(tensors, str(directory / "model.safetensors"))
    return directory


def write_specforge(directory: Path, model: Eagle3DraftModel, aux_ids: list[int] | None = None) -> Path:
    """SpecForge's export: LlamaForCausalLMEagle3 flat config (aux ids, when set, under eagle_config in the
    output-of-layer convention), model.safetensors with midlayer.* names and no embed_tokens."""
    directory.mkdir(parents=True)
    extra: dict[str, Any] = {"rope_scaling": None, "rope_theta": 10000.0, "attention_bias": False}
    if aux_ids is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    config = flat_llama_config(model, ["LlamaForCausalLMEagle3"], **extra)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(midlayer_tensors(model, with_embed=False), str(directory / "model.safetensors"))
    return directory


# Every test verifier has 8 layers (distinct default aux ids [2, 4, 5]: vLLM collapses repeated ids, which the
# 6-layer shared fixtures would give) and heads of 32 (vLLM's CPU attention has no head size 16).
SERVABLE_SHAPE = {"num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="session")
def verifier_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random 8-layer Llama verifier with SmolLM2's tokenizer (vocab 49152, hidden 64)."""
    return build_tiny_verifier(
        tmp_path_factory.mktemp("verifiers") / "llama8",
        tokenizer=smollm2_tokenizer,
        vocab_size=len(smollm2_tokenizer),
        **SERVABLE_SHAPE,
    )


@pytest.fixture(scope="session")
def small_verifier_dir(tmp_path_factory) -> Path:
    """A 1000-token 8-layer verifier without a tokenizer, for tests that never tokenize."""
    return build_tiny_verifier(
        tmp_path_factory.mktemp("verifiers") / "small-llama8", vocab_size=1000, **SERVABLE_SHAPE
    )
