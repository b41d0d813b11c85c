"""Reading a checkpoint directory in any of the layouts drafts are published in: ``model.safetensors`` (single or
sharded with an index) or PyTorch ``pytorch_model.bin`` (single or sharded). Converters and the exporter read
through here so that the layout a draft happens to be stored in never decides whether it can be converted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from speculators.format.checkpoint import PYTORCH_BIN_LAYOUT, SAFETENSORS_LAYOUT, weight_files

ANY_LAYOUT = (SAFETENSORS_LAYOUT, PYTORCH_BIN_LAYOUT)  # safetensors preferred over pickled PyTorch files


def read_config(directory: str | Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory as a dict."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: every draft checkpoint layout needs a config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or regenerate it") from exc


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory by its stored name (on CPU, in its stored dtype)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory, ANY_LAYOUT):
        tensors.update(_read_file(path))
    return tensors


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}
    try:
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle errors come in many types; all mean the same thing here
        raise ValueError(f"{path}: cannot read it as a PyTorch state dict ({exc})") from exc
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: holds a {type(loaded).__name__}, not a state dict of tensors")
    return {str(name): tensor for name, tensor in loaded.items() if isinstance(tensor, torch.Tensor)}


def read_verifier_tensor(verifier_dir: str | Path, names: tuple[str, ...]) -> torch.Tensor:
    """One tensor of a verifier checkpoint (the first of ``names`` present), reading only that tensor when the
    weights are safetensors: a draft's ``embed_tokens`` is a copy of the verifier's input embedding."""
    verifier_dir = Path(verifier_dir)
    files = weight_files(verifier_dir, ANY_LAYOUT)
    for path in files:
        if path.suffix != ".safetensors":
            continue
        with safe_open(str(path), framework="pt") as handle:
            for name in names:
                if name in handle.keys():
                    return handle.get_tensor(name)
    if any(path.suffix != ".safetensors" for path in files):
        weights = read_weights(verifier_dir)
        for name in names:
            if name in weights:
                return weights[name]
    raise KeyError(f"{verifier_dir}: none of {list(names)} is among the verifier's tensors")


VERIFIER_EMBEDDING_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "embed_tokens.weight",
)


def verifier_embedding(verifier_dir: str | Path) -> torch.Tensor:
    """The verifier's input embedding ``[V, H]``."""
    return read_verifier_tensor(verifier_dir, VERIFIER_EMBEDDING_NAMES)
