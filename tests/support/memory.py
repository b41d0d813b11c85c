"""Peak live tensor memory of a piece of work, on any device (CPU included).

CUDA has ``max_memory_allocated``; the CPU allocator has no such counter and RSS is blurred by the allocator's
caching. This dispatch mode counts every new tensor storage created while it is active (forward AND backward: the
autograd engine carries the mode into its thread) and subtracts it when the storage is freed, so the peak is an
exact, allocator-independent byte count — what the TTT-memory test and benchmark compare across lengths.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorMemory(TorchDispatchMode):
    """Tracks bytes of storages allocated inside the mode; ``peak`` is the maximum live total (bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._lock = threading.Lock()

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._seen:
            return
        size = storage.nbytes()
        with self._lock:
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        with self._lock:
            if key in self._seen:
                self._seen.discard(key)
                self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor) and not item.is_meta:
                self._track(item)
        return out


def peak_memory_of(work: Callable[[], object]) -> int:
    """Run ``work()`` and return the peak bytes of tensors it allocated (inputs created before are not counted)."""
    with LiveTensorMemory() as tracker:
        work()
    return tracker.peak


__all__ = ["LiveTensorMemory", "peak_memory_of"]
