"""Our engine drafts with a P-EAGLE draft as vLLM does: K tokens from ONE draft forward per round, each round's
proposals exactly what the training forward computes at that anchor, and greedy output identical to plain decoding
(batches whose rows accept different numbers of tokens included)."""

from __future__ import annotations

import pytest
import torch

from speculators.algorithms.peagle.config import PEagleConfig
from speculators.algorithms.peagle.drafter import ParallelDrafter
from speculators.algorithms.peagle.model import PEagleDraftModel
from speculators.decoding import DecodingConfig, SpeculativeDecoder, plain_generate
from speculators.decoding.drafters import drafter_class
from speculators.decoding.engine import VerifierRunner
from speculators.decoding.segment import Segment
from speculators.verifier import capture_aux_states
from tests.support.tiny_models import single_thread
from train.objectives.peagle import ParallelDraft

K = 4
NEW = 24


def peagle_draft(verifier, seed: int = 1) -> PEagleDraftModel:
    """A random P-EAGLE draft (K = 4) with the verifier's embedding."""
    torch.manual_seed(seed)
    config = PEagleConfig.from_verifier(
        verifier.config.to_dict(), "in-memory", mask_token_id=3, speculative_tokens=K, torch_dtype="float32"
    )
    draft = PEagleDraftModel(config).eval().requires_grad_(False)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
    return draft


def test_the_unit_picks_the_one_forward_drafter(tiny_llama):
    assert drafter_class(peagle_draft(tiny_llama)) is ParallelDrafter
    with pytest.raises(ValueError, match="one forward proposes one chain"):  # refused before any prefill
        SpeculativeDecoder(tiny_llama, peagle_draft(tiny_llama), DecodingConfig(method="tree")).generate(
            [[1, 2, 3]]
        )


def test_each_round_proposes_what_training_computes_at_its_anchor(tiny_llama, chat_prompts):
    """Three engine rounds (segment read + K-1 mask slots, committed cache, rollback) against the training
    forward over the final sequence: the K tokens of every round are the argmaxes of depths 0..K-1 at the anchor
    (the position of the last accepted token)."""
    draft = peagle_draft(tiny_llama)
    decoder = SpeculativeDecoder(tiny_llama, draft, DecodingConfig(num_speculative_tokens=K))
    prompt = chat_prompts[0]
    with torch.inference_mode():
        runner = VerifierRunner(tiny_llama, 1, decoder.aux_layer_ids)
        drafter = ParallelDrafter(draft, 1, runner.device)
        logits, ids, valid = runner.prefill([prompt])
        root = logits[:, -1].argmax(-1)
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        segment = Segment(runner.aux, torch.cat([ids[:, 1:], root[:, None]], 1), positions, valid)
        root_position = valid.long().sum(dim=1)
        sequence, rounds = list(prompt) + [int(root)], []
        for _ in range(3):
            tree = drafter.chain(segment, root, K)
            rounds.append((int(root_position) - 1, tree.tokens[0, 1:].tolist()))
            verdict, aux = decoder._verify(runner, tree, root_position, None)
            segment = decoder._commit(runner, tree, verdict, aux, root_position)
            sequence += verdict.emitted(tree)[0]
            root, root_position = verdict.next_token, root_position + verdict.num_accepted + 1
        assert drafter.forwards == 3
        full = torch.tensor([sequence])
        with capture_aux_states(tiny_llama, decoder.aux_layer_ids) as box:
            tiny_llama(full)
        aux = box["states"].aux
        length = full.shape[1]
        dense = ParallelDraft(draft, K, attention_backend="chunked")(
            full, aux, torch.arange(length)[None], torch.zeros(1, length, dtype=torch.long)
        )
    for anchor, proposed in rounds:
        expected = [int(draft.draft_to_target(dense[d][0, anchor].argmax())) for d in range(K)]
        assert proposed == expected, (anchor, proposed, expected)


def test_greedy_output_is_unchanged_with_one_draft_forward_per_round(tiny_llama, chat_prompts):
    prompts = chat_prompts[:8]
    with single_thread():
        reference = [plain_generate(tiny_llama, [p], NEW).tokens[0] for p in prompts]
        decoder = SpeculativeDecoder(
            tiny_llama, peagle_draft(tiny_llama), DecodingConfig(num_speculative_tokens=K, max_new_tokens=NEW)
        )
        tokens = []
        for start in (0, 4):
            result = decoder.generate(prompts[start : start + 4])
            tokens += result.tokens
            stats = result.stats
            # one verifier forward for the prefill, then one verifier and ONE draft forward per round
            assert stats.draft_forwards == stats.verifier_forwards - 1, stats
    assert tokens == reference
