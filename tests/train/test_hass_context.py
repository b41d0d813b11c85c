"""HASS's harmonized context alignment: with ``hass.detach_context`` the second TTT step's loss sends no
gradient back through the first step's output features (the draft is trained on its own features as inference
will feed them, not taught to change them); without it the gradient flows. Checked on the unroll itself and on
the model the trainer builds from the recipe."""

from __future__ import annotations

import pytest
import torch

from speculators.algorithms.eagle3.config import Eagle3Config
from speculators.algorithms.eagle3.model import Eagle3DraftModel
from tests.support.verifiers import tiny_verifier_config
from tests.train.conftest import compose, tiny_overrides
from train.trainer import Trainer, reset_distributed
from train.unroll import TTTDraft


def gradient_through_previous_step(model: TTTDraft) -> float:
    """|d loss(step 1) / d hidden output of step 0|: the size of the gradient that reaches step 0's output
    features from the second step's loss alone (0 when the unroll feeds them detached)."""
    config = model.draft.config
    gen = torch.Generator().manual_seed(0)
    length, width = 12, len(config.eagle_aux_hidden_state_layer_ids) * config.hidden_size
    ids = torch.randint(0, config.vocab_size, (1, length), generator=gen)
    aux = torch.randn(1, length, width, generator=gen)
    positions = torch.arange(length)[None]
    documents = torch.zeros(1, length, dtype=torch.long)
    outputs = []

    def keep_hidden(module, args, output):
        hidden = output[1]
        hidden.retain_grad()
        outputs.append(hidden)

    handle = model.draft.register_forward_hook(keep_hidden)
    try:
        logits = model(ids, aux, positions, documents, steps=2)
    finally:
        handle.remove()
    model.zero_grad()
    logits[1].float().pow(2).mean().backward()  # the second step's loss only
    grad = outputs[0].grad
    return 0.0 if grad is None else float(grad.abs().sum())


def tiny_draft() -> Eagle3DraftModel:
    verifier = tiny_verifier_config("llama", vocab_size=128).to_dict()
    torch.manual_seed(0)
    return Eagle3DraftModel(Eagle3Config.from_verifier(verifier, "tiny", draft_vocab_size=64))


@pytest.mark.parametrize("detach", [True, False])
def test_detached_context_stops_the_gradient_through_the_previous_step(detach):
    model = TTTDraft(tiny_draft(), steps=2, detach_context=detach, attention_backend="dense")
    gradient = gradient_through_previous_step(model)
    if detach:
        assert gradient == 0.0
    else:
        assert gradient > 0.0
    grads = [p.grad for p in model.draft.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)  # the draft itself still learns either way


@pytest.mark.parametrize(
    "recipe,extra,detached",
    [
        ("tiny_hass", [], True),
        ("tiny_hass", ["hass.detach_context=false"], False),
        ("tiny_eagle3", [], False),
    ],
)
def test_trainer_builds_the_unroll_the_recipe_asks_for(
    recipe, extra, detached, sharp_verifier, tiny_data, tmp_path
):
    overrides = tiny_overrides(sharp_verifier, tiny_data, tmp_path / "run", *extra)
    overrides[0] = f"recipe={recipe}"
    try:
        trainer = Trainer(compose(overrides), tmp_path / "run")
    except BaseException:
        reset_distributed()
        raise
    try:
        model = trainer.accelerator.unwrap_model(trainer.model)
        gradient = gradient_through_previous_step(model)
    finally:
        trainer.close()
        reset_distributed()
    assert (gradient == 0.0) is detached, gradient
