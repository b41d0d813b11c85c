"""Adapting a serving draft to traffic (issue 41), the training side: the parent's draft vocabulary kept
(``train.init_vocab=parent``), a seeded share of the original data replayed (``train.replay``), and per-token loss
weights applied at the token each (position, step) trains, x_{t+2+j}, for the EAGLE-3 family only."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from speculators import runs
from speculators.vocab import DraftVocab, build_draft_vocab
from tests.train.conftest import compose, tiny_overrides, write_features
from train.data import MicroBatch, pack_documents, training_loss_weight, truncated_document
from train.losses import element_terms, soft_cross_entropy, step_masks, step_terms
from train.objectives.eagle3 import topk_distillation
from train.replay import replay_count, replay_indices
from train.resume_guard import RESUME_MAY_CHANGE
from train.settings import SettingsError
from train.step_stats import StepStats
from train.trainer import DATA_SOURCES_NAME, Trainer, reset_distributed


def make_trainer(overrides: list[str], run_dir: Path) -> Trainer:
    try:
        return Trainer(compose(overrides), run_dir)
    except BaseException:
        reset_distributed()
        raise


def refused(overrides: list[str], run_dir: Path, error: type[Exception], match: str) -> str:
    """The one-line refusal a trainer set-up raises (the accelerator state is reset for the next test)."""
    with pytest.raises(error, match=match) as caught:
        make_trainer(overrides, run_dir)
    return str(caught.value)


# ---- data ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traffic_data(tmp_path_factory, sharp_verifier) -> Path:
    """Other samples than tiny_data (another seed): other assistant-token counts, as served traffic has."""
    return write_features(tmp_path_factory.mktemp("traffic"), sharp_verifier, 8, heldout_same=False, seed=7)


@pytest.fixture(scope="module")
def other_layers_data(tmp_path_factory, sharp_verifier) -> Path:
    """Features of other aux layers: unreadable beside tiny_data's."""
    return write_features(
        tmp_path_factory.mktemp("layers"), sharp_verifier, 4, heldout_same=True, seed=3, aux_layer_ids=[1, 3]
    )


@pytest.fixture(scope="module")
def parent_run(sharp_verifier, tiny_data, tmp_path_factory) -> Path:
    """A two-step EAGLE-3 run on tiny_data: the serving draft being adapted."""
    from train.trainer import train

    run_dir = tmp_path_factory.mktemp("parent") / "run"
    train(compose(tiny_overrides(sharp_verifier, tiny_data, run_dir, "train.max_steps=2")), run_dir)
    return run_dir


# ---- train.init_vocab ----------------------------------------------------------------------------------------
def test_init_vocab_parent_keeps_the_parents_d2t(parent_run, sharp_verifier, traffic_data, tmp_path):
    from data_gen.store import read_token_counts
    from speculators.algorithms.eagle3.model import Eagle3DraftModel

    parent = DraftVocab.load(parent_run / runs.DRAFT_VOCAB_NAME)
    counts, _ = read_token_counts(traffic_data)
    assert not torch.equal(
        build_draft_vocab(counts, 256).d2t, parent.d2t
    )  # the traffic would rebuild another
    run_dir = tmp_path / "adapted"
    overrides = tiny_overrides(
        sharp_verifier,
        traffic_data,
        run_dir,
        "train.max_steps=1",
        f"train.init_from={parent_run}",
        "train.init_vocab=parent",
        "model.draft_vocab_size=null",
    )
    trainer = make_trainer(overrides, run_dir)
    try:
        assert torch.equal(trainer.vocab.d2t, parent.d2t) and torch.equal(trainer.vocab.t2d, parent.t2d)
        draft = next(m for m in trainer.model.modules() if isinstance(m, Eagle3DraftModel))
        assert torch.equal(draft.d2t, parent.d2t)
        trainer.fit()
    finally:
        trainer.close()
    saved = DraftVocab.load(run_dir / runs.DRAFT_VOCAB_NAME)
    assert torch.equal(saved.d2t, parent.d2t)
    assert saved.provenance["vocab_source"] == "parent" and saved.provenance["parent"] == str(parent_run)
    trained = Eagle3DraftModel.from_pretrained(runs.resolve_draft_dir(run_dir))
    assert torch.equal(trained.d2t, parent.d2t)
    sources = json.loads((run_dir / DATA_SOURCES_NAME).read_text())
    assert sources["draft_vocab"]["source"] == "parent" and sources["draft_vocab"]["parent"] == str(
        parent_run
    )
    assert sources["replay"] is None and sources["loss_weights"] is False


def test_init_vocab_parent_reads_an_export_directory(parent_run, sharp_verifier, traffic_data, tmp_path):
    """A draft directory without its run (an export) gives its d2t/t2d buffers."""
    import shutil

    parent = DraftVocab.load(parent_run / runs.DRAFT_VOCAB_NAME)
    export = tmp_path / "export"
    shutil.copytree(runs.resolve_draft_dir(parent_run), export)
    overrides = tiny_overrides(
        sharp_verifier, traffic_data, tmp_path / "run", f"train.init_from={export}", "train.init_vocab=parent"
    )
    trainer = make_trainer(overrides, tmp_path / "run")
    try:
        assert torch.equal(trainer.vocab.d2t, parent.d2t)
        assert trainer.vocab.provenance["parent_vocab"].endswith("(d2t/t2d)")
    finally:
        trainer.close()


def test_init_vocab_data_refuses_a_parent_of_other_counts(parent_run, sharp_verifier, traffic_data, tmp_path):
    overrides = tiny_overrides(
        sharp_verifier, traffic_data, tmp_path / "run", f"train.init_from={parent_run}"
    )
    message = refused(overrides, tmp_path / "run", ValueError, "draft vocabulary differs")
    assert "train.init_vocab=parent" in message and "\n" not in message


def test_init_vocab_parent_refuses_another_size(parent_run, sharp_verifier, traffic_data, tmp_path):
    overrides = tiny_overrides(
        sharp_verifier,
        traffic_data,
        tmp_path / "run",
        f"train.init_from={parent_run}",
        "train.init_vocab=parent",
        "model.draft_vocab_size=128",
    )
    message = refused(overrides, tmp_path / "run", ValueError, "the parent .* has 256 draft tokens")
    assert "\n" not in message


def test_init_vocab_parent_needs_init_from(sharp_verifier, traffic_data, tmp_path):
    overrides = tiny_overrides(sharp_verifier, traffic_data, tmp_path / "run", "train.init_vocab=parent")
    with pytest.raises(SettingsError) as caught:
        compose_settings(overrides)
    assert caught.value.problems == [
        "train.init_vocab=parent needs train.init_from (the parent whose draft vocabulary is kept); set it or "
        "use train.init_vocab=data"
    ]


def test_vocabulary_source_and_replay_are_part_of_the_runs_identity():
    for key in ("train.init_vocab", "train.replay", "train.replay.data_dir", "train.replay.share"):
        assert not any(key == k or key.startswith(k + ".") for k in RESUME_MAY_CHANGE), key


def compose_settings(overrides: list[str]):
    from train.objectives import train_settings

    return train_settings(compose(overrides))


# ---- train.replay ------------------------------------------------------------------------------------------
def test_replay_adds_the_share_of_the_original_data(sharp_verifier, tiny_data, traffic_data, tmp_path):
    """share 0.2 of the mix with 8 traffic samples: 2 replayed samples, drawn from the seed; the batch plan sees
    10; validation stays the traffic's."""
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(
        sharp_verifier,
        traffic_data,
        run_dir,
        "train.max_steps=1",
        f"train.replay.data_dir={tiny_data}",
        "train.replay.share=0.2",
    )
    trainer = make_trainer(overrides, run_dir)
    try:
        train_set = trainer.features.train_set
        assert len(train_set) == 8 + 2 and trainer.plan.num_samples == 10
        chosen = replay_indices(8, 2, trainer.settings.seed)
        from data_gen.store import FeatureDataset

        original = FeatureDataset(tiny_data / "train")
        for offset, index in enumerate(chosen):
            assert train_set[8 + offset]["sample_id"] == original[index]["sample_id"]
        heldout_ids = {
            trainer.features.heldout_set[i]["sample_id"] for i in range(len(trainer.features.heldout_set))
        }
        assert all(
            sample_id.startswith("s8-") for sample_id in heldout_ids
        )  # traffic's held-out (seed 7 + 1)
        trainer.fit()
    finally:
        trainer.close()
    record = json.loads((run_dir / DATA_SOURCES_NAME).read_text())["replay"]
    assert record["replay_samples"] == 2 and record["primary_samples"] == 8 and not record["capped"]


def test_replay_count_is_the_share_of_the_mix_capped_by_the_directory():
    assert replay_count(8, 0.2, 100) == (2, False)
    assert replay_count(90, 0.1, 100) == (10, False)
    assert replay_count(8, 0.9, 8) == (8, True)
    assert replay_count(8, 0.0, 8) == (0, False)
    assert replay_indices(100, 5, 3) == replay_indices(100, 5, 3) != replay_indices(100, 5, 4)


def test_replay_of_other_aux_layers_is_refused_naming_it(
    sharp_verifier, tiny_data, other_layers_data, tmp_path
):
    overrides = tiny_overrides(
        sharp_verifier,
        tiny_data,
        tmp_path / "run",
        f"train.replay.data_dir={other_layers_data}",
        "train.replay.share=0.5",
    )
    message = refused(overrides, tmp_path / "run", ValueError, f"train.replay.data_dir={other_layers_data}")
    assert "aux_layer_ids" in message and "\n" not in message


def test_a_missing_replay_dir_is_refused(sharp_verifier, tiny_data, tmp_path):
    missing = tmp_path / "nowhere"
    overrides = tiny_overrides(
        sharp_verifier,
        tiny_data,
        tmp_path / "run",
        f"train.replay.data_dir={missing}",
        "train.replay.share=0.5",
    )
    refused(overrides, tmp_path / "run", FileNotFoundError, f"train.replay.data_dir={missing}")


def test_replay_is_refused_outside_offline_mode(sharp_verifier, tiny_data, tmp_path):
    overrides = tiny_overrides(
        sharp_verifier,
        tiny_data,
        tmp_path / "run",
        "train.data_mode=online",
        f"train.replay.data_dir={tiny_data}",
        "train.replay.share=0.5",
    )
    with pytest.raises(SettingsError, match="train.replay.data_dir with train.data_mode=online"):
        compose_settings(overrides)


# ---- per-token loss weights: the losses ----------------------------------------------------------------------
def weighted_case(steps: int = 3, length: int = 14, vocab: int = 10):
    """Random draft logits per step and verifier logits over one row: loss tokens after a 3-token prompt."""
    torch.manual_seed(0)
    draft = [torch.randn(1, length, vocab) for _ in range(steps)]
    verifier = torch.randn(1, length, vocab) * 3
    loss_mask = torch.ones(1, length, dtype=torch.bool)
    loss_mask[0, :3] = False
    masks = step_masks(loss_mask, torch.zeros(1, length, dtype=torch.long), verifier.argmax(-1), steps)
    return draft, verifier, loss_mask, masks


def test_all_ones_weights_give_the_unweighted_loss_exactly():
    draft, verifier, loss_mask, masks = weighted_case()
    ones = loss_mask.float()
    topk = partial(topk_distillation, k=3)
    for j, logits in enumerate(draft):
        plain = step_terms(logits, verifier, masks, j, topk)
        weighted = step_terms(logits, verifier, masks, j, topk, ones)
        assert torch.equal(plain.ce, weighted.ce) and torch.equal(plain.topk, weighted.topk)


def test_a_weight_changes_the_loss_by_the_ce_of_the_positions_that_train_its_token():
    """Token s weighs w: at step j only position t = s-2-j trains it, so the step's CE sum grows by exactly
    (w - 1) · CE(t, j); a weight read at t (no shift) would change other positions."""
    draft, verifier, loss_mask, masks = weighted_case()
    s, w = 9, 3.0
    weights = loss_mask.float()
    weights[0, s] = w
    for j, logits in enumerate(draft):
        t = s - 2 - j
        assert masks.trained[j, 0, t]
        plain = step_terms(logits, verifier, masks, j).ce
        weighted = step_terms(logits, verifier, masks, j, None, weights).ce
        ce_at = soft_cross_entropy(logits[0, t][None], verifier[0, t + 1 + j][None])[0]
        torch.testing.assert_close(weighted - plain, (w - 1) * ce_at)
        unshifted = soft_cross_entropy(logits[0, s][None], verifier[0, s + 1 + j][None])[0]
        assert not torch.allclose(weighted - plain, (w - 1) * unshifted)


def test_the_extra_row_term_is_weighted_like_the_ce():
    draft, verifier, loss_mask, masks = weighted_case()
    weights = loss_mask.float()
    weights[0, 8] = 2.0
    topk = partial(topk_distillation, k=3)
    j, t = 1, 8 - 3
    plain = step_terms(draft[j], verifier, masks, j, topk).topk
    weighted = step_terms(draft[j], verifier, masks, j, topk, weights).topk
    top_at = topk_distillation(draft[j][0, t][None], verifier[0, t + 1 + j][None], 3)[0]
    torch.testing.assert_close(weighted - plain, top_at)


def test_element_terms_weigh_as_step_terms():
    """P-EAGLE's sampled depths: logits computed only at the step's valid elements give the same weighted sums."""
    draft, verifier, loss_mask, masks = weighted_case()
    weights = loss_mask.float() * torch.linspace(0.5, 2.0, loss_mask.shape[1])
    for j, logits in enumerate(draft):
        elements = masks.valid[j].flatten().nonzero().flatten()
        flat = logits.reshape(-1, logits.shape[-1])[elements]
        dense = step_terms(logits, verifier, masks, j, None, weights)
        sparse = element_terms(flat, elements, verifier, masks, j, None, weights)
        torch.testing.assert_close(dense.ce, sparse.ce)


# ---- per-token loss weights: the batches -------------------------------------------------------------------
def sample(length: int, weight: torch.Tensor | None = None) -> dict:
    mask = torch.zeros(length, dtype=torch.bool)
    mask[2:] = True
    doc = {"input_ids": torch.arange(length), "loss_mask": mask, "aux_hidden": torch.zeros(length, 4)}
    if weight is not None:
        doc["loss_weight"] = weight
    return doc


def test_packing_carries_weights_and_fills_documents_without_them():
    weight = torch.tensor([0.0, 0.0, 2.0, 0.5, 0.5])
    assert torch.equal(truncated_document(sample(5, weight), 4)["loss_weight"], weight[:4])
    batch = pack_documents([sample(5, weight), sample(3)], max_length=8, packing=True)
    assert batch.loss_weight.dtype == torch.float32
    assert batch.loss_weight[0].tolist() == [0.0, 0.0, 2.0, 0.5, 0.5, 0.0, 0.0, 1.0]
    assert pack_documents([sample(5), sample(3)], max_length=8, packing=True).loss_weight is None
    moved = batch.to("cpu")
    assert isinstance(moved, MicroBatch) and torch.equal(moved.loss_weight, batch.loss_weight)


def test_loss_positions_all_weighs_non_assistant_tokens_one():
    weight = torch.tensor([0.0, 0.0, 2.0, 0.5, 0.5])
    batch = pack_documents([sample(5, weight)], max_length=8, packing=True)
    assert training_loss_weight(batch)[0].tolist() == [1.0, 1.0, 2.0, 0.5, 0.5]
    assert training_loss_weight(pack_documents([sample(5)], 8, True)) is None


# ---- per-token loss weights: through the objectives ----------------------------------------------------------
def weighted_batch(trainer: Trainer, weights_of) -> MicroBatch:
    """The first two training samples with hand-made loss weights, as the trainer's collate packs them."""
    features = trainer.features
    samples = []
    for i in range(2):
        item = dict(features.train_set[i])
        item["loss_weight"] = weights_of(item["loss_mask"])
        samples.append(item)
    return features.batch(features.collate(samples))


def objective_loss(trainer: Trainer, batch: MicroBatch) -> torch.Tensor:
    plan = trainer.objective.plan(batch, batch.loss_mask, trainer.head, seed=0)
    trained = plan.masks.trained.sum((1, 2)).double().clamp_min(1)
    stats = StepStats(trainer.steps, trainer.device)
    return trainer.objective.loss(trainer.model, batch, plan, trainer.head, trained, stats)


@pytest.mark.parametrize("recipe", ["tiny_eagle3", "tiny_peagle"])
def test_the_eagle3_family_applies_the_weights(recipe, sharp_verifier, tiny_data, tmp_path):
    overrides = tiny_overrides(sharp_verifier, tiny_data, tmp_path / "run")
    overrides[0] = f"recipe={recipe}"
    trainer = make_trainer(overrides, tmp_path / "run")
    try:
        plain = weighted_batch(trainer, lambda mask: None)
        ones = weighted_batch(trainer, lambda mask: mask.float())
        doubled = weighted_batch(trainer, lambda mask: mask.float() * 2)
        assert plain.loss_weight is None and ones.loss_weight is not None
        with torch.no_grad():
            base = objective_loss(trainer, plain)
            assert torch.equal(objective_loss(trainer, ones), base)
            torch.testing.assert_close(objective_loss(trainer, doubled), 2 * base)
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def weighted_data(tmp_path_factory, tiny_data) -> Path:
    """tiny_data with loss weights in its second training shard only (samples 4-7; a directory may hold them in
    some shards only): 3.0 on every third loss token, renormalised to mean 1 over the sample's loss tokens."""
    import shutil

    from data_gen.store import FeatureDataset, Sample, finalize_split, read_manifest, write_shard

    data = tmp_path_factory.mktemp("weighted") / "data"
    shutil.copytree(tiny_data, data)
    manifest = read_manifest(data / "train")
    source = FeatureDataset(tiny_data / "train")
    rows = []
    for i in range(4, 8):
        item = source[i]
        weight = item["loss_mask"].float()
        weight[item["loss_mask"].nonzero().flatten()[::3]] = 3.0
        weight = weight / weight[item["loss_mask"]].mean() * item["loss_mask"]
        fields = ("sample_id", "input_ids", "loss_mask", "aux_hidden", "last_hidden")
        rows.append(Sample(*(item[k] for k in fields), loss_weight=weight))
    write_shard(data / "train", 1, rows, len(manifest["aux_layer_ids"]), manifest["storage_dtype"])
    computed = (
        "format",
        "format_version",
        "split",
        "num_shards",
        "num_samples",
        "num_tokens",
        "num_loss_tokens",
    )
    header = {k: v for k, v in manifest.items() if k not in (*computed, "bytes", "shards")}
    finalize_split(data / "train", 2, header)
    return data


def test_weighted_data_trains_the_eagle3_family_and_says_so(sharp_verifier, weighted_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    trainer = make_trainer(
        tiny_overrides(sharp_verifier, weighted_data, run_dir, "train.max_steps=1"), run_dir
    )
    try:
        assert trainer.loss_weights is True
        assert (
            "loss_weight" not in trainer.features.train_set[0]
            and "loss_weight" in trainer.features.train_set[4]
        )
        trainer.fit()
    finally:
        trainer.close()
    assert "per-token loss weights" in capsys.readouterr().out
    assert json.loads((run_dir / DATA_SOURCES_NAME).read_text())["loss_weights"] is True


@pytest.mark.parametrize("recipe", ["tiny_dflash", "tiny_mtp"])
def test_objectives_outside_the_eagle3_family_refuse_weighted_data(
    recipe, sharp_verifier, weighted_data, tmp_path
):
    """DFlash (and every block drafter) and MTP would ignore the weights: the run stops in one line instead."""
    # MTP's tiny recipe names its Qwen3-Next verifier's layer; the refusal comes before any verifier layer is read
    overrides = tiny_overrides(sharp_verifier, weighted_data, tmp_path / "run", "verifier.aux_layer_ids=null")
    overrides[0] = f"recipe={recipe}"
    algorithm = recipe.removeprefix("tiny_")
    message = refused(overrides, tmp_path / "run", ValueError, f"train.algorithm={algorithm} cannot use them")
    assert "EAGLE-3 family" in message and "\n" not in message
