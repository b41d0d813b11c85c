"""Capture back ends: the engine that turns a shard's token ids into verifier features, behind one interface.

``data_gen.capture.backend`` picks one (recipes/data_gen/default.yaml):

* ``transformers`` (default): the HF verifier in this process (:class:`data_gen.capture.FeatureCapture`), batched
  and padded here. Runs everywhere; the verifier must fit on this rank's device.
* ``vllm``: vLLM's own ``extract_hidden_states`` speculative method and hidden-states connector, in a vLLM worker
  process (its own virtualenv; :mod:`data_gen.vllm_capture`). vLLM batches, and on GPUs shards the verifier over
  ``tensor_parallel_size`` GPUs.

Both return, for each token-id sequence, ``aux_hidden`` [T, n*H] (residual streams ENTERING the layers
``aux_layer_ids``, vLLM's convention, concatenated in that order) and ``last_hidden`` [T, H] (the last decoder
layer's output before the final norm). The pipeline builds the samples (ids, loss masks) from ITS tokenization
around them, so masks and ids never depend on the back end, and the shard format is the same.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from data_gen.capture import FeatureCapture

Features = tuple[torch.Tensor, torch.Tensor]  # (aux_hidden [T, n*H], last_hidden [T, H]) of one sequence


@dataclass
class CaptureSettings:
    """``data_gen.capture`` of the recipe (see recipes/data_gen/default.yaml)."""

    backend: str = "transformers"
    tensor_parallel_size: int = 1  # vllm: GPUs per engine
    threads: int | None = None  # vllm on CPU: its OpenMP threads (null: every core)
    gpu_memory_utilization: float | None = None  # vllm: its share of each GPU (null: 0.9)
    kv_cache_gib: float | None = None  # vllm on CPU: RAM for its KV cache (null: 1 GiB)

    def check(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"data_gen.capture.backend={self.backend!r}; use one of {sorted(BACKENDS)}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"data_gen.capture.tensor_parallel_size={self.tensor_parallel_size}; use 1 or more GPUs"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"data_gen.capture.threads={self.threads}; use null (every core) or >= 1")


@dataclass
class VerifierHandle:
    """What a back end may need to know about the verifier (each takes what it uses)."""

    model: Any  # the HF verifier (the transformers back end runs it; others only read its dtype)
    path: str  # local directory or hub id
    aux_layer_ids: list[int]
    num_layers: int
    pad_id: int
    batch_size: int  # data_gen.batch_size: sequences per padded forward (transformers)
    max_length: int  # data.max_length: the longest sequence

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).replace("torch.", "")


class CaptureBackend(Protocol):
    """One capture engine. ``needs_verifier_on_device``: whether the HF verifier must be on this rank's device to
    capture (the pipeline otherwise leaves it on the CPU, where it only serves the run's fingerprint)."""

    name: str
    needs_verifier_on_device: bool
    aux_layer_ids: list[int]

    def move_to(self, device: str | torch.device) -> None:
        """Take the device once regeneration has freed it (called before the first shard)."""

    def capture(self, sequences: Sequence[Sequence[int]]) -> list[Features]:
        """Features of every sequence, in input order, on the CPU, in the verifier's dtype."""

    def close(self) -> None:
        """Release the engine (a worker process, a GPU)."""


class TransformersCapture:
    """The HF verifier in this process: length-sorted, right-padded batches through :class:`FeatureCapture`."""

    name = "transformers"
    needs_verifier_on_device = True

    def __init__(self, model: Any, aux_layer_ids: Sequence[int], batch_size: int, pad_id: int) -> None:
        self.features = FeatureCapture(model, aux_layer_ids, out_dtype=None)
        self.aux_layer_ids = self.features.aux_layer_ids
        self.batch_size = batch_size
        self.pad_id = pad_id

    @classmethod
    def build(cls, settings: CaptureSettings, verifier: VerifierHandle) -> TransformersCapture:
        return cls(verifier.model, verifier.aux_layer_ids, verifier.batch_size, verifier.pad_id)

    def move_to(self, device: str | torch.device) -> None:
        self.features.model.to(device)

    def capture(self, sequences: Sequence[Sequence[int]]) -> list[Features]:
        order = sorted(range(len(sequences)), key=lambda i: (-len(sequences[i]), i))
        out: list[Features | None] = [None] * len(sequences)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            width = len(sequences[rows[0]])
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for row, index in enumerate(rows):
                length = len(sequences[index])
                ids[row, :length] = torch.tensor(list(sequences[index]))
                mask[row, :length] = 1
            features = self.features.capture(ids, mask)
            aux, last = features["aux_hidden"].cpu(), features["last_hidden"].cpu()
            for row, index in enumerate(rows):
                length = len(sequences[index])
                out[index] = (aux[row, :length].clone(), last[row, :length].clone())
        return [f for f in out if f is not None]

    def close(self) -> None:
        return None


# name -> "module:class" (imported on use: the vLLM back end's module is only needed when it is chosen)
BACKENDS = {
    "transformers": "data_gen.capture_backends:TransformersCapture",
    "vllm": "data_gen.vllm_capture:VllmCapture",
}


def build_capture_backend(settings: CaptureSettings, verifier: VerifierHandle) -> CaptureBackend:
    """The back end ``settings.backend`` names, for ``verifier``."""
    settings.check()
    module, name = BACKENDS[settings.backend].split(":")
    return getattr(importlib.import_module(module), name).build(settings, verifier)


def backend_needs_verifier_on_device(settings: CaptureSettings) -> bool:
    """Whether the chosen back end runs the HF verifier itself (known before anything is loaded)."""
    module, name = BACKENDS[settings.backend].split(":")
    return bool(getattr(importlib.import_module(module), name).needs_verifier_on_device)


__all__ = [
    "BACKENDS",
    "CaptureBackend",
    "CaptureSettings",
    "Features",
    "TransformersCapture",
    "VerifierHandle",
    "build_capture_backend",
]
