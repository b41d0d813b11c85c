"""Decoding with a DFlash (block) draft: lossless, drafted as vLLM drafts it, one draft forward per verify step.

* Greedy output equals plain greedy decoding, for causal and bidirectional blocks, k = draft_slots and k < it,
  batches whose rows accept different numbers of tokens and stop at different times.
* Every block the engine drafts equals the block recomputed from scratch: the verifier run over the row's whole
  confirmed sequence (no cache), its aux states at every position < P as context, the block ``[root, mask × k]``
  at P (so the incremental context cache, its holes, positions and sliding window are checked, not just survived).
* Sampling is lossless (the chi-square harness of test_lossless.py) and a broken rule is caught with this draft too.
* The deterministic agreeing pair: every proposal accepted (AL = k + 1), or none with a shifted vocabulary mapping.
* A draft briefly fitted to the verifier is accepted at every slot (test_vllm_crosscheck.py: exactly as in vLLM).
"""

from __future__ import annotations

import copy

import pytest
import torch

from speculators.algorithms.dflash.drafter import BlockDrafter
from speculators.algorithms.dflash.model import block_attention
from speculators.decoding import DecodingConfig, SpeculativeDecoder, plain_generate
from speculators.decoding.segment import Segment
from speculators.verifier import capture_aux_states
from tests.decoding.test_lossless import (
    FAIL_P,
    NEW,
    PASS_P,
    PROMPT,
    ROWS,
    VOCAB,
    AcceptAlways,
    exact_joint,
    p_value,
)
from tests.support.dflash_drafts import random_dflash_draft
from tests.support.tiny_models import tiny_model

SMALL_VOCAB = 32
GREEDY_NEW = 24
BLOCK = 5  # 4 draft slots


@pytest.fixture(scope="module")
def verifier():
    """A small-vocabulary random verifier: a random draft agrees with it often enough that rows of one batch
    accept 0 to 4 tokens at the same step."""
    return tiny_model(
        SMALL_VOCAB,
        seed=0,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts of 1 to 11 tokens (so batches are left-padded)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 12, (12,), generator=g).tolist()
    return [torch.randint(0, SMALL_VOCAB, (n,), generator=g).tolist() for n in lengths]


def counts() -> torch.Tensor:
    """Token frequencies for a reduced draft vocabulary (lower ids more frequent; id 0 included)."""
    return torch.arange(SMALL_VOCAB, 0, -1).float()


def dflash(verifier, causal: bool, window: int | None = None, seed: int = 1):
    draft = random_dflash_draft(
        verifier,
        block_size=BLOCK,
        block_causal=causal,
        token_counts=counts(),
        draft_vocab_size=SMALL_VOCAB - 4,
        seed=seed,
    )
    if window is not None:
        draft.config.transformer_layer_config["sliding_window"] = window
        assert draft.config.sliding_window == window
    return draft


def recording_drafter(made: list[BlockDrafter]) -> type[BlockDrafter]:
    """The engine's block drafter, also keeping what each block was given and what it returned (per original
    row); every instance the engine builds is appended to ``made``."""

    class Recording(BlockDrafter):
        def __init__(self, draft, batch: int, device: torch.device) -> None:
            super().__init__(draft, batch, device)
            self.rows = list(range(batch))
            self.blocks: list[
                tuple[int, int, int, torch.Tensor]
            ] = []  # (row, root, its position, logits [k, Vd])
            made.append(self)

        def block_hidden(self, root, root_position, k):
            hidden = super().block_hidden(root, root_position, k)
            logits = self.draft.slot_logits(hidden)
            for i, row in enumerate(self.rows):
                self.blocks.append((row, int(root[i]), int(root_position[i]), logits[i].clone()))
            return hidden

        def select_rows(self, rows):
            super().select_rows(rows)
            self.rows = [self.rows[i] for i in rows.tolist()]

    return Recording


def reference_block(verifier, draft, tokens: list[int], root: int, k: int) -> torch.Tensor:
    """The block's draft logits ``[k, Vd]`` from scratch: no cache, the whole confirmed sequence ``tokens``."""
    position = len(tokens)
    ids = torch.tensor([tokens])
    with torch.no_grad(), capture_aux_states(verifier, draft.config.aux_layer_ids) as box:
        verifier(input_ids=ids)
    context = draft.project_context(box["states"].aux)
    context_positions = torch.arange(position)[None]
    kv = draft.context_kv(context, context_positions)
    block_ids, block_positions = draft.block_inputs(torch.tensor([root]), torch.tensor([position]))
    block_ids, block_positions = block_ids[:, : 1 + k], block_positions[:, : 1 + k]
    visible = torch.ones(1, 1 + k, position, dtype=torch.bool)
    window = draft.config.sliding_window
    if window is not None:
        visible = context_positions[:, None, :] > block_positions[:, :, None] - window

    def attend(layer, q, k_, v):
        return block_attention(q, k_, v, kv[layer][0], kv[layer][1], visible, draft.config.block_causal)

    with torch.no_grad():
        return draft(block_ids, block_positions, attend)[0, 1:]


def mixed_acceptance(accepted: list[list[int]]) -> bool:
    """Whether rows of the batch accepted different numbers of tokens at the same step several times."""
    steps = max(map(len, accepted))
    diverging = [s for s in range(steps) if len({row[s] for row in accepted if len(row) > s}) > 1]
    return len(diverging) >= 3


@pytest.mark.parametrize(
    "causal, k, window",
    [(True, 4, None), (False, 4, None), (True, 2, None), (False, 2, None), (True, 4, 6)],
    ids=["causal-k4", "bidirectional-k4", "causal-k2", "bidirectional-k2", "causal-window6-k4"],
)
def test_greedy_equals_plain_and_blocks_equal_the_reference(verifier, prompts, causal, k, window):
    draft = dflash(verifier, causal, window)
    eos = 7  # ends some rows early
    config = DecodingConfig(num_speculative_tokens=k, max_new_tokens=GREEDY_NEW)
    expected = [plain_generate(verifier, [p], GREEDY_NEW, eos_token_ids=[eos]).tokens[0] for p in prompts]
    decoder = SpeculativeDecoder(verifier, draft, config)
    made: list[BlockDrafter] = []
    decoder.drafter_class = recording_drafter(made)
    got, accepted = [], []
    for start in (0, 6):
        result = decoder.generate(prompts[start : start + 6], [eos])
        got += result.tokens
        accepted += result.stats.accepted
        assert result.stats.draft_forwards == result.stats.verifier_forwards - 1  # one per verify step
    blocks = [
        (start + row, *rest)
        for start, drafter in zip((0, 6), made, strict=True)
        for row, *rest in drafter.blocks
    ]
    assert got == expected
    assert len({len(t) for t in got}) > 1  # rows stopped at different times
    assert mixed_acceptance(accepted), accepted
    for row, root, position, logits in blocks[::3]:
        prompt, output = prompts[row], got[row]
        generated = position - len(prompt)
        assert output[generated] == root
        want = reference_block(verifier, draft, prompt + output[:generated], root, k)
        torch.testing.assert_close(logits, want, atol=2e-4, rtol=1e-4)


def test_block_has_one_plus_k_slots(verifier, prompts):
    """A bidirectional block's outputs depend on how many mask slots follow: k = 2 must not be the first two
    outputs of a 5-slot block (vLLM runs 1 + k query slots)."""
    draft = dflash(verifier, causal=False)
    drafter = BlockDrafter(draft, 1, torch.device("cpu"))
    features = torch.randn(1, 4, len(draft.config.aux_layer_ids) * verifier.config.hidden_size)
    confirmed = torch.ones(1, 4, dtype=torch.bool)
    drafter.read_segment(
        Segment(features, torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], confirmed)
    )
    root, position = torch.tensor([5]), torch.tensor([4])
    short = draft.slot_logits(drafter.block_hidden(root, position, 2))
    full = draft.slot_logits(drafter.block_hidden(root, position, 4))
    assert short.shape[1] == 2 and full.shape[1] == 4
    assert not torch.allclose(short, full[:, :2], atol=1e-4)


def test_one_draft_forward_per_verify_step(verifier, prompts):
    draft = dflash(verifier, causal=True)
    for prompt in prompts[:3]:
        stats = SpeculativeDecoder(
            verifier, draft, DecodingConfig(num_speculative_tokens=4, max_new_tokens=16)
        )
        stats = stats.generate([prompt]).stats
        assert stats.draft_forwards == stats.verify_steps == stats.verifier_forwards - 1


def test_trees_and_overlong_chains_are_refused(verifier):
    draft = dflash(verifier, causal=True)
    with pytest.raises(ValueError, match="tree drafting is not supported for dflash"):
        SpeculativeDecoder(verifier, draft, DecodingConfig(method="tree"))
    with pytest.raises(ValueError, match="at most 4"):
        SpeculativeDecoder(verifier, draft, DecodingConfig(num_speculative_tokens=5))
    draft.config.sample_from_anchor = True  # a layout vLLM does not serve: refused, not guessed at
    with pytest.raises(ValueError, match="sample_from_anchor"):
        SpeculativeDecoder(verifier, draft, DecodingConfig(num_speculative_tokens=4)).generate([[1, 2]])


# ---- a draft fitted to the verifier ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fitted_dflash(tiny_llama, chat_prompts):
    """A causal DFlash draft (4 draft slots) briefly fitted to the tiny Llama's greedy continuations of the first 8
    shipped prompts: mostly accepted on those, less on the others."""
    from tests.support.quickfit_block import fit_block_draft

    draft, losses = fit_block_draft(tiny_llama, chat_prompts[:8], block_size=5, block_causal=True, steps=300)
    assert losses[-1] < losses[0] / 4, losses[::50]
    return draft


def test_fitted_block_draft_is_accepted_and_lossless(tiny_llama, fitted_dflash, chat_prompts):
    """A draft trained to copy the verifier is accepted (AL well above 1, every slot sometimes), rows of a batch
    accept different numbers of tokens, and the output is still exactly plain greedy decoding."""
    prompts = chat_prompts[4:12]  # half seen in fitting, half not
    expected = [plain_generate(tiny_llama, [p], 32).tokens[0] for p in prompts]
    result = SpeculativeDecoder(
        tiny_llama, fitted_dflash, DecodingConfig(num_speculative_tokens=4, max_new_tokens=32)
    )
    result = result.generate(prompts)
    assert result.tokens == expected
    summary = result.stats.summary()
    assert summary["acceptance_length_global"] > 2.0, summary
    assert all(rate > 0 for rate in summary["per_position_acceptance_unconditional"]), summary
    assert mixed_acceptance(result.stats.accepted), result.stats.accepted


# ---- the deterministic agreeing pair --------------------------------------------------------------------------
def agreeing_pair(verifier, token_counts: torch.Tensor):
    """A verifier whose final norm is zero always emits token 0; a draft whose norm is zero has all-zero logits, so
    it proposes draft id 0 everywhere, which its d2t maps to verifier token ``d2t[0]``."""
    verifier = copy.deepcopy(verifier)
    with torch.no_grad():
        verifier.model.norm.weight.zero_()
    draft = random_dflash_draft(verifier, BLOCK, True, token_counts, draft_vocab_size=SMALL_VOCAB - 4)
    with torch.no_grad():
        draft.norm.weight.zero_()
    return verifier, draft


@pytest.mark.parametrize("k", [4, 2])
def test_draft_that_copies_the_verifier_is_always_accepted(verifier, prompts, k):
    verifier, draft = agreeing_pair(verifier, counts())
    assert int(draft.d2t[0]) == 0
    result = SpeculativeDecoder(verifier, draft, DecodingConfig(num_speculative_tokens=k, max_new_tokens=20))
    result = result.generate(prompts[:4])
    assert result.tokens == [[0] * 20] * 4
    summary = result.stats.summary()
    assert summary["acceptance_length_global"] == pytest.approx(k + 1)
    assert summary["per_position_acceptance_conditional"] == [1.0] * k


def test_shifted_mapping_is_never_accepted(verifier, prompts):
    shifted = counts()
    shifted[0] = 0  # token 0 leaves the draft vocabulary: draft id 0 now means token 1
    verifier, draft = agreeing_pair(verifier, shifted)
    assert int(draft.draft_to_target(torch.tensor(0))) == 1
    result = SpeculativeDecoder(verifier, draft, DecodingConfig(num_speculative_tokens=4, max_new_tokens=20))
    summary = result.generate(prompts[:4]).stats.summary()
    assert summary["acceptance_length_global"] == 1.0 and summary["accepted_drafts"] == 0


# ---- sampling -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sampling_pair():
    """An 8-token verifier (test_lossless.py's, less peaked) and a DFlash draft that partly disagrees with it and
    lacks two of its tokens: each slot's ``q`` differs from ``p`` and from the other slots'."""
    verifier = tiny_model(
        VOCAB,
        seed=0,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with torch.no_grad():
        verifier.lm_head.weight.mul_(3.0)
    frequencies = torch.tensor([8.0, 7, 6, 0, 5, 4, 0, 3])  # ids 3 and 6 outside the draft vocabulary
    draft = random_dflash_draft(
        verifier, block_size=4, block_causal=False, token_counts=frequencies, draft_vocab_size=6, seed=3
    )
    with torch.no_grad():
        draft.lm_head.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(4))
    return verifier, draft


def sample_rows(pair, config: DecodingConfig, sampler=None, seed: int = 2):
    verifier, draft = pair
    result = SpeculativeDecoder(verifier, draft, config, sampler).generate(
        [PROMPT] * ROWS, generator=torch.Generator().manual_seed(seed)
    )
    assert all(len(t) == NEW for t in result.tokens)
    return result.tokens, result.stats.summary()["per_position_acceptance_unconditional"]


BLOCK_SAMPLING = DecodingConfig(num_speculative_tokens=3, temperature=1.0, max_new_tokens=NEW)
BLOCK_SAMPLING_TOP_P = DecodingConfig(
    num_speculative_tokens=2, temperature=0.8, top_p=0.8, max_new_tokens=NEW
)


@pytest.mark.parametrize("config", [BLOCK_SAMPLING, BLOCK_SAMPLING_TOP_P], ids=["k3", "k2-top-p"])
def test_block_sampling_is_lossless(sampling_pair, config):
    joint = exact_joint(sampling_pair[0], config.temperature, config.top_p)
    tokens, per_position = sample_rows(sampling_pair, config)
    assert 0.1 < per_position[0] < 0.9, per_position  # accept and reject + resample both exercised
    assert per_position[-1] > 0.01, per_position  # and the bonus token after a full block
    for positions in [(0, 1, 2), (2, 3)]:
        assert p_value(tokens, joint, positions) > PASS_P, positions


def test_broken_rule_is_detected_with_block_drafts(sampling_pair):
    joint = exact_joint(sampling_pair[0], BLOCK_SAMPLING.temperature, BLOCK_SAMPLING.top_p)
    tokens, _ = sample_rows(sampling_pair, BLOCK_SAMPLING, AcceptAlways())
    assert min(p_value(tokens, joint, positions) for positions in [(0, 1, 2), (2, 3)]) < FAIL_P


def test_qwen3_verifier(tiny_qwen3_dir, chat_prompts):
    """A Qwen3 verifier (per-head q/k norms) with a block draft: lossless, and the agreeing pair accepts all."""
    from speculators.verifier import load_verifier

    verifier = load_verifier(str(tiny_qwen3_dir), dtype="float32")[0]
    prompts = chat_prompts[:4]
    expected = [plain_generate(verifier, [p], 16).tokens[0] for p in prompts]
    draft = random_dflash_draft(verifier, block_size=5, block_causal=False)
    decoder = SpeculativeDecoder(verifier, draft, DecodingConfig(num_speculative_tokens=3, max_new_tokens=16))
    assert decoder.generate(prompts).tokens == expected
    verifier, draft = copy.deepcopy(verifier), copy.deepcopy(draft)
    with torch.no_grad():
        verifier.model.norm.weight.zero_()
        draft.norm.weight.zero_()
    summary = SpeculativeDecoder(verifier, draft, DecodingConfig(num_speculative_tokens=4, max_new_tokens=16))
    assert summary.generate(prompts[:2]).stats.summary()["acceptance_length_global"] == pytest.approx(5.0)


def test_dspark_reads_each_slot_after_the_token_drafted_before_it(verifier, prompts):
    """DSpark's Markov bias makes slot s depend on the token drafted at s-1 (the root for the first slot), as
    vLLM's DSpark proposer drafts; the backbone still runs once. Greedy output stays the verifier's."""
    from speculators.algorithms.dspark.config import DSparkConfig
    from speculators.algorithms.dspark.model import DSparkDraftModel

    torch.manual_seed(3)
    config = DSparkConfig.from_verifier(
        verifier.config.to_dict(),
        "in-memory",
        mask_token_id=3,
        block_size=BLOCK,
        markov_rank=8,
        torch_dtype="float32",
    )
    draft = DSparkDraftModel(config).eval().requires_grad_(False)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
        draft.markov_head.markov_w1.weight.normal_()
        draft.markov_head.markov_w2.weight.normal_()  # a bias strong enough to change the argmax
    for prompt in prompts[:4]:
        cfg = DecodingConfig(num_speculative_tokens=4, max_new_tokens=GREEDY_NEW)
        ours = SpeculativeDecoder(verifier, draft, cfg).generate([prompt])
        plain = plain_generate(verifier, [prompt], max_new_tokens=GREEDY_NEW)
        assert ours.tokens == plain.tokens
        assert ours.stats.draft_forwards == ours.stats.verify_steps
    drafter = BlockDrafter(draft, 1, torch.device("cpu"))
    features = torch.randn(1, 4, len(config.aux_layer_ids) * verifier.config.hidden_size)
    drafter.read_segment(
        Segment(
            features,
            torch.zeros(1, 4, dtype=torch.long),
            torch.arange(4)[None],
            torch.ones(1, 4, dtype=torch.bool),
        )
    )
    root = torch.tensor([5])
    hidden = drafter.block_hidden(root, torch.tensor([4]), 4)
    chosen, _ = drafter.choose(hidden, root, 0.0, 1.0, None)
    prev, expected = root, []
    for slot in range(4):
        logits = draft.lm_head(hidden[:, slot]) + draft.markov_head(prev)
        expected.append(logits.argmax(-1))
        prev = draft.draft_to_target(expected[-1])
    assert torch.equal(chosen, torch.stack(expected, dim=1))
    assert not torch.equal(chosen, draft.lm_head(hidden).argmax(-1))  # the bias mattered


# ---- DFlash2: the candidate selector's walk -------------------------------------------------------------------
def random_dflash2_draft(verifier, block_size: int, top_k: int, seed: int = 5):
    """A DFlash2 draft over the verifier's whole vocabulary whose convolutions and selector are random and strong
    (a trained-looking draft: the convolutions mix slots, the selector's transition scores change the argmax)."""
    from speculators.algorithms.dflash2.config import DFlash2Config
    from speculators.algorithms.dflash2.model import DFlash2DraftModel

    torch.manual_seed(seed)
    config = DFlash2Config.from_verifier(
        verifier.config.to_dict(),
        "in-memory",
        mask_token_id=3,
        block_size=block_size,
        block_causal=False,
        torch_dtype="float32",
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=top_k,
    )
    draft = DFlash2DraftModel(config).eval().requires_grad_(False)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
        draft.lm_head.weight.copy_(verifier.get_output_embeddings().weight)
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.kernel_projection.weight.normal_(0.0, 0.3)
                conv.base_kernel.normal_(0.5, 0.3)
        selector = draft.candidate_selector
        for table in (selector.predecessor_codebook, selector.successor_codebook):
            table.normal_()
        selector.hidden_projection.weight.normal_(0.0, 1.0)
    return draft


def test_dflash2_drafts_the_selectors_pick_after_the_token_drafted_before_it(verifier, prompts):
    """Each DFlash2 draft token is the selector's argmax among its slot's unary top-k given the token drafted at
    the slot before (the root for the first), as vLLM's V2 DFlash2 speculator walks; one backbone forward per
    verify step, and greedy output stays the verifier's."""
    from speculators.algorithms import get
    from speculators.algorithms.dflash2.drafter import SelectorBlockDrafter

    draft = random_dflash2_draft(verifier, BLOCK, top_k=4)
    assert get("dflash2").drafter_class is SelectorBlockDrafter
    for prompt in prompts[:4]:
        cfg = DecodingConfig(num_speculative_tokens=4, max_new_tokens=GREEDY_NEW)
        ours = SpeculativeDecoder(verifier, draft, cfg).generate([prompt])
        assert ours.tokens == plain_generate(verifier, [prompt], max_new_tokens=GREEDY_NEW).tokens
        assert ours.stats.draft_forwards == ours.stats.verify_steps
    drafter = SelectorBlockDrafter(draft, 2, torch.device("cpu"))
    features = torch.randn(2, 4, len(draft.config.aux_layer_ids) * verifier.config.hidden_size)
    drafter.read_segment(
        Segment(features, torch.zeros(2, 4, dtype=torch.long), torch.arange(4)[None].expand(2, -1),
                torch.ones(2, 4, dtype=torch.bool))
    )  # fmt: skip
    root = torch.tensor([5, 9])
    hidden = drafter.block_hidden(root, torch.tensor([4, 4]), 4)
    chosen, _ = drafter.choose(hidden, root, 0.0, 1.0, None)
    prev, expected = root, []
    selector = draft.candidate_selector
    for slot in range(4):
        unary = draft.lm_head(hidden[:, slot])
        ids = unary.topk(4, dim=-1).indices
        transition = (
            (selector.predecessor_codebook[prev] * selector.hidden_projection(hidden[:, slot]))[:, None]
            * selector.successor_codebook[ids]
        ).sum(-1)
        expected.append(ids.gather(-1, (unary.gather(-1, ids) + transition).argmax(-1, keepdim=True))[:, 0])
        prev = expected[-1]
    assert torch.equal(chosen, torch.stack(expected, dim=1))
    assert not torch.equal(chosen, draft.lm_head(hidden).argmax(-1))  # the selector mattered


def test_an_untrained_dflash2_backbone_is_dflashs(verifier):
    """DFlash2's convolutions start as the identity (speculators 0.9.0's init): with DFlash's weights its block
    states are DFlash's exactly; the trained-looking random convolutions change them."""
    from speculators.algorithms.dflash2.config import DFlash2Config
    from speculators.algorithms.dflash2.model import DFlash2DraftModel

    config = DFlash2Config.from_verifier(
        verifier.config.to_dict(), "in-memory", mask_token_id=3, block_size=BLOCK, block_causal=False,
        torch_dtype="float32", conv_group_size=8, selector_rank=8, selector_top_k=4,
    )  # fmt: skip
    dflash2 = DFlash2DraftModel(config).eval()
    plain = random_dflash_draft(verifier, block_size=BLOCK, block_causal=False)
    missing, unexpected = dflash2.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all("conv" in n or "candidate_selector" in n for n in missing)
    segment = Segment(
        torch.randn(1, 6, len(config.aux_layer_ids) * verifier.config.hidden_size),
        torch.zeros(1, 6, dtype=torch.long), torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool),
    )  # fmt: skip
    states = []
    for draft in (plain, dflash2, random_dflash2_draft(verifier, BLOCK, top_k=4)):
        draft.load_state_dict(plain.state_dict(), strict=False)  # DFlash's weights; its own stay
        drafter = BlockDrafter(draft, 1, torch.device("cpu"))
        drafter.read_segment(segment)
        with torch.no_grad():
            states.append(drafter.block_hidden(torch.tensor([7]), torch.tensor([6]), 4))
    torch.testing.assert_close(states[1], states[0], rtol=0, atol=1e-6)
    assert (states[2] - states[0]).abs().max() > 0.1


@pytest.fixture(scope="module")
def dflash2_sampling_pair(sampling_pair):
    """``sampling_pair``'s verifier with a DFlash2 draft whose selector keeps 3 of its 8 tokens per slot: ``q`` is
    the softmax of the tempered selector scores over those 3 (zero elsewhere), depending on the token drawn before."""
    verifier = sampling_pair[0]
    draft = random_dflash2_draft(verifier, block_size=4, top_k=3)
    with torch.no_grad():
        draft.candidate_selector.predecessor_codebook.mul_(0.5)
    return verifier, draft


def test_dflash2_sampling_is_lossless(dflash2_sampling_pair):
    joint = exact_joint(dflash2_sampling_pair[0], BLOCK_SAMPLING.temperature, BLOCK_SAMPLING.top_p)
    tokens, per_position = sample_rows(dflash2_sampling_pair, BLOCK_SAMPLING)
    assert 0.05 < per_position[0] < 0.95, per_position
    for positions in [(0, 1, 2), (2, 3)]:
        assert p_value(tokens, joint, positions) > PASS_P, positions


# ---- LiLiCorr: the candidate lattice's walk -------------------------------------------------------------------
def random_lilicorr_draft(verifier, block_size: int, topk: int, scale: float = 8.0, seed: int = 6):
    """A LiLiCorr draft over the verifier's whole vocabulary whose head is random and strong (its transition scores
    change the argmax), with the verifier's embedding and head (as vLLM uses the target's)."""
    from speculators.algorithms.lilicorr.config import LiLiCorrConfig
    from speculators.algorithms.lilicorr.model import LiLiCorrDraftModel

    torch.manual_seed(seed)
    config = LiLiCorrConfig.from_verifier(
        verifier.config.to_dict(), "in-memory", mask_token_id=3, block_size=block_size, block_causal=False,
        torch_dtype="float32", lilicorr_hidden_size=16, lilicorr_candidate_topk=topk, lilicorr_num_heads=2,
        lilicorr_factor_dim=8, lilicorr_num_layers=1, lilicorr_logit_scale=scale,
    )  # fmt: skip
    draft = LiLiCorrDraftModel(config).eval().requires_grad_(False)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
        draft.lm_head.weight.copy_(verifier.get_output_embeddings().weight)
        for name, parameter in draft.lilicorr.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.5)
    return draft


def test_lilicorr_drafts_the_greedy_walk_of_its_lattice(verifier, prompts):
    """Each LiLiCorr draft token is the best transition from the candidate drafted before it (the anchor's start
    scores for the first slot) on the lattice of every slot's top-k, scored by ONE head forward after one backbone
    forward per verify step, as vLLM's V2 speculator walks it; greedy output stays the verifier's; the anchor is
    ``hidden_norm(fc(aux))`` of each row's last confirmed position."""
    from speculators.algorithms import get
    from speculators.algorithms.lilicorr.drafter import LatticeBlockDrafter
    from speculators.algorithms.lilicorr.model import walk

    draft = random_lilicorr_draft(verifier, BLOCK, topk=4)
    assert get("lilicorr").drafter_class is LatticeBlockDrafter
    for prompt in prompts[:4]:
        cfg = DecodingConfig(num_speculative_tokens=4, max_new_tokens=GREEDY_NEW)
        ours = SpeculativeDecoder(verifier, draft, cfg).generate([prompt])
        assert ours.tokens == plain_generate(verifier, [prompt], max_new_tokens=GREEDY_NEW).tokens
        assert ours.stats.draft_forwards == ours.stats.verify_steps
    drafter = LatticeBlockDrafter(draft, 2, torch.device("cpu"))
    features = torch.randn(2, 4, len(draft.config.aux_layer_ids) * verifier.config.hidden_size)
    valid = torch.tensor(
        [[True, True, True, False], [True, True, True, True]]
    )  # row 0's last column is a hole
    drafter.read_segment(
        Segment(features, torch.zeros(2, 4, dtype=torch.long), torch.arange(4)[None].expand(2, -1), valid)
    )
    root = torch.tensor([5, 9])
    for k in (4, 2):  # a shorter draft reads the head's first k slots
        hidden = drafter.block_hidden(root, torch.tensor([4, 4]), k)
        chosen, _ = drafter.choose(hidden, root, 0.0, 1.0, None)
        ids, log_probs = draft.candidates(hidden)
        anchor = draft.hidden_norm(draft.fc(features[[0, 1], [2, 3]]))
        rows = draft.lattice_scores(hidden, anchor, torch.ones(2, dtype=torch.bool), ids, log_probs)
        assert rows.shape == (2, k, 4, 4)
        assert torch.equal(chosen, ids.gather(-1, walk(rows)[..., None])[..., 0])
        assert not torch.equal(chosen, draft.lm_head(hidden).argmax(-1))  # the head mattered


@pytest.fixture(scope="module")
def lilicorr_sampling_pair(sampling_pair):
    """``sampling_pair``'s verifier with a LiLiCorr draft over the top 4 of its 8 tokens per slot: ``q`` is the
    softmax of the tempered row of the candidate drawn before (zero outside the slot's candidates)."""
    verifier = sampling_pair[0]
    return verifier, random_lilicorr_draft(verifier, block_size=4, topk=4, scale=2.0)


def test_lilicorr_sampling_is_lossless(lilicorr_sampling_pair):
    joint = exact_joint(lilicorr_sampling_pair[0], BLOCK_SAMPLING.temperature, BLOCK_SAMPLING.top_p)
    tokens, per_position = sample_rows(lilicorr_sampling_pair, BLOCK_SAMPLING)
    assert 0.05 < per_position[0] < 0.95, per_position
    for positions in [(0, 1, 2), (2, 3)]:
        assert p_value(tokens, joint, positions) > PASS_P, positions


def test_broken_rule_is_detected_with_lilicorr_drafts(lilicorr_sampling_pair):
    joint = exact_joint(lilicorr_sampling_pair[0], BLOCK_SAMPLING.temperature, BLOCK_SAMPLING.top_p)
    tokens, _ = sample_rows(lilicorr_sampling_pair, BLOCK_SAMPLING, AcceptAlways())
    assert min(p_value(tokens, joint, positions) for positions in [(0, 1, 2), (2, 3)]) < FAIL_P
