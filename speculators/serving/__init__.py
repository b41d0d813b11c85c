"""Bridges to the external consumers of our checkpoints (vLLM, the ``speculators`` package), each run in its own
virtualenv through a standalone worker script; nothing here imports them."""

from speculators.serving.speculators_package import (
    block_logits_with_speculators_package,
    build_with_speculators_package,
    convert_dflash_with_speculators_package,
    load_with_speculators_package,
    peagle_logits_with_speculators_package,
    speculators_package_available,
    tensor_digest,
)
from speculators.serving.vllm_bridge import (
    SpecDecodeMetrics,
    VllmError,
    VllmRequest,
    VllmResult,
    VllmSession,
    VllmWarning,
    draft_speculative_config,
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
    "VllmSession",
    "VllmWarning",
    "WorkerError",
    "block_logits_with_speculators_package",
    "build_with_speculators_package",
    "convert_dflash_with_speculators_package",
    "draft_speculative_config",
    "eagle3_speculative_config",
    "generate_with_vllm",
    "load_with_speculators_package",
    "peagle_logits_with_speculators_package",
    "run_vllm",
    "speculators_package_available",
    "tensor_digest",
    "vllm_available",
    "vllm_python",
]
