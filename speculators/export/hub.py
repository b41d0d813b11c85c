"""``speculators push OUT_DIR REPO_ID``: publish a validated checkpoint directory to the Hugging Face Hub.

The upload goes through ``huggingface_hub.HfApi`` (token from ``HF_TOKEN`` unless given). ``api`` can be any
object with the same three methods; tests pass a recorder, production code never does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculators.format.checkpoint import read_config
from speculators.format.config import verifier_name_or_path
from speculators.format.validate import Finding, errors, validate_checkpoint
from speculators.local_paths import local_paths_in_files, names_local_path


@dataclass
class PushResult:
    repo_id: str
    revision: str | None
    commit: Any  # what HfApi.upload_folder returned (a CommitInfo with .commit_url / .oid)


def default_commit_message(directory: Path) -> str:
    config = read_config(directory)
    verifier = verifier_name_or_path(config) or "?"
    return f"Upload EAGLE-3 draft for {verifier} (speculators format)"


def push_checkpoint(
    directory: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    allow_local_verifier: bool = False,
    allow_local_paths: bool = False,
    api: Any = None,
) -> PushResult:
    """Validate ``directory`` and upload it to ``repo_id`` (created if absent; ``revision`` a branch, created from
    main if absent). Refuses an invalid checkpoint (weights of a dtype consumers do not load included), and by
    default one whose verifier is a local path, absolute or relative (``../v_llama``, ``./v``, ``models/a/b``: nobody
    who downloads it could `vllm serve` it: re-export with ``--verifier-name <hub id>``), and by default any file
    that holds an absolute local path (a model card, results, a plan: it leaks the user's directory layout and
    names nothing a downloader has; ``allow_local_paths`` overrides, ``allow_local_verifier`` allows the verifier's
    own path only)."""
    directory = Path(directory)
    refuse_invalid(directory, validate_checkpoint(directory))
    verifier = verifier_name_or_path(read_config(directory))  # the validator refused a config naming none
    if verifier and not allow_local_verifier and names_local_path(verifier, directory):
        raise ValueError(
            f"refusing to push {directory}: verifier.name_or_path is the local path {verifier!r}, which nobody else "
            "can resolve; re-export with --verifier-name <hub id of the verifier> (or pass --allow-local-verifier)"
        )
    if not allow_local_paths:
        refuse_local_paths(directory, allowed=[verifier] if allow_local_verifier else [])
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token or os.environ.get("HF_TOKEN"))
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    if revision:
        api.create_branch(repo_id=repo_id, branch=revision, repo_type="model", exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=str(directory),
        repo_type="model",
        revision=revision,
        commit_message=commit_message or default_commit_message(directory),
        ignore_patterns=[".*"],
    )
    return PushResult(repo_id=repo_id, revision=revision, commit=commit)


def refuse_invalid(directory: Path, findings: list[Finding]) -> None:
    """Raise when the validator found errors: one line for one error (what the user reads first is the fix),
    one line per error under the refusal for several."""
    bad = errors(findings)
    if not bad:
        return
    lines = f" {bad[0]}" if len(bad) == 1 else "".join(f"\n  {f}" for f in bad)
    raise ValueError(f"refusing to push {directory}: it is not a valid speculators checkpoint:{lines}")


def uploaded_files(directory: Path) -> list[Path]:
    """The files ``upload_folder`` sends: everything under ``directory`` but hidden names (``ignore_patterns``)."""
    return sorted(
        path
        for path in directory.rglob("*")
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(directory).parts)
    )


def refuse_local_paths(directory: Path, allowed: list[str] | None = None) -> None:
    """Raise naming every file to be uploaded that holds an absolute local path, with the paths found."""
    found = local_paths_in_files(uploaded_files(directory), allowed or [])
    if not found:
        return
    lines = "\n  ".join(
        f"{path.relative_to(directory)}: {', '.join(paths[:3])}"
        + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "")
        for path, paths in found.items()
    )
    raise ValueError(
        f"refusing to push {directory}: these files hold absolute local paths, which name your machine's "
        f"directories and nothing a downloader has:\n  {lines}\nre-export with the current `speculators export` "
        "(cards name models by hub id; --verifier-name <hub id>), edit the files, or pass --allow-local-paths"
    )
