"""Reading a checkpoint directory in any of the layouts drafts are published in: ``model.safetensors`` (single or
sharded with an index) or PyTorch ``pytorch_model.bin`` (single or sharded). Converters and the exporter read
through here so that the layout a draft happens to be stored in never decides whether it can be converted.
"""

from __future__ import annotations

from pathlib import Path

import torch

from speculators.format.checkpoint import (
    PYTORCH_BIN_LAYOUT,
    SAFETENSORS_LAYOUT,
    open_weights,
    read_config,
    weight_files,
)

ANY_LAYOUT = (SAFETENSORS_LAYOUT, PYTORCH_BIN_LAYOUT)  # safetensors preferred over pickled PyTorch files


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory by its stored name (on CPU, in its stored dtype)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory, ANY_LAYOUT):
        tensors.update(_read_file(path))
    return tensors


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing, though the checkpoint's index names it; re-export or re-download the checkpoint"
        )
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    try:
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle errors come in many types; all mean the same thing here
        raise ValueError(f"{path}: cannot read it as a PyTorch state dict ({exc})") from exc
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: holds a {type(loaded).__name__}, not a state dict of tensors")
    return {str(name): tensor for name, tensor in loaded.items() if isinstance(tensor, torch.Tensor)}


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (a damaged one: a ValueError naming it and the fix)."""
    with open_weights(path) as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


__all__ = ["ANY_LAYOUT", "read_config", "read_weights"]
