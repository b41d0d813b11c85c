"""Builders of DFlash drafts for the format, export and consumer tests: real configs written by
``DFlashConfig.from_verifier``, random weights (norms too, so a misread norm shows), the verifier's embedding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from speculators.algorithms.dflash.config import DFlashConfig
from speculators.algorithms.dflash.model import DFlashDraftModel
from speculators.format.checkpoint import read_config
from speculators.verifier import (
    LM_HEAD_NAMES,
    VERIFIER_EMBEDDING_NAMES,
    read_verifier_tensors,
    verifier_embedding,
)
from speculators.vocab import DraftVocab, build_draft_vocab


def build_dflash_draft(
    verifier_dir: Path,
    name_or_path: str | Path | None = None,
    *,
    block_size: int = 4,
    block_causal: bool = True,
    draft_vocab_size: int | None = None,
    vocab: DraftVocab | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
    verifier_lm_head: bool = True,
    **kwargs: Any,
) -> DFlashDraftModel:
    """A random fp32 DFlash draft for ``verifier_dir`` whose ``embed_tokens`` is the verifier's embedding.

    ``vocab`` (or a random one of ``draft_vocab_size`` tokens) makes the draft vocabulary reduced; the mask token
    defaults to the verifier's last id. ``name_or_path`` is written as the verifier (default: ``verifier_dir``).
    A full-vocabulary draft gets the verifier's lm_head unless ``verifier_lm_head`` is false (speculators 0.9.0
    replaces a full-vocabulary DFlash head with the verifier's on load, so only that head means the same to both
    consumers)."""
    torch.manual_seed(seed)
    verifier = read_config(verifier_dir)
    vocab_size = int(verifier["vocab_size"])
    if vocab is None and draft_vocab_size is not None and draft_vocab_size != vocab_size:
        vocab = build_draft_vocab(torch.randint(1, 1000, (vocab_size,)), draft_vocab_size)
    config = DFlashConfig.from_verifier(
        verifier,
        str(name_or_path or verifier_dir),
        mask_token_id=vocab_size - 1 if mask_token_id is None else mask_token_id,
        mask_token_source="the verifier's last id (tests)",
        draft_vocab_size=int(vocab.d2t.shape[0]) if vocab is not None else None,
        block_size=block_size,
        block_causal=block_causal,
        **kwargs,
    )
    model = DFlashDraftModel(config)
    if vocab is not None:
        model.set_vocab(vocab.d2t, vocab.t2d)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(verifier_embedding(verifier_dir).float())
        if vocab is None and verifier_lm_head:  # what speculators 0.9.0 holds a full-vocabulary head to be
            found = read_verifier_tensors(
                str(verifier_dir), {"embed": VERIFIER_EMBEDDING_NAMES, "head": LM_HEAD_NAMES}
            )
            model.lm_head.weight.copy_(found.get("head", found["embed"]).float())
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def context_hidden(model: DFlashDraftModel, aux: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The normed final hidden states ``[B, block, H]`` of one block anchored at the last of ``tokens [B, T]``, with
    the context features of positions ``0..T-2`` (``aux [B, T, n_aux * H]``: the verifier's aux states of every
    position; the anchor's own features are not context, as in vLLM, which stores them only after the step)."""
    from speculators.algorithms.dflash.model import block_attention

    batch, length = tokens.shape
    dtype = model.fc.weight.dtype
    context = model.project_context(aux[:, : length - 1].to(dtype))
    positions = torch.arange(length - 1)[None].expand(batch, -1)
    kv = model.context_kv(context, positions)
    ids, block_positions = model.block_inputs(tokens[:, -1], torch.full((batch,), length - 1))
    visible = torch.ones(batch, model.config.block_size, length - 1, dtype=torch.bool)

    def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ck, cv = kv[layer_idx]
        return block_attention(q, k, v, ck, cv, visible, causal=model.config.block_causal)

    with torch.no_grad():
        return model.block_hidden(ids, block_positions, attend)


def context_logits(model: DFlashDraftModel, aux: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Draft logits ``[B, block, draft V]`` of the block of :func:`context_hidden`."""
    with torch.no_grad():
        return model.slot_logits(context_hidden(model, aux, tokens))


# ---- other producers' layouts (facts from their code: docs/format.md, speculators/algorithms/dflash/convert.py) ----
ZLAB_LAYER_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "hidden_act",
    "max_position_embeddings",
    "rope_theta",
    "attention_bias",
    "num_hidden_layers",
)


def write_source(directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def speculators_source(model: DFlashDraftModel, directory: Path, non_causal_flag: bool) -> Path:
    """What speculators 0.9.0 saves: our keys, no embed_tokens, lm_head only for a reduced draft vocabulary."""
    config = model.config.to_dict()
    config.pop("mask_token_source")
    config["speculators_version"] = "0.9.0"
    config["sliding_window_non_causal"] = non_causal_flag
    if "layer_types" not in config["transformer_layer_config"]:
        config["transformer_layer_config"]["layer_types"] = ["full_attention"] * model.config.num_layers
    tensors = model.export_state_dict(torch.float32)
    tensors.pop("embed_tokens.weight")
    if model.config.draft_vocab_size == model.config.vocab_size:
        tensors.pop("lm_head.weight")
    return write_source(directory, config, tensors)


def zlab_source(model: DFlashDraftModel, directory: Path, **changes: Any) -> Path:
    """z-lab's layout: a flat Qwen3 config, dflash_config with target_layer_ids = aux ids - 1, the draft body only."""
    layer = model.config.transformer_layer_config
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        **{key: layer[key] for key in ZLAB_LAYER_KEYS if key in layer},
        "layer_types": ["full_attention"] * model.config.num_layers,
        "block_size": model.config.block_size,
        "num_target_layers": 8,
        "dflash_config": {
            "mask_token_id": model.config.mask_token_id,
            "target_layer_ids": [i - 1 for i in model.config.aux_layer_ids],
        },
        "torch_dtype": "bfloat16",
        **changes,
    }
    tensors = model.export_state_dict(torch.float32)
    for name in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"):
        tensors.pop(name, None)
    return write_source(directory, config, tensors)
