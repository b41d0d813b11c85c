"""``speculators eval DRAFT``: acceptance length, per-position acceptance and speedup, as JSON and a plot."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="measure a draft: acceptance length, per-position acceptance, speedup over plain decoding",
        description="Decode the prompts with the verifier alone, then with the draft (greedy or lossless "
        "sampling), and write results.json and acceptance.png.",
    )
    parser.add_argument("draft", help="exported draft dir, trainer checkpoint (step-<N>) or training run dir")
    parser.add_argument(
        "--verifier", help="HF dir, hub id or 'smollm2' (default: the draft config's verifier)"
    )
    parser.add_argument(
        "--prompts",
        help="chat JSONL (messages / conversations / prompt per line) or a data_gen output dir (its "
        "heldout_conversations.jsonl); default: the 32 prompts shipped with the package",
    )
    parser.add_argument(
        "--max-prompts", type=int, help="use only the first N prompts (with --suite: --max-prompts-per-suite)"
    )
    parser.add_argument(
        "--suite",
        help="comma list of prompt sets, measured per suite and per category: mtbench (80 two-turn questions, the "
        "second asked after the verifier's own answer), humaneval (164), gsm8k (1,319), chats (--prompts); read "
        "offline from the pinned wheels (make setup)",
    )
    parser.add_argument(
        "--max-prompts-per-suite",
        type=int,
        help="the first N questions of each suite (an MT-Bench question is two requests, one per turn)",
    )
    parser.add_argument(
        "--no-oracle",
        action="store_true",
        help="skip the ceiling run (the verifier's own greedy continuation as the draft, at each chain k)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        help="k x concurrency sweep: also run every chain k (without -k: 1 to 4, a block draft up to its slots) and "
        "plain decoding at these batch sizes (e.g. 1 8); results.json's reports.k_sweep.best_k is the k to serve "
        "(speculators export --k-from-eval)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        help="cap on prompt tokens: a longer chat is cut back to its latest user turn that fits, or skipped "
        "when even its first does not (applied before --max-prompts)",
    )
    parser.add_argument(
        "-k",
        "--k",
        type=int,
        nargs="*",
        help="chain lengths to run (default: 3 for EAGLE-3, the whole block for a block draft such as DFlash)",
    )
    parser.add_argument("--tree", action="store_true", help="also run an EAGLE-2 tree")
    parser.add_argument(
        "--tree-topk", type=int, default=4, help="children per node / nodes expanded per depth"
    )
    parser.add_argument("--tree-depth", type=int, default=4, help="draft steps (maximum tree depth)")
    parser.add_argument(
        "--tree-budget", type=int, default=16, help="drafted tokens the verifier checks per step"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=4,
        help="requests decoded together by our engine (default 4); 1 also times vLLM (--vllm) one request at a time",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (bf16 where the processor runs it natively: CUDA, avx512_bf16/AMX CPUs; else fp32; "
        "SPECULATORS_COMPUTE_DTYPE overrides auto), float32 (token identity with plain decoding), bfloat16",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (on a CPU shared with other jobs, 1 is often fastest)",
    )
    parser.add_argument(
        "--no-plain", action="store_true", help="skip the plain baseline (no speedup reported)"
    )
    parser.add_argument(
        "--vllm", action="store_true", help="also run the chains through vLLM and report both"
    )
    parser.add_argument(
        "--keep-texts",
        action="store_true",
        help="also record each request's prompt chat, decoded output, verifier name and time in requests.jsonl, "
        "which data_gen then reads as served traffic (data.format=served); off by default: prompts are not "
        "copied into the results unasked",
    )
    parser.add_argument(
        "--output",
        default="eval_results",
        help="directory of its own for results.json, requests.jsonl and acceptance.png (written whole at the end)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace earlier results in --output (without it an evaluation never overwrites them)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Exit status 1 when vLLM was asked for (--vllm) and failed: results.json and the plot are written all the
    same (our engine's measurements, and vLLM's failure in ``vllm.failed``), but a script must not take a run
    without the cross-check it asked for as a complete one. The failure is one ``error:`` line, not a traceback."""
    from speculators.eval.evaluation import (
        EvalSettings,
        TreeSettings,
        consumer_failure,
        evaluate,
        format_table,
    )

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from speculators.eval.suites import parse_suites

    try:
        suites = parse_suites(args.suite) if args.suite else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sizes = {
        "--batch-size": [args.batch_size],
        "--concurrency": args.concurrency or [],
        "-k": args.k or [],
        "--max-new-tokens": [args.max_new_tokens],
        "--max-prompts": [] if args.max_prompts is None else [args.max_prompts],
        "--max-prompts-per-suite": [] if args.max_prompts_per_suite is None else [args.max_prompts_per_suite],
        "--max-prompt-tokens": [] if args.max_prompt_tokens is None else [args.max_prompt_tokens],
    }
    for flag, values in sizes.items():
        if any(value < 1 for value in values):
            print(f"error: {flag} takes whole numbers of at least 1, got {values}", file=sys.stderr)
            return 2
    settings = EvalSettings(
        ks=list(args.k) if args.k else None,
        tree=TreeSettings(args.tree_topk, args.tree_depth, args.tree_budget) if args.tree else None,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        max_prompts=args.max_prompts,
        max_prompt_tokens=args.max_prompt_tokens,
        seed=args.seed,
        compare_plain=not args.no_plain,
        vllm=args.vllm,
        suites=suites,
        max_prompts_per_suite=args.max_prompts_per_suite,
        oracle=not args.no_oracle,
        concurrencies=list(args.concurrency) if args.concurrency else None,
        keep_texts=args.keep_texts,
    )
    results = evaluate(
        Path(args.draft),
        args.verifier,
        Path(args.prompts) if args.prompts else None,
        settings,
        Path(args.output),
        dtype=args.dtype,
        device=args.device,
        overwrite=args.overwrite,
    )
    print(format_table(results))
    out = Path(args.output)
    print(f"wrote {out / 'results.json'}, {out / 'requests.jsonl'} and {out / 'acceptance.png'}")
    if failed := consumer_failure(results):
        print(f"error: vLLM failed, our engine's results were written: {failed}", file=sys.stderr)
        return 1
    return 0
