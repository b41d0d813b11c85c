"""Standalone worker: load a checkpoint with the ``speculators`` package (0.9.0) in ITS virtualenv and describe it.

Usage: ``python speculators_package_worker.py REQUEST.json RESULT.json`` with request ``{"model": <draft dir>}``.
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
        "aux_layer_ids": list(getattr(config, "eagle_aux_hidden_state_layer_ids", None) or []),
        "speculative_tokens": [m.speculative_tokens for m in config.speculators_config.proposal_methods],
        "verifier": config.speculators_config.verifier.name_or_path,
        "tensors": tensors,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: speculators_package_worker.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    request = json.loads(Path(argv[1]).read_text())
    result_path = Path(argv[2])
    try:
        from importlib.metadata import version

        from speculators import SpeculatorModel

        started = time.perf_counter()
        model = SpeculatorModel.from_pretrained(request["model"])
        seconds = time.perf_counter() - started
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
