"""Standalone worker: load a checkpoint with the ``speculators`` package (0.9.0) in ITS virtualenv and describe it.

Usage: ``python speculators_package_worker.py REQUEST.json RESULT.json`` with request ``{"model": <draft dir>}``
(optionally ``"block_forward": {"inputs", "output"}``: a block drafter's logits, see ``block_forward``; and
``"convert_dflash": {"input", "verifier"}``: first convert an external (z-lab) DFlash draft into ``model`` with the
package's own converter; ``"build": {...}``: first build and save a draft with the package's own constructor, see
``build_peer_draft``; ``"peagle_forward": {"inputs", "output"}``: a P-EAGLE draft's logits, see ``peagle_forward``).
It must not import our package (both are named ``speculators``; here the name means the upstream library). The
result names the class the package chose, the resolved config values it acts on, and every tensor of the loaded
model with its shape, dtype and a digest, so the caller can compare them with what it wrote.

Digest convention (shared with ``speculators/serving/speculators_package.py``): sha256 of the tensor's bytes after
conversion to float32 (floating tensors) or int64 (integer and bool tensors), C-contiguous, on CPU.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def digest(tensor: Any) -> str:
    import torch

    wide = torch.float32 if tensor.is_floating_point() else torch.int64
    return hashlib.sha256(tensor.detach().to("cpu", wide).contiguous().numpy().tobytes()).hexdigest()


def describe(model: Any) -> dict[str, Any]:
    tensors = {}
    for name, tensor in model.state_dict().items():
        tensors[name] = {
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "sha256": digest(tensor),
            "has_nan": bool(tensor.is_floating_point() and tensor.isnan().any()),
        }
    config = model.config
    layer = config.transformer_layer_config
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config_class": type(config).__name__,
        "layer_model_type": getattr(layer, "model_type", None),
        "draft_vocab_size": getattr(config, "draft_vocab_size", None),
        "vocab_size": getattr(layer, "vocab_size", None),
        "norm_before_residual": getattr(config, "norm_before_residual", None),
        "aux_layer_ids": list(
            getattr(config, "eagle_aux_hidden_state_layer_ids", None)
            or getattr(config, "aux_hidden_state_layer_ids", None)
            or []
        ),
        "block_keys": {
            key: getattr(config, key)
            for key in ("block_size", "mask_token_id", "sliding_window_non_causal", "sample_from_anchor")
            if hasattr(config, key)
        },
        "speculative_tokens": [m.speculative_tokens for m in config.speculators_config.proposal_methods],
        "verifier": config.speculators_config.verifier.name_or_path,
        "tensors": tensors,
    }


def block_forward(model: Any, spec: dict[str, str]) -> None:
    """Draft logits of a block drafter (DFlash family) through the package's own training forward
    (``_backbone_forward``), in float32, for blocks anchored at given positions of one sequence.

    Inputs (a safetensors file): ``hidden_states [1, T, n_aux * H]`` (the verifier's aux states), ``input_ids
    [1, T]``, ``anchors [A]``. The package draws its anchors at random among the loss-masked positions and keeps all
    of them when there are at most ``max_anchors``, so a loss mask set exactly at ``anchors`` makes it use those.
    Writes ``logits [A, block_size, draft V]`` and ``lm_head`` / ``embed_tokens`` as the package holds them. A DSpark
    draft's logits include its Markov bias, computed by the package's own head from the token before each slot's
    target (``sample_from_anchor`` false: the anchor for slots 0 and 1, then the block's data tokens), as its
    training forward adds it."""
    import torch
    from safetensors.torch import load_file, save_file

    inputs = load_file(spec["inputs"])
    hidden, ids, anchors = inputs["hidden_states"], inputs["input_ids"], inputs["anchors"]
    length = ids.shape[1]
    loss_mask = torch.zeros(1, length)
    loss_mask[0, anchors] = 1
    model = model.float().eval()
    width = model.config.transformer_layer_config.hidden_size
    with torch.no_grad():
        hidden, logits, _, _, _ = model._backbone_forward(
            hidden.float(),
            ids,
            loss_mask,
            torch.zeros(1, length, width),
            torch.zeros(1, length, dtype=torch.long),
            max_anchors=int(anchors.numel()),
        )
    logits = logits.reshape(int(anchors.numel()), model.block_size, -1)
    markov = getattr(model, "markov_head", None)
    if markov is not None:
        slots = torch.arange(model.block_size)
        prev_positions = (anchors[:, None] + slots[None] - 1).clamp(min=0)
        prev_positions[:, 0] = anchors  # slot 0 proposes nothing; the package gives it the anchor
        prev_positions = torch.maximum(prev_positions, anchors[:, None])
        prev = ids[0, prev_positions]
        with torch.no_grad():
            logits = logits + markov.block_bias(
                prev_token_ids=prev, hidden_states=hidden.view(int(anchors.numel()), model.block_size, -1)
            )
    save_file(
        {
            "logits": logits.contiguous(),
            "lm_head": model.lm_head.weight.detach().contiguous(),
            "embed_tokens": model.embed_tokens.weight.detach().contiguous(),
        },
        spec["output"],
    )


# the types build_peer_draft makes
PEER_CLASSES = {"peagle": "PEagleDraftModel", "dspark": "DSparkDraftModel"}


def build_peer_draft(spec: dict[str, Any], out_dir: str) -> None:
    """Build a draft with the package's OWN training-time constructor and save it with its own ``save_pretrained``:
    what its trainer writes at step 0 (``create_transformer_layer_config`` + ``<Model>.from_training_args``), with
    every trainable weight random so that no tensor can be confused with another on the way through a converter.

    ``spec``: ``type`` (``peagle`` or ``dspark``), ``verifier`` (a local HF dir), ``draft_arch``, ``num_layers``,
    ``target_layer_ids``, ``mask_token_id``, ``draft_vocab_size`` (a spread-out subset of the verifier vocabulary:
    non-trivial d2t offsets), ``seed``, and the type's own keys (``num_depths``; ``block_size``,
    ``sample_from_anchor``, ``markov_rank``, ``confidence_head_with_markov``)."""
    import torch

    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(int(spec.get("seed", 0)))
    layer = create_transformer_layer_config(
        verifier_name_or_path=spec["verifier"],
        num_layers=int(spec.get("num_layers", 1)),
        draft_arch=spec.get("draft_arch", "qwen3"),
        hidden_act=None,
        sliding_window=int(spec.get("sliding_window", 2048)),
        full_attention_indices=list(spec.get("full_attention_indices", [])),
    )
    vocab, draft_vocab = int(layer.vocab_size), int(spec["draft_vocab_size"])
    kept = torch.linspace(0, vocab - 1, draft_vocab).round().long().unique()
    if kept.numel() != draft_vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab} does not spread over {vocab} ids")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    d2t = kept - torch.arange(draft_vocab)
    shaping = (
        "type",
        "verifier",
        "draft_arch",
        "num_layers",
        "seed",
        "sliding_window",
        "full_attention_indices",
    )
    own = {k: v for k, v in spec.items() if k not in shaping}  # what the package's trainer passes as its args
    model_class = getattr(
        importlib.import_module(f"speculators.models.{spec['type']}"), PEER_CLASSES[spec["type"]]
    )
    model = model_class.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=spec["verifier"], **own
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(("verifier_", "embed_tokens", "lm_head")):
                continue  # the verifier's copies, as the package loads them
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name == "mask_hidden":
                param.normal_()
            else:
                param.normal_(std=0.05)
    model.save_pretrained(out_dir)


def peagle_forward(model: Any, spec: dict[str, str]) -> None:
    """P-EAGLE logits through the package's own training forward for GIVEN (anchor, depth) elements instead of its
    random COD draw: its sampler is swapped for one returning the requested elements and its loss for one that
    keeps the logits. Everything between (mask token and ``mask_hidden`` at depth >= 1, fc, layers, its attention
    mask over chains, positions anchor + depth) is the package's code.

    Inputs (safetensors): ``hidden_states [1, T, n_aux * H]``, ``input_ids [1, T]`` (the token paired with each
    position's states), ``anchors [E]``, ``depths [E]`` (depth 0 must cover every position, as COD does).
    Writes ``logits [E, draft V]`` in float32."""
    import torch
    from safetensors.torch import load_file, save_file

    from speculators.models.peagle import core

    inputs = load_file(spec["inputs"])
    hidden, ids = inputs["hidden_states"].float(), inputs["input_ids"]
    captured: dict[str, Any] = {}

    def given_elements(**_: Any) -> tuple[Any, Any]:
        return inputs["anchors"], inputs["depths"]

    def keep_logits(logits: Any, **_: Any) -> tuple[Any, dict]:
        captured["logits"] = logits
        return logits.sum() * 0, {}

    core.generate_cod_sample_indices, core.compute_metrics = given_elements, keep_logits
    length = ids.shape[1]
    model = model.float().eval()
    width = model.config.transformer_layer_config.hidden_size
    with torch.no_grad():
        model(
            hidden_states=hidden,
            input_ids=ids,
            document_ids=torch.zeros(1, length, dtype=torch.long),
            loss_mask=torch.ones(1, length),
            verifier_last_hidden_states=torch.zeros(1, length, width),
        )
    save_file({"logits": captured["logits"][0].float().contiguous()}, spec["output"])


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: speculators_package_worker.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    request = json.loads(Path(argv[1]).read_text())
    result_path = Path(argv[2])
    try:
        from importlib.metadata import version

        from speculators import SpeculatorModel

        if request.get("convert_dflash"):  # the package's own converter writes request["model"] first
            from speculators.convert.dflash import DFlashConverter

            job = request["convert_dflash"]
            DFlashConverter().convert(
                job["input"], request["model"], base_model=job["verifier"], validate=False
            )
        if request.get("build"):  # the package's own constructor writes request["model"] first
            build_peer_draft(request["build"], request["model"])
        started = time.perf_counter()
        model = SpeculatorModel.from_pretrained(request["model"])
        seconds = time.perf_counter() - started
        if request.get("block_forward"):
            block_forward(model, request["block_forward"])
        if request.get("peagle_forward"):
            peagle_forward(model, request["peagle_forward"])
        result = {
            "ok": True,
            "speculators_version": version("speculators"),
            "load_seconds": seconds,
            **describe(model),
        }
        status = 0
    except Exception as exc:  # noqa: BLE001 - reported to the caller with the traceback
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        status = 1
    result_path.write_text(json.dumps(result))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
