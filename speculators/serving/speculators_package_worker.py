"""Standalone worker: load a checkpoint with the ``speculators`` package (0.9.0) in ITS virtualenv and describe it.

Usage: ``python speculators_package_worker.py REQUEST.json RESULT.json`` with request ``{"model": <draft dir>}``
(optionally ``"block_forward": {"inputs", "output"}``: a block drafter's logits, see ``block_forward``; and
``"convert_dflash": {"input", "verifier"}``: first convert an external (z-lab) DFlash draft into ``model`` with the
package's own converter).
It must not import our package (both are named ``speculators``; here the name means the upstream library). The
result names the class the package chose, the resolved config values it acts on, and every tensor of the loaded
model with its shape, dtype and a digest, so the caller can compare them with what it wrote.

Digest convention (shared with ``speculators/serving/speculators_package.py``): sha256 of the tensor's bytes after
conversion to float32 (floating tensors) or int64 (integer and bool tensors), C-contiguous, on CPU.
"""

from __future__ import annotations

import hashlib
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
        started = time.perf_counter()
        model = SpeculatorModel.from_pretrained(request["model"])
        seconds = time.perf_counter() - started
        if request.get("block_forward"):
            block_forward(model, request["block_forward"])
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
