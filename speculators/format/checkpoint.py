"""Reading and writing a speculators checkpoint directory (``config.json`` + ``model.safetensors``).

Writes are atomic: everything goes into a temporary sibling directory that is renamed into place only when complete,
so an interrupted write never leaves a directory that looks valid.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from speculators.outputs import EXPORT_OUTPUT, output_directory

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def save_checkpoint(
    directory: str | Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    extra_files: dict[str, str | bytes] | None = None,
) -> Path:
    """Atomically write ``config.json``, ``model.safetensors`` and any extra files (e.g. ``README.md``). The
    directory is replaced only when it is new, empty or an earlier checkpoint (:mod:`speculators.outputs`)."""
    with output_directory(directory, EXPORT_OUTPUT) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(
            {name: t.detach().contiguous().cpu() for name, t in tensors.items()},
            str(staging / WEIGHTS_NAME),
            metadata={"format": "pt"},
        )
        for name, content in (extra_files or {}).items():
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(staging / name, mode) as handle:
                handle.write(content)
    return Path(directory)


SAFETENSORS_LAYOUT = (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
PYTORCH_BIN_LAYOUT = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def weight_files(
    directory: str | Path, layouts: tuple[tuple[str, str], ...] = (SAFETENSORS_LAYOUT,)
) -> list[Path]:
    """The weight files of a checkpoint directory: the first of ``layouts`` (``(single file, sharded index)``
    pairs) present. A speculators checkpoint is safetensors only; converters also accept ``PYTORCH_BIN_LAYOUT``."""
    directory = Path(directory)
    for single, index in layouts:
        if (directory / single).is_file():
            return [directory / single]
        if (directory / index).is_file():
            shards = sorted(set(json.loads((directory / index).read_text())["weight_map"].values()))
            return [directory / shard for shard in shards]
    looked_for = " or ".join(f"{single} (or {index})" for single, index in layouts)
    raise FileNotFoundError(f"{directory}: no {looked_for}; where are the checkpoint's weights?")


UNREADABLE_WEIGHTS_FIX = "truncated or not a safetensors file; re-export or re-download it"


@contextmanager
def open_weights(path: str | Path) -> Iterator[Any]:
    """``safe_open`` of one safetensors file whose failures name the file and the fix: the library's own
    ``SafetensorError`` is no ``ValueError`` or ``OSError``, and says neither which file nor what to do."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except SafetensorError as exc:
        raise ValueError(f"{path}: cannot be read ({exc}): {UNREADABLE_WEIGHTS_FIX}") from exc


def read_weights_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of one safetensors file, a damaged file named with the fix (:func:`open_weights`)."""
    with open_weights(path) as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}, dict(handle.metadata() or {})


def load_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, by their stored (unprefixed) names."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        with open_weights(path) as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def read_config(directory: str | Path) -> dict[str, Any]:
    """``config.json`` of a model directory (a draft in any layout, or a verifier) as a dict: the one reader, with
    errors that name the file."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {missing_config_hint(directory)}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or regenerate it") from exc


def missing_config_hint(directory: str | Path) -> str:
    """What a directory without config.json is, and the fix: users hand a run, a trainer step or a file to a
    command that wants a model directory."""
    directory = Path(directory)
    if not directory.exists():
        return f"{directory} does not exist"
    if not directory.is_dir():
        return f"{directory} is a file; pass the model directory that holds config.json"
    if (directory / "checkpoints").is_dir():
        return f"{directory} is a training run; export it first: `speculators export {directory} OUT`, then use OUT"
    if (directory / "draft").is_dir() or (directory / "state").is_dir():
        return f"{directory} is a trainer checkpoint; export it first: `speculators export {directory} OUT`"
    return "every model directory (draft or verifier) needs a config.json"


def load_checkpoint(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config dict, tensors)`` of a checkpoint directory, without validation (see ``validate_checkpoint``)."""
    return read_config(directory), load_tensors(directory)
