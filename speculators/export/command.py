"""``speculators export | convert | push``: the command-line faces of the exporter, the converters and the Hub push.

Warnings raised on the way (shifted aux ids, converted d2t, a copied embedding, ...) are printed one per line
so that a user sees every change made to their draft.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    _add_export(subparsers)
    _add_convert(subparsers)
    _add_push(subparsers)


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r}: use true or false")


def _common_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative-tokens", type=int, help="proposal length written to the config (vLLM's k)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument(
        "--verifier",
        help="verifier HF dir / hub id / smollm2 (checks, embed_tokens; written unless --verifier-name)",
    )
    parser.add_argument("--verifier-name", help="write this verifier name_or_path instead (e.g. the hub id)")
    parser.add_argument("--no-model-card", action="store_true", help="do not write README.md")


def _add_export(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="trainer run/checkpoint -> standard speculators dir (validated, bf16, model card)",
        description="A run directory means its best checkpoint (checkpoints/best.json), else the latest one.",
    )
    parser.add_argument(
        "source", help="run directory, checkpoints/step-<N> directory, or a speculators checkpoint"
    )
    parser.add_argument("out_dir")
    _common_output(parser)
    parser.add_argument(
        "--eval-results",
        help="results.json of `speculators eval` to show in the model card (e.g. evaluate an export, then export "
        "again with its results); one inside the run directory is found without this",
    )
    parser.add_argument(
        "--k-from-eval",
        help="results.json of `speculators eval -k ... --concurrency ...`: speculative_tokens becomes the k with the "
        "most tokens/s at --serve-concurrency, and the model card shows the sweep",
    )
    parser.add_argument(
        "--serve-concurrency", type=int, default=1, help="concurrency the k is chosen for (default 1)"
    )
    parser.set_defaults(func=run_export)


def _add_convert(subparsers: argparse._SubParsersAction) -> None:
    from speculators.export.convert import AUX_CONVENTIONS, FLAG_MODES, layouts

    LAYOUTS = layouts()  # noqa: N806 - every unit's convert layouts

    parser = subparsers.add_parser(
        "convert",
        help="a draft in another layout (original EAGLE-3, SpecForge, older/newer speculators incl. speculators "
        "0.9.0 P-EAGLE/DFlash/DSpark, z-lab DFlash) -> standard",
    )
    parser.add_argument("source")
    parser.add_argument("out_dir")
    parser.add_argument("--from", dest="layout", default="auto", choices=("auto", *LAYOUTS))
    parser.add_argument(
        "--aux-convention",
        default="auto",
        choices=AUX_CONVENTIONS,
        help="how the SOURCE counts aux layer ids. vllm: id k = the stream entering layer k (kept as is); "
        "output-of-layer: id k = output of layer k (shifted +1, with a warning). auto (default): ids under "
        "SGLang/SpecForge's eagle_config are output-of-layer, ids anywhere else vllm",
    )
    parser.add_argument(
        "--flags",
        default="max-compat",
        choices=FLAG_MODES,
        help="max-compat (default): keys outside the format dropped; norm_before_fc/fc_norm/norm_output kept "
        "where the draft was trained with them (EAGLE-3.1; vLLM 0.32 and speculators 0.9.0 read them), with a "
        "warning, else written false; keep: every key copied",
    )
    parser.add_argument(
        "--norm-before-residual",
        type=_bool,
        help="override (true|false); needed when a speculators-format source omits it",
    )
    _common_output(parser)
    parser.set_defaults(func=run_convert)


def _add_push(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "push", help="validate a checkpoint dir and upload it to the Hugging Face Hub"
    )
    parser.add_argument("directory")
    parser.add_argument("repo_id")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--revision", help="branch to push to (created if absent)")
    parser.add_argument("--commit-message")
    parser.add_argument(
        "--allow-local-verifier",
        action="store_true",
        help="push even though verifier.name_or_path is a local path",
    )
    parser.add_argument(
        "--allow-local-paths",
        action="store_true",
        help="push even though a file (model card, results) holds an absolute local path",
    )
    parser.set_defaults(func=run_push)


def _reporting(action: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``action`` printing its warnings; a user's error (a bad path or value, a full or read-only disk)
    becomes one message and exit status 1. SPECULATORS_TRACEBACK=1 shows its traceback instead."""
    from speculators.cli import USER_ERRORS, user_message

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = action()
            status = 0
        except USER_ERRORS as exc:
            if os.environ.get("SPECULATORS_TRACEBACK") == "1":
                raise
            result, status = None, 1
            print(f"error: {user_message(exc)}", file=sys.stderr)
    for item in caught:
        print(f"warning: {item.message}", file=sys.stderr)
    return result, status


def replaced_note(replaced: bool) -> str:
    return "; it replaced the earlier export there" if replaced else ""


def run_export(args: argparse.Namespace) -> int:
    from speculators.export.exporter import export_checkpoint

    result, status = _reporting(
        lambda: export_checkpoint(
            args.source,
            args.out_dir,
            speculative_tokens=args.speculative_tokens,
            dtype=args.dtype,
            verifier=args.verifier,
            verifier_name=args.verifier_name,
            model_card=not args.no_model_card,
            eval_results=args.eval_results,
            k_from_eval=args.k_from_eval,
            serve_concurrency=args.serve_concurrency,
        )
    )
    if result is not None:
        print(
            f"exported {result.checkpoint.label} -> {result.out_dir} (validator: {len(result.findings)} warning(s))"
            + replaced_note(result.replaced)
        )
        for finding in result.findings:
            print(finding)
    return status


def run_convert(args: argparse.Namespace) -> int:
    from speculators.export.convert import convert_checkpoint

    result, status = _reporting(
        lambda: convert_checkpoint(
            args.source,
            args.out_dir,
            layout=args.layout,
            verifier=args.verifier,
            verifier_name=args.verifier_name,
            aux_convention=args.aux_convention,
            flags=args.flags,
            norm_before_residual=args.norm_before_residual,
            speculative_tokens=args.speculative_tokens,
            dtype=args.dtype,
            model_card=not args.no_model_card,
        )
    )
    if result is not None:
        print(
            f"converted {args.source} ({result.layout}) -> {result.out_dir} "
            f"(validator: {len(result.findings)} warning(s))" + replaced_note(result.replaced)
        )
        for finding in result.findings:
            print(finding)
    return status


def run_push(args: argparse.Namespace) -> int:
    from speculators.export.hub import push_checkpoint

    result, status = _reporting(
        lambda: push_checkpoint(
            args.directory,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            allow_local_verifier=args.allow_local_verifier,
            allow_local_paths=args.allow_local_paths,
        )
    )
    if result is not None:
        url = getattr(result.commit, "commit_url", None) or result.commit
        print(
            f"pushed {args.directory} -> {args.repo_id}"
            + (f"@{args.revision}" if args.revision else "")
            + f": {url}"
        )
    return status
