"""``speculators convert`` reads what speculators 0.9.0 really writes for P-EAGLE, DSpark and DFlash2: each draft is built
and saved by the package's own training-time constructor (in its virtualenv, tiny: one layer over SmolLM2), run
there through its own forward on verifier states, converted by us, validated, and our model then computes the
package's logits on the same inputs. Each test has a control: one tensor mis-mapped (the aux blocks of
``mask_hidden`` / ``fc`` in another order) gives other logits, so the equality is not an accident of the inputs."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from speculators.algorithms import load_draft
from speculators.export import ExportWarning, convert_checkpoint
from speculators.export.tensors import permute_aux_blocks
from speculators.format import validate_checkpoint
from speculators.format.checkpoint import load_tensors
from speculators.format.validate import errors
from tests.conftest import require_consumer
from tests.support.dflash import context_hidden, context_logits

pytestmark = pytest.mark.consumer
AUX_IDS = [2, 15, 27]  # vLLM's convention for SmolLM2's 30 layers: the stream entering each layer
MASK_ID = 3
LENGTH = 24


@pytest.fixture(scope="module")
def verifier_states(smollm2_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token ids [1, T], concatenated aux states [1, T, 3 * 576])`` of SmolLM2 on random tokens."""
    from transformers import AutoModelForCausalLM

    from speculators.serving import speculators_package_available

    require_consumer(speculators_package_available(), "the speculators virtualenv", "speculators-env")
    verifier = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = torch.randint(20, 4000, (1, LENGTH), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        states = verifier(ids, output_hidden_states=True).hidden_states
    return ids, torch.cat([states[k] for k in AUX_IDS], dim=-1)


def peer_spec(kind: str, verifier: Path, **own) -> dict:
    """What the package's trainer would be asked for (speculators_package_worker.build_peer_draft)."""
    return {
        "type": kind, "verifier": str(verifier), "num_layers": 1, "target_layer_ids": AUX_IDS,
        "mask_token_id": MASK_ID, "draft_vocab_size": 4096, "seed": 3, **own,
    }  # fmt: skip


def convert_and_validate(source: Path, out: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        result = convert_checkpoint(source, out, dtype="float32")
    assert result.layout == "speculators"
    assert not errors(validate_checkpoint(out)), validate_checkpoint(out)


# ---- P-EAGLE -------------------------------------------------------------------------------------------------
def cod_elements() -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor, depth) elements as COD lays them out: depth 0 at every position, then chains from three seeds."""
    anchors, depths = [torch.arange(LENGTH)], [torch.zeros(LENGTH, dtype=torch.long)]
    for depth in range(1, 4):
        seeds = torch.tensor([3, 9, 14] if depth < 3 else [9])
        anchors.append(seeds)
        depths.append(torch.full_like(seeds, depth))
    return torch.cat(anchors), torch.cat(depths)


def our_peagle_logits(model, ids: torch.Tensor, aux: torch.Tensor, anchors, depths) -> torch.Tensor:
    """Our P-EAGLE draft on the same elements: depth 0 reads the token and states of its anchor, depth d >= 1 the
    mask token and ``fc(mask_hidden)``, at position anchor + d; an element sees the depth-0 elements of anchors
    up to its own and its own chain up to its depth (the package's mask, one document)."""
    mask_ids, mask_features = model.mask_slots((len(anchors),), aux)
    real = depths == 0
    tokens = torch.where(real, ids[0, anchors], mask_ids)
    features = torch.where(real[:, None], model.project_features(aux[0, anchors]), mask_features)
    visible = (depths[None] == 0) & (anchors[None] <= anchors[:, None])
    visible |= (anchors[None] == anchors[:, None]) & (depths[None] <= depths[:, None])

    def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=q.shape[1] != k.shape[1])

    with torch.no_grad():
        return model(tokens[None], features[None], (anchors + depths)[None], attend)[0][0]


def test_a_speculators_peagle_checkpoint_converts_and_computes_its_logits(
    smollm2_dir, verifier_states, tmp_path
):
    from speculators.serving import peagle_logits_with_speculators_package

    ids, aux = verifier_states
    anchors, depths = cod_elements()
    spec = peer_spec("peagle", smollm2_dir, draft_arch="qwen3", num_depths=4)
    loaded, theirs = peagle_logits_with_speculators_package(
        tmp_path / "peer", aux, ids, anchors, depths, tmp_path / "work", build=spec
    )
    assert loaded["ok"] and loaded["class"].endswith("peagle.core.PEagleDraftModel")
    assert "mask_hidden" in loaded["tensors"] and loaded["speculative_tokens"] == [4]

    convert_and_validate(tmp_path / "peer", tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == MASK_ID
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    model = load_draft(tmp_path / "ours").eval()
    ours = our_peagle_logits(model, ids, aux, anchors, depths)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)

    # the control: mask_hidden's aux blocks in another order change every mask slot's logits
    with torch.no_grad():
        model.mask_hidden.copy_(permute_aux_blocks(model.mask_hidden, 2, [1, 2, 0], "control"))
    shuffled = our_peagle_logits(model, ids, aux, anchors, depths)
    masked = depths > 0
    assert (shuffled[masked] - theirs[masked]).abs().max() > 0.1
    torch.testing.assert_close(shuffled[~masked], theirs[~masked], rtol=1e-4, atol=1e-4)


# ---- DSpark --------------------------------------------------------------------------------------------------
def test_a_speculators_dspark_checkpoint_converts_and_computes_its_logits(
    smollm2_dir, verifier_states, tmp_path
):
    from speculators.serving import block_logits_with_speculators_package

    ids, aux = verifier_states
    block, anchors = 5, [6, 11, 17]
    spec = peer_spec(
        "dspark", smollm2_dir, draft_arch="qwen3", full_attention_indices=[0], block_size=block,
        sample_from_anchor=False, markov_rank=16, confidence_head_with_markov=True,
    )  # fmt: skip
    loaded, theirs = block_logits_with_speculators_package(
        tmp_path / "peer", aux, ids, anchors, tmp_path / "work", build=spec
    )
    assert loaded["ok"] and loaded["class"].endswith("dspark.core.DSparkDraftModel")

    convert_and_validate(tmp_path / "peer", tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark"
    assert config["markov_rank"] == 16 and config["confidence_head_with_markov"] is True
    assert config["block_size"] == block
    # the package runs full-attention layers bidirectionally
    assert config["sliding_window_non_causal"] is True
    model = load_draft(tmp_path / "ours").eval()

    def ours() -> torch.Tensor:
        logits = []
        for a in anchors:
            # the token before each slot's target (teacher forced)
            prev = ids[0, [a, *range(a, a + block - 1)]]
            with torch.no_grad():
                bias = model.markov_head(prev)
            logits.append(context_logits(model, aux[:, : a + 1], ids[:, : a + 1])[0] + bias)
        return torch.stack(logits)

    torch.testing.assert_close(ours()[:, 1:], theirs["logits"][:, 1:], rtol=1e-4, atol=1e-4)
    # the control: fc reading the aux states in another order gives other logits
    with torch.no_grad():
        model.fc.weight.copy_(permute_aux_blocks(model.fc.weight, 1, [2, 0, 1], "control"))
    assert (ours()[:, 1:] - theirs["logits"][:, 1:]).abs().max() > 0.1


# ---- DFlash2 -------------------------------------------------------------------------------------------------
def test_a_speculators_dflash2_checkpoint_converts_and_computes_its_logits_and_selector_scores(
    smollm2_dir, verifier_states, tmp_path
):
    """speculators 0.9.0's own DFlash2 (random convolutions and selector; it saves neither embedding nor head)
    converts to a valid dflash2 directory with its five keys, and our model computes the package's unary logits and
    its selector's scores of each slot's top-k (teacher forced: each slot's predecessor the data token before it)."""
    from speculators.serving import block_logits_with_speculators_package

    ids, aux = verifier_states
    block, anchors, top_k = 5, [6, 11, 17], 4
    spec = peer_spec(
        "dflash2", smollm2_dir, draft_arch="qwen3", full_attention_indices=[0], block_size=block,
        sample_from_anchor=False, selector_rank=16, selector_top_k=top_k, conv_kernel_size=2, conv_group_size=16,
    )  # fmt: skip
    spec["draft_vocab_size"] = 49152  # DFlash2 requires the full vocabulary
    loaded, theirs = block_logits_with_speculators_package(
        tmp_path / "peer", aux, ids, anchors, tmp_path / "work", build=spec
    )
    assert loaded["ok"] and loaded["class"].endswith("dflash2.core.DFlash2DraftModel")
    assert "lm_head.weight" not in load_tensors(
        tmp_path / "peer"
    )  # the package saves no full-vocabulary head

    convert_and_validate(tmp_path / "peer", tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["block_size"] == block
    assert (config["conv_kernel_size"], config["conv_group_size"]) == (2, 16)
    assert (config["selector_rank"], config["selector_top_k"]) == (16, top_k)
    assert config["sliding_window_non_causal"] is True
    assert config["draft_vocab_size"] == config["transformer_layer_config"]["vocab_size"]
    model = load_draft(tmp_path / "ours").eval()

    def ours() -> tuple[torch.Tensor, torch.Tensor]:
        logits, scores = [], []
        for n, a in enumerate(anchors):
            hidden = context_hidden(model, aux[:, : a + 1], ids[:, : a + 1])[0]
            prev = ids[0, [a, *range(a, a + block - 1)]]
            with torch.no_grad():
                unary = model.slot_logits(hidden)
                scores.append(
                    model.candidate_selector(unary, hidden, prev, theirs["candidate_ids"][n].long())
                )
            logits.append(unary)
        return torch.stack(logits), torch.stack(scores)

    logits, scores = ours()
    torch.testing.assert_close(logits[:, 1:], theirs["logits"][:, 1:], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits[:, 1:].topk(top_k, dim=-1).indices, theirs["candidate_ids"][:, 1:].long())
    torch.testing.assert_close(scores[:, 1:], theirs["candidate_scores"][:, 1:], rtol=1e-4, atol=1e-4)
    # the control: the selector's two codebooks swapped give other scores (the unary logits stay)
    selector = model.candidate_selector
    with torch.no_grad():
        before = selector.predecessor_codebook.clone()
        selector.predecessor_codebook.copy_(selector.successor_codebook)
        selector.successor_codebook.copy_(before)
    swapped = ours()[1]
    assert (swapped[:, 1:] - theirs["candidate_scores"][:, 1:]).abs().max() > 1e-3
