"""The real trainer → export → reload: a tiny run of ``train/run.py`` (recipe tiny_eagle3, features written by the
real data_gen store), exported by ``speculators export``, reloads into Eagle3DraftModel with the trainer's exact
logits (fp32 export) and bf16-identical logits (bf16 export)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from speculators.algorithms.eagle3.model import Eagle3DraftModel
from speculators.export import export_checkpoint
from tests.conftest import REPO_ROOT
from tests.export.conftest import draft_logits
from tests.train import conftest as helpers  # the trainer tests' builders: a missing dependency is an error

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        verifier = helpers.build_sharp_verifier(root / "verifier")
        data = helpers.write_features(root / "data", verifier, 8, heldout_same=True, seed=0)
    finally:
        torch.set_num_threads(before)
    run = root / "run"
    command = [
        sys.executable,
        str(REPO_ROOT / "train" / "run.py"),
        *helpers.tiny_overrides(verifier, data, run),
    ]
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=helpers.launch_env(root), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return run


def test_real_trainer_run_exports_and_reloads_with_identical_logits(trained_run, tmp_path):
    result = export_checkpoint(trained_run, tmp_path / "fp32", dtype="float32")
    trained = Eagle3DraftModel.from_pretrained(result.checkpoint.draft_dir, dtype=torch.float32)
    exported = Eagle3DraftModel.from_pretrained(tmp_path / "fp32", dtype=torch.float32)
    assert result.checkpoint.selected_by == "best"
    assert torch.equal(draft_logits(exported), draft_logits(trained))

    export_checkpoint(trained_run, tmp_path / "bf16")
    reloaded = Eagle3DraftModel.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert torch.equal(draft_logits(reloaded), draft_logits(trained.to(torch.bfloat16)))

    card = (tmp_path / "bf16" / "README.md").read_text()
    assert "Held-out validation at step" in card and "acceptance_length" in card
    assert (tmp_path / "bf16" / "acceptance_length.png").read_bytes().startswith(b"\x89PNG")
    assert "| recipe | `tiny_eagle3` |" in card
