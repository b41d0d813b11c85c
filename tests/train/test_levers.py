"""Two training levers (issue 14): ``model.warm_start=top_layer`` starts the draft from the verifier's top layer(s)
(train/assemble.py), and ``train.loss_positions=all`` trains on every real token while validation stays on
assistant tokens (train/data.py, train/trainer.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.algorithms.eagle3.model import Eagle3DraftModel
from tests.support.verifiers import build_tiny_verifier, tiny_verifier_config
from tests.train.conftest import compose, tiny_overrides
from train.assemble import warm_start_from_verifier
from train.data import training_loss_mask
from train.evaluation import evaluate
from train.step_stats import StepStats
from train.trainer import Trainer, reset_distributed


def make_trainer(verifier: Path, data: Path, tmp_path: Path, *extra: str) -> Trainer:
    try:
        return Trainer(compose(tiny_overrides(verifier, data, tmp_path / "run", *extra)), tmp_path)
    except BaseException:
        reset_distributed()
        raise


def verifier_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


# ---- warm start ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_warm_start_copies_the_verifiers_top_layers(tmp_path, arch, num_layers):
    verifier_dir = build_tiny_verifier(tmp_path / arch, arch=arch, vocab_size=128)
    config = Eagle3Config.from_verifier(
        tiny_verifier_config(arch, vocab_size=128).to_dict(), str(verifier_dir), num_layers=num_layers
    )
    draft = Eagle3DraftModel(config)
    fc_before = draft.fc.weight.detach().clone()
    warm_start_from_verifier(draft, str(verifier_dir))
    theirs = verifier_tensors(verifier_dir)
    top = 8 - num_layers  # the tiny verifier has 8 layers: the draft takes the last num_layers, in order
    for offset, layer in enumerate(draft.layers):
        prefix = f"model.layers.{top + offset}."
        for name, tensor in layer.state_dict().items():
            if name == "hidden_norm.weight":
                assert torch.equal(tensor, torch.ones_like(tensor))  # the draft's residual is not re-scaled
            elif offset == 0 and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
                weight, gain = theirs[prefix + name], theirs[prefix + "input_layernorm.weight"]
                embed_half, hidden_half = tensor.split(tensor.shape[1] // 2, dim=1)
                torch.testing.assert_close(embed_half, weight / math.sqrt(2))
                torch.testing.assert_close(hidden_half, weight * gain / math.sqrt(2))
            else:
                assert torch.equal(tensor, theirs[prefix + name]), prefix + name
    assert torch.equal(draft.norm.weight, torch.ones_like(draft.norm.weight))  # a copied norm over-sharpens
    assert torch.equal(draft.fc.weight, fc_before)  # fc keeps model.fc_init's init


def test_warm_start_refuses_a_draft_deeper_than_the_verifier(tmp_path):
    verifier_dir = build_tiny_verifier(tmp_path / "v", vocab_size=128, num_hidden_layers=4)
    config = Eagle3Config.from_verifier(
        tiny_verifier_config("llama", vocab_size=128, num_hidden_layers=4).to_dict(),
        str(verifier_dir),
        num_layers=5,
    )
    with pytest.raises(ValueError, match="the draft has 5 layers but .* only 4"):
        warm_start_from_verifier(Eagle3DraftModel(config), str(verifier_dir))


def test_the_trainer_warm_starts_only_when_asked(sharp_verifier, tiny_data, tmp_path):
    theirs = verifier_tensors(sharp_verifier)
    drafts = {}
    for setting in ("none", "top_layer"):
        trainer = make_trainer(sharp_verifier, tiny_data, tmp_path / setting, f"model.warm_start={setting}")
        try:
            draft = trainer.accelerator.unwrap_model(trainer.model).draft
            drafts[setting] = {k: v.detach().clone() for k, v in draft.state_dict().items()}
            head_rows = trainer.head.draft_weight.detach().clone()
            residual_rms = trainer.features.residual_rms()
            torch.manual_seed(trainer.settings.seed)
            fresh = Eagle3DraftModel(trainer.draft_config).state_dict()
        finally:
            trainer.close()
            reset_distributed()
    off, on = drafts["none"], drafts["top_layer"]
    # off: today's init, bit for bit (the seeded random layer and fc, the verifier's head rows)
    for name, tensor in fresh.items():
        if name.startswith(("layers.", "fc.", "norm.")):
            assert torch.equal(off[name], tensor), name
    assert torch.equal(off["lm_head.weight"], head_rows) and torch.equal(on["lm_head.weight"], head_rows)
    # on: the verifier's top layer (the sharp verifier has 8), its residual writes divided by the
    # RMS of the verifier's residual stream (the draft's residual has RMS 1); everything else as with off
    assert abs(residual_rms - 1.0) > 0.1  # the division shows
    for name in ("mlp.down_proj.weight", "self_attn.o_proj.weight"):
        torch.testing.assert_close(on[f"layers.0.{name}"], theirs[f"model.layers.7.{name}"] / residual_rms)
    assert torch.equal(on["layers.0.mlp.up_proj.weight"], theirs["model.layers.7.mlp.up_proj.weight"])
    assert torch.equal(on["norm.weight"], off["norm.weight"])
    assert not torch.equal(on["layers.0.mlp.up_proj.weight"], off["layers.0.mlp.up_proj.weight"])
    assert torch.equal(on["fc.weight"], off["fc.weight"]) and torch.equal(on["d2t"], off["d2t"])
    with pytest.raises(ValueError, match="model.warm_start='random'"):
        make_trainer(sharp_verifier, tiny_data, tmp_path / "bad", "model.warm_start=random")
    reset_distributed()


# ---- a frozen lm_head -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["tiny_eagle3", "tiny_peagle"])
def test_a_frozen_lm_head_keeps_the_verifiers_rows_while_the_rest_trains(
    sharp_verifier, tiny_data, tmp_path, recipe
):
    overrides = tiny_overrides(sharp_verifier, tiny_data, tmp_path / "run", "model.train_lm_head=false")
    overrides = [f"recipe={recipe}" if o.startswith("recipe=") else o for o in overrides]
    try:
        trainer = Trainer(compose([*overrides, "train.max_steps=3"]), tmp_path)
    except BaseException:
        reset_distributed()
        raise
    try:
        draft = trainer.accelerator.unwrap_model(trainer.model).draft
        head_rows = trainer.head.draft_weight.detach().clone()
        fc_before = draft.fc.weight.detach().clone()
        trainer.fit()
        assert torch.equal(draft.lm_head.weight.detach(), head_rows.to(draft.lm_head.weight.dtype))
        assert not torch.equal(draft.fc.weight.detach(), fc_before)  # the rest trained
        trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
        assert id(draft.lm_head.weight) not in trained
    finally:
        trainer.close()
        reset_distributed()
    with pytest.raises(ValueError, match="freeze a random lm_head"):
        make_trainer(
            sharp_verifier,
            tiny_data,
            tmp_path / "bad",
            "model.train_lm_head=false",
            "model.init_lm_head_from_verifier=false",
        )
    reset_distributed()


# ---- which positions carry the loss --------------------------------------------------------------------------
def test_all_positions_train_on_every_real_token_and_validation_is_unchanged(
    sharp_verifier, tiny_data, tmp_path
):
    seen = {}
    for setting in ("assistant", "all"):
        trainer = make_trainer(
            sharp_verifier, tiny_data, tmp_path / setting, f"train.loss_positions={setting}"
        )
        try:
            samples = [trainer.features.train_set[i] for i in range(4)]
            batch = trainer.features.batch(trainer.features.collate(samples))
            stats = StepStats(trainer.steps, trainer.device)
            trainer._train_step([trainer.features.collate(samples)], stats, 0)
            metrics = evaluate(
                trainer.accelerator,
                trainer.model,
                trainer.objective,
                trainer.head,
                trainer.features.eval_batches(),
                trainer.steps,
            )
            seen[setting] = (stats.valid.clone(), metrics, batch)
        finally:
            trainer.close()
            reset_distributed()
    (assistant_valid, assistant_eval, batch), (all_valid, all_eval, _) = seen["assistant"], seen["all"]
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    # step j trains position t when token t+2+j is in the same document: every document gives len - 2 - j
    assert all_valid.tolist() == [sum(n - 2 - j for n in lengths) for j in range(len(all_valid))]
    assert (all_valid > assistant_valid).all()  # the prompts are not assistant text: more positions trained
    assert torch.equal(training_loss_mask(batch, "all"), batch.document_ids >= 0)
    assert torch.equal(training_loss_mask(batch, "assistant"), batch.loss_mask)
    # validation counts assistant positions only, whatever the training setting
    assert all_eval["eval/positions"] == assistant_eval["eval/positions"] > 0
    with pytest.raises(ValueError, match="train.loss_positions='user'"):
        make_trainer(sharp_verifier, tiny_data, tmp_path / "bad", "train.loss_positions=user")
    reset_distributed()


# ---- out-of-vocab targets kept: no full-vocabulary argmax while training ------------------------------------
def test_training_that_keeps_out_of_vocab_targets_skips_the_full_vocab_argmax(
    sharp_verifier, tiny_data, tmp_path, monkeypatch
):
    """With ``train.mask_out_of_vocab=false`` a training step scores agreement with the verifier's best draft-vocab
    token (no full-vocabulary matmul); evaluation still takes the verifier's own
    argmax, so the simulated acceptance length is the exact one."""
    from train.targets import TargetHead, target_draft_ids

    phase, calls, seen = {"now": "train"}, {"train": 0, "eval": 0}, []
    original = TargetHead.argmax

    def counted(self, last_hidden, *args, **kwargs):
        calls[phase["now"]] += 1
        seen.append(last_hidden)
        return original(self, last_hidden, *args, **kwargs)

    monkeypatch.setattr(TargetHead, "argmax", counted)
    trainer = make_trainer(
        sharp_verifier, tiny_data, tmp_path, "train.mask_out_of_vocab=false", "train.max_steps=3"
    )
    try:
        evaluate = trainer.objective.evaluate

        def evaluating(*args, **kwargs):
            phase["now"] = "eval"
            try:
                return evaluate(*args, **kwargs)
            finally:
                phase["now"] = "train"

        monkeypatch.setattr(trainer.objective, "evaluate", evaluating)
        trainer.fit()
        assert calls["train"] == 0 and calls["eval"] > 0
        head = trainer.head
        assert not head.full_vocab  # 256 of the verifier's 512 tokens
        # the held-out states, and random ones (whose argmax often falls outside the draft vocabulary)
        hidden = torch.cat([seen[0].reshape(-1, seen[0].shape[-1]), 8 * torch.randn(256, seen[0].shape[-1])])
        needed = torch.ones(len(hidden), 1, dtype=torch.bool)
        cheap = target_draft_ids(head, hidden[:, None], needed, within_draft_vocab=True)
        exact = target_draft_ids(head, hidden[:, None], needed)
        # where the verifier's argmax is a draft token the two agree; elsewhere the cheap one still names a token
        inside = exact >= 0
        assert inside.any() and (~inside).any()
        assert torch.equal(cheap[inside], exact[inside]) and (cheap >= 0).all()
    finally:
        trainer.close()
        reset_distributed()
