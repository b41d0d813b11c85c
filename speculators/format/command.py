"""``speculators validate DIR``: print every finding; exit 1 when any is an error."""

from __future__ import annotations

import argparse

from speculators.format.checkpoint import read_config
from speculators.format.validate import errors, validate_checkpoint


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate", help="check a checkpoint against every rule vLLM and speculators enforce"
    )
    parser.add_argument("directory", help="the draft checkpoint directory (config.json + model.safetensors)")
    parser.add_argument(
        "--verifier",
        help="verifier HF directory for the cross-checks (default: the config's local name_or_path)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    verifier_config = None
    if args.verifier:
        from speculators.verifier import resolve_verifier_path

        verifier_config = read_config(resolve_verifier_path(args.verifier))
    findings = validate_checkpoint(args.directory, verifier_config)
    for finding in findings:
        print(finding)
    bad = errors(findings)
    print(f"{args.directory}: {len(bad)} error(s), {len(findings) - len(bad)} warning(s)")
    return 1 if bad else 0
