"""``model.fc_init=feature_rms``: the data-dependent fc init that keeps a few massive feature dimensions from
drowning every other one (train/assemble.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.algorithms.eagle3.model import Eagle3DraftModel
from tests.train.conftest import compose, tiny_overrides
from train.assemble import scale_fc_by_feature_rms
from train.trainer import Trainer, reset_distributed


def small_draft() -> Eagle3DraftModel:
    verifier = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 8,
        "vocab_size": 128,
        "intermediate_size": 128,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
    }
    torch.manual_seed(0)
    return Eagle3DraftModel(Eagle3Config.from_verifier(verifier, name_or_path="tiny", torch_dtype="float32"))


def mean_cosine(x: torch.Tensor) -> float:
    """Mean pairwise cosine similarity of the rows of ``x`` (1.0: every position looks the same)."""
    unit = F.normalize(x, dim=-1)
    sims = unit @ unit.T
    n = x.shape[0]
    return float((sims.sum() - n) / (n * (n - 1)))


def test_massive_dimensions_no_longer_drown_the_features():
    draft = small_draft()
    features = torch.randn(64, 3 * 64)
    features[:, [5, 70, 150]] += 300.0  # a few near-constant massive activations, as in Llama-family states
    norm = draft.layers[0].hidden_norm
    with torch.no_grad():
        before = mean_cosine(norm(draft.project_features(features)))
        scale_fc_by_feature_rms(draft, features.pow(2).mean(0).sqrt())
        after = mean_cosine(norm(draft.project_features(features)))
    assert before > 0.9  # default init: the draft's input feature is nearly the same vector at every position
    assert after < 0.3  # scaled: the token-specific dimensions carry the feature


def test_trainer_scales_fc_from_the_training_features(sharp_verifier, tiny_data, tmp_path):
    def fc_weight(*extra: str) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            trainer = Trainer(
                compose(tiny_overrides(sharp_verifier, tiny_data, tmp_path / "run", *extra)), tmp_path
            )
        except BaseException:
            reset_distributed()
            raise
        try:
            rms = trainer.features.feature_rms()
            return trainer.accelerator.unwrap_model(trainer.model).draft.fc.weight.detach().clone(), rms
        finally:
            trainer.close()
            reset_distributed()

    default, rms = fc_weight()
    scaled, _ = fc_weight("model.fc_init=feature_rms")
    torch.testing.assert_close(
        scaled, default / rms
    )  # same seed: the default init, column by column over RMS
    resuming, _ = fc_weight("model.fc_init=feature_rms", f"train.resume={tmp_path / 'step-5'}")
    torch.testing.assert_close(resuming, default)  # a resumed run loads its fc: the data pass is skipped
    with pytest.raises(ValueError, match="model.fc_init='orthogonal'"):
        fc_weight("model.fc_init=orthogonal")
