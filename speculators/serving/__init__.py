"""Bridges to the external consumers of our checkpoints (vLLM, the ``speculators`` package), each run in its own
virtualenv through a standalone worker script; nothing here imports them."""

from speculators.serving.vllm_bridge import (
    SpecDecodeMetrics,
    VllmError,
    VllmRequest,
    VllmResult,
    eagle3_speculative_config,
    generate_with_vllm,
    run_vllm,
    vllm_available,
    vllm_python,
)
from speculators.serving.worker_process import ConsumerUnavailable, WorkerError

__all__ = [
    "ConsumerUnavailable",
    "SpecDecodeMetrics",
    "VllmError",
    "VllmRequest",
    "VllmResult",
    "WorkerError",
    "eagle3_speculative_config",
    "generate_with_vllm",
    "run_vllm",
    "vllm_available",
    "vllm_python",
]
