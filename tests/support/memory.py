"""Peak live tensor memory of a piece of work, on any device (CPU included).

CUDA has ``max_memory_allocated``; the CPU allocator has no such counter and RSS is blurred by the allocator's
caching. The dry-run memory planner's dispatch mode (:class:`train.memory_plan.LiveBytes`) counts every new tensor
storage while it is active (forward AND backward) and subtracts it when the storage is freed, so its peak is an
exact, allocator-independent byte count — what the TTT-memory test and benchmark compare across lengths. One
counter serves the plan and the measurements, so they cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable

from train.memory_plan import LiveBytes


def peak_memory_of(work: Callable[[], object]) -> int:
    """Run ``work()`` and return the peak bytes of tensors it allocated (inputs created before are not counted)."""
    with LiveBytes() as tracker:
        work()
    return tracker.peak


__all__ = ["peak_memory_of"]
