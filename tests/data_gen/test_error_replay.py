"""Error replay (issue 41, data side): regeneration through our speculative decoding engine records where the
current draft was rejected, and the masker weights those tokens up.

The drafts here have a one-token vocabulary: whatever they read, they propose that token, so where the verifier
rejects them follows from the verifier's greedy output alone. That gives a check of the engine's rejections that
does not go through the engine's own bookkeeping (``constant_draft_rejections``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from data_gen.error_replay import (
    normalized,
    rejected_char_offsets,
    rejected_positions,
    replay_weights,
    strip_offsets,
)
from data_gen.masks import ChatMasker, EncodedSample, fit_length
from data_gen.pipeline import GenSettings, run_data_gen
from data_gen.regenerate import RegenerateSettings, Regenerator, engine_generate
from data_gen.sources import Conversation
from data_gen.store import FeatureDataset, IncompatibleOutputError, Sample, write_shard
from speculators.decoding.engine import DecodingConfig, SpeculativeDecoder, plain_generate
from tests.data_gen.conftest import chat_records, write_jsonl
from tests.data_gen.test_pipeline import make_config
from tests.support.tiny_models import random_draft, single_thread

REPLAY_WEIGHT = 4.0
K = 2
NEW_TOKENS = 24


# ---- output indices ---------------------------------------------------------------------------------------------
def test_rejected_positions_follow_the_verify_steps():
    # k=3: step 0 drafts 1..3 (all accepted, bonus at 4); step 1 drafts 5..7, accepts 1: 6 rejected; step 2 drafts
    # 7..9, accepts 0: 7 rejected; step 3 drafts 8..10, accepts 2: 10 rejected
    assert rejected_positions([3, 1, 0, 2], k=3, num_tokens=20) == [6, 7, 10]
    # max_new_tokens cut the last step before its rejected token
    assert rejected_positions([3, 1, 0, 2], k=3, num_tokens=10) == [6, 7]
    # EOS at index 2, an accepted draft of step 0: nothing after it counts
    assert rejected_positions([3, 2], k=3, num_tokens=3) == []
    assert rejected_positions([], k=3, num_tokens=1) == []  # the prefill's token alone
    assert rejected_positions([0, 0, 0], k=1, num_tokens=4) == [1, 2, 3]
    with pytest.raises(ValueError, match="accepted 4 of k=3"):
        rejected_positions([4], k=3, num_tokens=10)


def test_char_offsets_skip_whitespace_and_keep_a_rejected_stop_token(smollm2_tokenizer):
    tok = smollm2_tokenizer
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    tokens = tok.encode(" Hello\n\n world", add_special_tokens=False) + [eot]
    pieces = [tok.decode([t]) for t in tokens]
    newline, world = pieces.index("\n\n"), pieces.index(" world")

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    text, offsets = rejected_char_offsets(decode, tokens, [newline, world, len(tokens) - 1], ended=True)
    assert text == " Hello\n\n world"
    # the whitespace token maps to the next content character, as does " world" (its space is no content)
    assert offsets == (text.index("world"), len(text))
    _, cut = rejected_char_offsets(decode, tokens, [newline, len(tokens) - 1], ended=False)
    assert cut == (text.index("world"),)  # a cut answer has no end-of-turn token to emphasise
    stripped, moved = strip_offsets(text, offsets)
    assert stripped == "Hello\n\n world" and moved == (stripped.index("world"), len(stripped))


# ---- weights in the masker ------------------------------------------------------------------------------------
def weighted_words(tokenizer, sample: EncodedSample) -> list[str]:
    return [
        tokenizer.decode([t]).strip()
        for t, w, m in zip(sample.input_ids, sample.loss_weight, sample.loss_mask, strict=True)
        if m and w > 1.0
    ]


def check_mean_one(sample: EncodedSample) -> None:
    on = [w for w, m in zip(sample.loss_weight, sample.loss_mask, strict=True) if m]
    off = [w for w, m in zip(sample.loss_weight, sample.loss_mask, strict=True) if not m]
    assert sum(on) / len(on) == pytest.approx(1.0) and set(off) <= {0.0}


def replay_conversation() -> Conversation:
    first, second = "The cat sat on the mat.", "Dogs bark at night and sleep by day."
    return Conversation(
        "r0",
        [
            {"role": "user", "content": "Tell me about cats."},
            {"role": "assistant", "content": first, "rejected_at": [first.index("sat")]},
            {"role": "user", "content": "And dogs?"},
            {"role": "assistant", "content": second, "rejected_at": [second.index("night"), len(second)]},
        ],
    )


@pytest.mark.parametrize("name", ["smollm2_tokenizer", "llama3_tokenizer", "llama3_tagged_tokenizer"])
def test_masker_weights_the_rejected_tokens_of_a_whole_conversation(name, request):
    tokenizer = request.getfixturevalue(name)
    masker = ChatMasker(tokenizer)
    masker.replay_weight = REPLAY_WEIGHT
    [sample] = masker.encode(replay_conversation(), max_length=512)
    eot = masker.eot_token
    assert weighted_words(tokenizer, sample) == ["sat", "night", eot.strip()]  # len(content): its end of turn
    check_mean_one(sample)
    light = min(w for w, m in zip(sample.loss_weight, sample.loss_mask, strict=True) if m)
    assert light < 1.0 < max(sample.loss_weight)
    assert max(sample.loss_weight) / light == pytest.approx(REPLAY_WEIGHT)


def test_masker_weights_each_turn_of_a_per_turn_template(qwen3_tokenizer):
    masker = ChatMasker(qwen3_tokenizer)
    masker.replay_weight = REPLAY_WEIGHT
    assert masker.turn_mode == "per_turn"
    first, second = masker.encode(replay_conversation(), max_length=512)
    assert weighted_words(qwen3_tokenizer, first) == ["sat"]
    assert weighted_words(qwen3_tokenizer, second) == ["night", "<|im_end|>"]
    check_mean_one(first)
    check_mean_one(second)


def test_no_rejections_or_no_emphasis_build_no_weights(smollm2_tokenizer):
    masker = ChatMasker(smollm2_tokenizer)
    [plain] = masker.encode(replay_conversation(), 512)
    assert plain.loss_weight is None  # replay_weight 1.0: nothing to move
    masker.replay_weight = REPLAY_WEIGHT
    bare = [{k: v for k, v in m.items() if k != "rejected_at"} for m in replay_conversation().messages]
    assert masker.encode(Conversation("b", bare), 512)[0].loss_weight is None
    none_rejected = [dict(m, rejected_at=[]) if m["role"] == "assistant" else m for m in bare]
    [uniform] = masker.encode(Conversation("u", none_rejected), 512)
    assert uniform.loss_weight == [float(m) for m in uniform.loss_mask]


def test_truncation_cuts_the_weights_and_keeps_their_mean(smollm2_tokenizer):
    masker = ChatMasker(smollm2_tokenizer)
    masker.replay_weight = REPLAY_WEIGHT
    [whole] = masker.encode(replay_conversation(), max_length=512)
    loss = [i for i, m in enumerate(whole.loss_mask) if m]
    cut_at = loss[len(loss) // 2]  # inside the second answer, before its rejected word
    [cut] = masker.encode(replay_conversation(), max_length=cut_at)
    assert cut.truncated and len(cut.loss_weight) == len(cut.input_ids) == cut_at
    assert weighted_words(smollm2_tokenizer, cut) == ["sat"]
    check_mean_one(cut)
    # fit_length normalises raw weights once; normalising again changes nothing
    raw = replay_weights(whole.loss_mask, [(i, i + 1) for i in range(len(whole.loss_mask))], [loss[0]], 3.0)
    fitted = fit_length(
        EncodedSample("x", whole.input_ids, whole.loss_mask, loss_weight=raw), 10_000, "truncate"
    )
    assert fitted.loss_weight == pytest.approx(normalized(fitted.loss_weight, whole.loss_mask))


# ---- real rejections of the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def verifier(tiny_llama_dir):
    from speculators.verifier import load_verifier

    return load_verifier(str(tiny_llama_dir), dtype="float32")[0]


@pytest.fixture(scope="module")
def prompt_and_greedy(verifier, smollm2_tokenizer):
    """A one-question chat, its prompt ids and the verifier's plain greedy answer (no stop: NEW_TOKENS long)."""
    masker = ChatMasker(smollm2_tokenizer)
    messages = [{"role": "user", "content": "Question 7: tell me more about the sea"}]
    prompt = masker.tokenize(masker.prompt_text(messages))[0]
    with single_thread():
        greedy = plain_generate(verifier, [prompt], max_new_tokens=NEW_TOKENS).tokens[0]
    return messages, prompt, greedy


def constant_draft(verifier, token: int):
    """A draft whose vocabulary is ``token`` alone: it proposes ``token`` at every position."""
    return random_draft(verifier, draft_vocab_size=1, target_ids=[token])


def constant_draft_rejections(output: list[int], token: int, k: int) -> list[int]:
    """Where a draft that always proposes ``token`` is rejected, from the verifier's greedy output alone."""
    rejected, start = [], 1
    while start < len(output):
        accepted = 0
        while accepted < k and start + accepted < len(output) and output[start + accepted] == token:
            accepted += 1
        if accepted < k and start + accepted < len(output):
            rejected.append(start + accepted)
        start += accepted + 1
    return rejected


def replayed_sample(verifier, draft, tokenizer, messages, tmp_path: Path) -> EncodedSample:
    """One conversation regenerated through the engine back-end and masked with replay weights."""
    masker = ChatMasker(tokenizer)
    masker.replay_weight = REPLAY_WEIGHT
    settings = RegenerateSettings(
        enabled=True, backend="engine", draft="in-memory", k=K, max_new_tokens=NEW_TOKENS, replay_weight=4.0
    )
    generate = engine_generate(verifier, draft, tokenizer, settings, [masker.eot_id])
    conversation = Conversation("e0", [*messages, {"role": "assistant", "content": "placeholder"}])
    regenerator = Regenerator(generate, masker, settings, max_length=512, seed=0)
    with single_thread():
        [regenerated], counts = regenerator.regenerate([conversation], tmp_path / "cache.jsonl")
    assert counts["drafted_steps"] > 0 and counts["rejected_tokens"] == len(
        regenerated.messages[1]["rejected_at"]
    )
    [sample] = masker.encode(regenerated, max_length=512)
    return sample


def test_weights_sit_exactly_on_the_engine_rejections(
    verifier, prompt_and_greedy, smollm2_tokenizer, tmp_path
):
    messages, prompt, greedy = prompt_and_greedy
    common = [token for token, _ in Counter(greedy[1:]).most_common(2)]
    weights = []
    for index, token in enumerate(common):
        draft = constant_draft(verifier, token)
        expected = constant_draft_rejections(greedy, token, K)
        assert 0 < len(expected) < len(greedy) - 1, (greedy, token)  # some accepted, some rejected
        # the engine is lossless and its own step counts name the same positions
        decoder = SpeculativeDecoder(
            verifier, draft, DecodingConfig(num_speculative_tokens=K, max_new_tokens=NEW_TOKENS)
        )
        with single_thread():
            result = decoder.generate([prompt])
        assert result.tokens[0] == greedy
        assert rejected_positions(result.stats.accepted[0], K, len(greedy)) == expected

        sample = replayed_sample(verifier, draft, smollm2_tokenizer, messages, tmp_path / str(index))
        content = sample.loss_mask.index(1)
        # the stored answer re-tokenises into the generated tokens (the first one lost its leading space)
        assert sample.input_ids[content + 1 : content + len(greedy)] == greedy[1:]
        heavy = {i for i, w in enumerate(sample.loss_weight) if w > 1.0}
        assert heavy == {content + position for position in expected}
        loss = [i for i, m in enumerate(sample.loss_mask) if m]
        assert all(sample.loss_weight[i] < 1.0 for i in loss if i not in heavy)
        check_mean_one(sample)
        weights.append(sample.loss_weight)
    assert weights[0] != weights[1]  # another draft, other rejections, other weights


# ---- the shard format -------------------------------------------------------------------------------------------
def make_sample(name: str, length: int, weights: list[float] | None) -> Sample:
    generator = torch.Generator().manual_seed(length)
    mask = torch.tensor([i >= length // 2 for i in range(length)])
    return Sample(
        sample_id=name,
        input_ids=torch.arange(length),
        loss_mask=mask,
        aux_hidden=torch.randn(length, 6, generator=generator),
        last_hidden=torch.randn(length, 2, generator=generator),
        loss_weight=None if weights is None else torch.tensor(weights),
    )


def test_shards_hold_weights_only_when_a_sample_has_them(tmp_path):
    from safetensors import safe_open

    from data_gen.store import finalize_split

    weights = [0.0, 0.0, 0.5, 1.5]
    samples = [make_sample("a", 4, weights), make_sample("b", 6, None)]
    write_shard(tmp_path / "w" / "train", 0, samples, num_aux=3, storage_dtype="bfloat16")
    plain = [make_sample("a", 4, None), make_sample("b", 6, None)]
    write_shard(tmp_path / "p" / "train", 0, plain, num_aux=3, storage_dtype="bfloat16")
    with safe_open(str(tmp_path / "p" / "train" / "shard-00000.safetensors"), framework="pt") as handle:
        assert "loss_weight" not in handle.keys()  # a shard of before error replay, tensor for tensor
    for run in ("w", "p"):
        finalize_split(tmp_path / run / "train", 1, {})
    weighted, unweighted = FeatureDataset(tmp_path / "w" / "train"), FeatureDataset(tmp_path / "p" / "train")
    assert weighted[0]["loss_weight"].dtype == torch.float32
    assert weighted[0]["loss_weight"].tolist() == weights
    assert weighted[1]["loss_weight"].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # its loss mask
    assert all("loss_weight" not in unweighted[i] for i in range(2))
    for i in range(2):
        for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            assert torch.equal(weighted[i][key], unweighted[i][key])
    # without weights the bytes are those of the same samples written again (nothing new in the file)
    write_shard(tmp_path / "q" / "train", 0, plain, num_aux=3, storage_dtype="bfloat16")
    assert (tmp_path / "q" / "train" / "shard-00000.safetensors").read_bytes() == (
        tmp_path / "p" / "train" / "shard-00000.safetensors"
    ).read_bytes()
    with pytest.raises(ValueError, match="loss_weight has shape"):
        write_shard(tmp_path / "x", 0, [make_sample("c", 4, [1.0])], num_aux=3, storage_dtype="bfloat16")


# ---- the whole run ----------------------------------------------------------------------------------------------
def test_engine_settings_are_checked():
    def settings(**regenerate) -> GenSettings:
        return GenSettings.from_mapping({"regenerate": {"enabled": True, **regenerate}})

    with pytest.raises(ValueError, match="needs data_gen.regenerate.draft"):
        settings(backend="engine")
    with pytest.raises(ValueError, match="decodes greedily.*verifier's greedy choice"):
        settings(backend="engine", draft="d", temperature=0.7)
    with pytest.raises(ValueError, match="k >= 1"):
        settings(backend="engine", draft="d", k=0)
    with pytest.raises(ValueError, match="backend=engine only"):
        settings(backend="transformers", draft="d")


def test_data_gen_with_the_engine_writes_weighted_shards(
    verifier, prompt_and_greedy, tiny_llama_dir, tmp_path
):
    _, _, greedy = prompt_and_greedy
    token = Counter(greedy[1:]).most_common(1)[0][0]
    draft_dir = constant_draft(verifier, token).save_pretrained(tmp_path / "draft", dtype=torch.float32)
    chats = write_jsonl(tmp_path / "chats.jsonl", chat_records(5, turns=2))
    out = tmp_path / "data"
    regen = {
        "enabled": True,
        "backend": "engine",
        "draft": str(draft_dir),
        "k": K,
        "replay_weight": REPLAY_WEIGHT,
        "max_new_tokens": 12,
        "batch_size": 3,
    }
    config = make_config(tiny_llama_dir, chats, out, data__max_conversations=5, data_gen__regenerate=regen)
    with single_thread():
        summary = run_data_gen(config)
    assert summary["counts"]["regenerate_drafted_steps"] > 0
    assert summary["counts"]["regenerate_rejected_tokens"] > 0
    entries = [
        json.loads(line)
        for cache in sorted((out / "regenerated").rglob("shard-*.jsonl"))
        for line in cache.read_text().splitlines()
    ]
    answers = [m for e in entries for m in e["messages"] or [] if m["role"] == "assistant"]
    assert answers and all(isinstance(m["rejected_at"], list) for m in answers)
    train = FeatureDataset(out / "train")
    assert train.manifest["regenerate"]["engine"]["k"] == K
    for index in range(len(train)):
        item = train[index]
        weights, mask = item["loss_weight"], item["loss_mask"]
        assert weights.shape == mask.shape and weights.dtype == torch.float32
        assert float(weights[mask].mean()) == pytest.approx(1.0, abs=1e-5)
        assert bool((weights[~mask] == 0).all()) and float(weights.max()) > 1.0

    changed = json.loads(json.dumps(config))
    changed["data_gen"]["regenerate"]["k"] = K + 1
    with pytest.raises(IncompatibleOutputError, match="regenerate.engine.k"):
        run_data_gen(changed)
