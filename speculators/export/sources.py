"""Reading a checkpoint directory in any of the layouts drafts are published in: ``model.safetensors`` (single or
sharded with an index) or PyTorch ``pytorch_model.bin`` (single or sharded). Converters and the exporter read
through here so that the layout a draft happens to be stored in never decides whether it can be converted.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from speculators.format.checkpoint import PYTORCH_BIN_LAYOUT, SAFETENSORS_LAYOUT, read_config, weight_files

ANY_LAYOUT = (SAFETENSORS_LAYOUT, PYTORCH_BIN_LAYOUT)  # safetensors preferred over pickled PyTorch files


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


__all__ = ["ANY_LAYOUT", "read_config", "read_weights"]
