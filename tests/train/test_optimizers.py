"""``optim=muon`` (train/optimizers.py): Muon takes the 2-D hidden matrices and AdamW the rest, the pair trains and
resumes exactly like AdamW, and DeepSpeed (which steps flattened partitions) is refused up front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.algorithms.eagle3.model import Eagle3DraftModel
from tests.train.conftest import compose, tiny_overrides
from train.objectives import train_settings
from train.optimizers import BUILDERS, MuonWithAdamW, make_optimizer
from train.settings import OPTIMIZERS, OptimSettings, SettingsError
from train.trainer import train

STEPS = 16  # tiny_eagle3: 8 samples, micro batch 2 (4 steps per epoch), train.epochs=4 here


def tiny_draft() -> Eagle3DraftModel:
    verifier = {
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "vocab_size": 96,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
    }
    config = Eagle3Config.from_verifier(verifier, name_or_path="tiny", torch_dtype="float32")
    return Eagle3DraftModel(config)


def test_every_optimizer_name_has_a_builder():
    assert set(OPTIMIZERS) == set(BUILDERS)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    draft = tiny_draft()
    optimizer = make_optimizer(OptimSettings(name="muon"), draft)
    assert isinstance(optimizer, MuonWithAdamW)
    names = {id(p): name for name, p in draft.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in optimizer.param_groups if not g["muon"] for p in g["params"]}
    matrices = {n for n, p in draft.named_parameters() if p.ndim == 2 and p.requires_grad}
    assert muon == matrices - {"lm_head.weight"}
    assert "fc.weight" in muon and any(".self_attn.q_proj." in n for n in muon)
    assert any(".mlp.down_proj." in n for n in muon)
    assert "lm_head.weight" in adamw and "norm.weight" in adamw
    assert "embed_tokens.weight" not in muon | adamw  # frozen: in neither
    assert muon | adamw == {n for n, p in draft.named_parameters() if p.requires_grad}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == muon  # Muon's weight decay 0.1; AdamW's recipe default 0 (and norms never decay)


def test_muon_with_deepspeed_is_refused_with_the_settings(sharp_verifier, tiny_data, tmp_path):
    overrides = tiny_overrides(sharp_verifier, tiny_data, tmp_path / "run", "optim=muon", "deepspeed=zero2")
    with pytest.raises(SettingsError, match="optim=muon with DeepSpeed: .* deepspeed=none .* optim=adamw"):
        train_settings(compose(overrides))
    assert train_settings(compose(overrides[:-1])).optim.name == "muon"  # alone it is fine


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [r["train/loss"] for r in records(run_dir) if r["kind"] == "train"]


def draft_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step}" / "draft" / "model.safetensors"))


def test_muon_trains_and_resumes_exactly(sharp_verifier, tiny_data, tmp_path):
    common = (
        "optim=muon",
        "train.epochs=4",
        "train.save_every=4",
        "train.keep_checkpoints=8",
        "train.eval_every=4",
    )
    full = tmp_path / "full"
    train(compose(tiny_overrides(sharp_verifier, tiny_data, full, *common)), full)
    losses = train_losses(full)
    assert len(losses) == STEPS
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.85 * first  # it learns: the last epoch's mean loss against the first's
    evals = [r["eval/loss"] for r in records(full) if r["kind"] == "eval"]
    assert evals[-1] < evals[0]

    resumed = tmp_path / "resumed"
    start = full / "checkpoints" / "step-8"
    train(
        compose(tiny_overrides(sharp_verifier, tiny_data, resumed, *common, f"train.resume={start}")), resumed
    )
    assert train_losses(resumed) == losses[8:]
    reference, again = draft_weights(full, STEPS), draft_weights(resumed, STEPS)
    for name in reference:
        assert torch.equal(reference[name], again[name]), name


def test_adamw_runs_in_torchs_fused_kernel_unless_told_not_to():
    """``optim.fused`` null: the fused kernel where the parameters' device has one (the same update rule: a step of
    each matches the per-tensor loop's to float rounding); false: the loop; a meta-device model (the dry run's):
    never fused."""
    fused = make_optimizer(OptimSettings(), tiny_draft())
    looped = make_optimizer(OptimSettings(fused=False), tiny_draft())
    assert all(group["fused"] for group in fused.param_groups)
    assert not any(group["fused"] for group in looped.param_groups)
    with torch.device("meta"):
        meta = tiny_draft()
    assert not any(group["fused"] for group in make_optimizer(OptimSettings(), meta).param_groups)
    muon = make_optimizer(OptimSettings(name="muon"), tiny_draft())
    assert all(group["fused"] for group in muon.param_groups if not group["muon"])
    # one step from the same weights and gradients lands on the same weights
    torch.manual_seed(0)
    a = tiny_draft()
    b = tiny_draft()
    b.load_state_dict(a.state_dict())
    for model in (a, b):
        for p in model.parameters():
            p.grad = torch.ones_like(p) * 0.01
    make_optimizer(OptimSettings(), a).step()
    make_optimizer(OptimSettings(fused=False), b).step()
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, msg=name)
