"""The one way this package writes a checkpoint: stage everything in a hidden sibling directory, run the validator
on the staged files (against the verifier's config), and rename into place only when nothing is an error.

An interrupted or refused write therefore leaves at most a hidden ``.NAME.partial-*`` directory that is removed on
the way out, never a directory that looks like a checkpoint; an existing ``OUT_DIR`` is replaced only on success,
in one atomic swap, and only when it is empty or an earlier export and holds none of the ``sources``
(:mod:`speculators.outputs`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from speculators.format.checkpoint import WEIGHTS_NAME
from speculators.format.validate import Finding, errors, validate_checkpoint
from speculators.outputs import EXPORT_OUTPUT, output_directory


class InvalidCheckpointError(ValueError):
    """The staged checkpoint broke at least one rule of the format; nothing was written."""

    def __init__(self, out_dir: Path, findings: list[Finding]) -> None:
        self.findings = findings
        lines = "\n  ".join(str(f) for f in errors(findings))
        super().__init__(f"refusing to write {out_dir}: the result would be invalid:\n  {lines}")


def write_validated(
    out_dir: str | Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    verifier_config: dict[str, Any] | None,
    extra_files: dict[str, str | bytes | Path] | None = None,
    sources: Sequence[str | Path | None] = (),
) -> list[Finding]:
    """Write ``config.json`` + ``model.safetensors`` + extras (text, bytes, or a file to copy) atomically, after the
    validator passed on the staged copy. Returns the (warning-only) findings; raises ``InvalidCheckpointError``,
    or ``UnsafeOutputError`` when ``out_dir`` holds anything but an earlier export or one of ``sources``."""
    out_dir = Path(out_dir)
    with output_directory(out_dir, EXPORT_OUTPUT, sources) as staging:
        save_file(
            {name: t.detach().contiguous().cpu() for name, t in tensors.items()},
            str(staging / WEIGHTS_NAME),
            metadata={"format": "pt"},
        )
        for name, content in (extra_files or {}).items():
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, Path):
                shutil.copyfile(content, target)
            elif isinstance(content, bytes):
                target.write_bytes(content)
            else:
                target.write_text(content)
        # config.json last: a write killed before this point leaves no config, so nothing that looks loadable.
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        findings = validate_checkpoint(staging, verifier_config)
        findings = [
            Finding(f.severity, f.file.replace(str(staging), str(out_dir)), f.message) for f in findings
        ]
        if errors(findings):
            raise InvalidCheckpointError(out_dir, findings)
    return findings
