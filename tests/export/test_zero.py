"""Export from DeepSpeed ZeRO-3 shards only (no draft/ in the checkpoint): a real checkpoint saved by a one-process
DeepSpeed engine, gathered with zero_to_fp32, must export to exactly the engine's full parameters."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from speculators.export import ExportWarning, export_checkpoint
from speculators.format import load_checkpoint
from tests.export.conftest import build_draft, make_run

SCRIPT = Path(__file__).with_name("zero_checkpoint.py")
REPO = Path(__file__).resolve().parents[2]

# Each test asserts the warnings it cares about with pytest.warns; the rest are expected noise here.
pytestmark = pytest.mark.filterwarnings("ignore::speculators.export.ExportWarning")


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory, small_verifier_dir):
    """Run with step-10 (draft/ only) and step-20 (state/ with ZeRO-3 shards only, the best)."""
    root = tmp_path_factory.mktemp("zero")
    first = build_draft(small_verifier_dir, draft_vocab_size=256, seed=10)
    second = build_draft(small_verifier_dir, draft_vocab_size=256, seed=20)
    run = make_run(root / "run", str(small_verifier_dir), {10: first, 20: None}, best_step=20)
    start = root / "start-draft"
    second.save_pretrained(start, dtype=torch.float32)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}
    state = run / "checkpoints" / "step-20" / "state"
    reference = root / "reference.safetensors"
    subprocess.run(
        [sys.executable, str(SCRIPT), str(start), str(state), str(reference)],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    full = {k.removeprefix("draft."): v for k, v in load_file(str(reference)).items()}
    assert not torch.equal(full["fc.weight"], second.fc.weight.detach()), "the optimizer step changed nothing"
    return run, full


def test_zero3_shards_export_exactly_with_a_sibling_config(zero_run, tmp_path):
    run, full = zero_run
    with pytest.warns(ExportWarning, match="stripped the prefix 'draft.'"):  # the trainer's wrapper module
        result = export_checkpoint(run, tmp_path / "out", dtype="float32")
    assert result.checkpoint.step == 20 and result.checkpoint.draft_dir is None
    _, tensors = load_checkpoint(tmp_path / "out")
    assert set(tensors) == set(full)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, full[name]), name
    assert "gathered DeepSpeed ZeRO shards" in (tmp_path / "out" / "README.md").read_text()


def test_zero3_shards_export_without_any_draft_config(zero_run, tmp_path):
    run, full = zero_run
    shutil.rmtree(run / "checkpoints" / "step-10")  # no sibling: the config is rebuilt from verifier + shapes
    with pytest.warns(ExportWarning):
        _, tensors = load_checkpoint(export_checkpoint(run, tmp_path / "out").out_dir)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, full[name].to(tensor.dtype)), name
