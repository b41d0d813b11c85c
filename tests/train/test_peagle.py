"""P-EAGLE training end to end in one process: COD chains sampled reproducibly with speculators' depth sizes, a
training forward whose depths are exactly what one inference forward (vLLM's parallel-drafting layout) computes,
a draft that learns to propose several tokens per forward, and a checkpoint that our validator and speculators
0.9.0 accept."""

from __future__ import annotations

import json

import pytest
import torch

from speculators import algorithms
from speculators.algorithms.peagle.config import PEagleConfig
from speculators.algorithms.peagle.model import PEagleDraftModel
from speculators.format.validate import errors, validate_checkpoint
from speculators.models.layers import causal_attend
from speculators.runs import read_best, resolve_draft_dir
from tests.conftest import require_consumer
from tests.train.conftest import compose, tiny_overrides
from train.losses import shift_left
from train.objectives.peagle import ParallelDraft, cod_depth_size, sample_cod
from train.trainer import train

DEPTHS = 3


@pytest.fixture(scope="module")
def peagle_run(sharp_verifier, tiny_data, tmp_path_factory):
    """One overfit run of recipe tiny_peagle (K = 3): its run directory."""
    run_dir = tmp_path_factory.mktemp("peagle") / "run"
    overrides = tiny_overrides(
        sharp_verifier, tiny_data, run_dir, "train.epochs=40", "train.micro_batch_size=8"
    )
    overrides[0] = "recipe=tiny_peagle"
    overrides += ["train.eval_every=20", "optim.lr=5e-3", "model.init_lm_head_from_verifier=false"]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(compose(overrides), run_dir)
    finally:
        torch.set_num_threads(before)
    return run_dir


def test_peagle_learns_parallel_depths_and_writes_a_valid_checkpoint(peagle_run):
    best = read_best(peagle_run)
    ceiling = best["metrics"]["eval/acceptance_length_max"]
    assert ceiling > 3.5  # three depths: three draft tokens per forward
    # untrained depths score ~1.0; the mask slots have no verifier feature, so depth >= 1 is harder than TTT's
    assert (best["acceptance_length"] - 1) / (ceiling - 1) > 0.4, best
    # depth 1 (a mask slot) learned, not only depth 0
    assert best["metrics"]["eval/accept_rate_1"] > 0.3, best
    draft_dir = resolve_draft_dir(peagle_run)
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DEPTHS
    assert isinstance(config["mask_token_id"], int) and config["norm_before_residual"] is True
    # the sharp verifier has no tokenizer: the mask id is one the data never contains, and the config says why
    assert "never occurs in the training data" in config["mask_token_source"]
    problems = errors(validate_checkpoint(draft_dir))
    assert not problems, problems
    model = algorithms.load_draft(draft_dir)
    assert isinstance(model, PEagleDraftModel) and model.mask_hidden.shape == (1, 1, 3 * 64)
    assert model.embed_tokens.weight.requires_grad  # embed_requires_grad: the mask row is learned
    assert algorithms.get("peagle").vllm_speculative_config(draft_dir, config, DEPTHS) == {
        "method": "eagle3",
        "model": str(draft_dir),
        "num_speculative_tokens": DEPTHS,
        "parallel_drafting": True,
    }


def test_export_writes_a_validated_bf16_peagle_directory(peagle_run, tmp_path):
    from speculators.export.exporter import export_checkpoint
    from speculators.format.checkpoint import load_checkpoint

    result = export_checkpoint(peagle_run, tmp_path / "export")
    assert not errors(result.findings), result.findings
    config, tensors = load_checkpoint(tmp_path / "export")
    trained = json.loads((resolve_draft_dir(peagle_run) / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["torch_dtype"] == "bfloat16"
    assert config["mask_token_id"] == trained["mask_token_id"]
    assert tensors["mask_hidden"].shape == (1, 1, 3 * 64) and tensors["mask_hidden"].dtype == torch.bfloat16
    assert set(tensors) == set(algorithms.get("peagle").expected_shapes(config))


def test_validator_names_what_vllm_would_do_with_a_bad_peagle_config(peagle_run):
    config = json.loads((resolve_draft_dir(peagle_run) / "config.json").read_text())
    rules = algorithms.get("peagle").config_rules
    assert list(rules(config)) == []
    assert any("KeyError" in e for e in rules({k: v for k, v in config.items() if k != "mask_token_id"}))
    assert any("must be an integer" in e for e in rules({**config, "mask_token_id": None}))
    assert any("outside the verifier vocabulary" in e for e in rules({**config, "mask_token_id": 512}))
    assert any("fc_norm" in e for e in rules({**config, "fc_norm": True}))
    two_aux = {**config, "eagle_aux_hidden_state_layer_ids": [2, 4]}
    assert any("assumes 3" in e for e in rules(two_aux))


def test_cod_sampling_is_reproducible_with_speculators_depth_sizes():
    depths, rows, length = 4, 2, 300
    trained = torch.ones(depths, rows, length, dtype=torch.bool)
    chosen = sample_cod(trained, max_anchors=100, seed=3)
    assert torch.equal(chosen, sample_cod(trained, max_anchors=100, seed=3))
    assert not torch.equal(chosen, sample_cod(trained, max_anchors=100, seed=4))
    sizes = [int(chosen[d].sum()) for d in range(depths)]
    # depth 0 everywhere; depth d: int((seeds - d) * max(0.7^d, 0.2)) of the 100 seeds
    assert sizes == [rows * length, 69, 48, 33]
    assert sizes[1:] == [cod_depth_size(100, d) for d in (1, 2, 3)]
    # chains are prefix-closed: a trained depth's chain was trained one depth lower
    for depth in range(2, depths):
        assert bool((chosen[depth] <= chosen[depth - 1]).all())
    # a depth without targets at the chain's anchor stops that chain; fewer survivors than the size keeps them all
    sparse = trained.clone()
    sparse[2, :, ::2] = False
    chosen = sample_cod(sparse, max_anchors=10_000, seed=0)
    assert not bool((chosen[2] & ~sparse[2]).any()) and not bool((chosen[3] & ~chosen[2]).any())
    assert int(chosen[1].sum()) == cod_depth_size(rows * length, 1)
    assert int(sample_cod(trained[:1], 5, 0).sum()) == rows * length  # K = 1: depth 0 only


def test_training_depths_equal_one_inference_forward(tiny_llama_dir):
    """Depth d at anchor t of the training forward equals slot d of vLLM's parallel-drafting forward: a plain
    causal pass over the accepted prefix (token x_{p+1}, feature fc(aux(p)) at every p <= t) followed by K-1 mask
    slots at t+1..t+K-1 carrying fc(mask_hidden)."""
    verifier = json.loads((tiny_llama_dir / "config.json").read_text())
    config = PEagleConfig.from_verifier(
        verifier, str(tiny_llama_dir), mask_token_id=7, speculative_tokens=4, num_layers=2
    )
    torch.manual_seed(0)
    draft = PEagleDraftModel(config).eval()
    length, width = 40, 3 * config.hidden_size
    ids = torch.randint(0, config.vocab_size, (1, length))
    aux = torch.randn(1, length, width)
    positions = torch.arange(length)[None]
    documents = torch.zeros(1, length, dtype=torch.long)
    with torch.no_grad():
        parallel = ParallelDraft(draft, 4, attention_backend="chunked", chunk_size=16)
        dense = parallel(ids, aux, positions, documents)
        features, bonus = draft.project_features(aux), shift_left(ids, 1)
        for t in (0, 5, 21, 35):
            prefix_ids, prefix_features = bonus[:, : t + 1], features[:, : t + 1]
            masks = torch.full((1, 3), config.mask_token_id)
            slot_features = draft.mask_feature().expand(1, 3, -1)
            logits, _ = draft(
                torch.cat([prefix_ids, masks], 1),
                torch.cat([prefix_features, slot_features], 1),
                torch.arange(t + 4)[None],
                causal_attend,
            )
            for depth in range(4):
                assert torch.allclose(logits[0, t + depth], dense[depth][0, t], atol=1e-4), (t, depth)


def test_speculators_package_loads_our_peagle_checkpoint(peagle_run):
    """speculators==0.9.0 (its own virtualenv) loads the draft as its PEagleDraftModel with exactly our weights."""
    from safetensors.torch import load_file

    from speculators.serving import speculators_package as package

    require_consumer(package.speculators_package_available(), "the speculators virtualenv", "speculators-env")
    draft_dir = resolve_draft_dir(peagle_run)
    loaded = package.load_with_speculators_package(draft_dir)
    assert loaded["ok"] and loaded["speculators_version"] == "0.9.0"
    assert loaded["class"].endswith("PEagleDraftModel") and loaded["config_class"] == "PEagleSpeculatorConfig"
    assert loaded["speculative_tokens"] == [DEPTHS] and loaded["norm_before_residual"] is True
    tensors = load_file(str(draft_dir / "model.safetensors"))
    missing = sorted(set(tensors) - set(loaded["tensors"]))
    assert missing == [], missing
    for name, tensor in tensors.items():  # the trained embedding and mask_hidden included
        assert loaded["tensors"][name]["sha256"] == package.tensor_digest(tensor), name
