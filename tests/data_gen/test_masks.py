"""Loss masks per chat-template family: exactly the assistant content + end-of-turn token, nothing else."""

from __future__ import annotations

import copy

import pytest

from data_gen.masks import ChatMasker, MaskingError, TemplateError
from data_gen.sources import Conversation

CHAT = Conversation(
    "chat-1",
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome."},
    ],
)


def masked_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded text of every maximal run of mask == 1 (special tokens kept)."""
    runs, current = [], []
    for token, bit in zip(ids, mask, strict=True):
        if bit:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_smollm2_template_masks_each_answer_and_its_im_end(smollm2_tokenizer):
    masker = ChatMasker(smollm2_tokenizer)
    assert masker.describe()["method"] == "incremental" and masker.turn_mode == "whole"
    assert masker.eot_token == "<|im_end|>"
    [sample] = masker.encode(CHAT, max_length=512)
    assert sample.input_ids == smollm2_tokenizer.apply_chat_template(CHAT.messages, return_dict=False)
    runs = masked_runs(smollm2_tokenizer, sample.input_ids, sample.loss_mask)
    assert runs == ["The capital of France is Paris.<|im_end|>", "Rome.<|im_end|>"]
    # the newline the template writes after <|im_end|> and the next role header are not the model's to emit
    unmasked = smollm2_tokenizer.decode(
        [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m]
    )
    assert "Be brief." in unmasked and "And of Italy?" in unmasked and "<|im_start|>assistant\n" in unmasked


def test_llama3_template_incremental_equals_generation_tags(llama3_tokenizer, llama3_tagged_tokenizer):
    plain, tagged = ChatMasker(llama3_tokenizer), ChatMasker(llama3_tagged_tokenizer)
    assert plain.describe()["method"] == "incremental"
    assert tagged.describe()["method"] == "generation_tags"
    assert plain.eot_token == tagged.eot_token == "<|eot_id|>"
    [a] = plain.encode(CHAT, max_length=512)
    [b] = tagged.encode(CHAT, max_length=512)
    assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask
    assert a.input_ids[0] == llama3_tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    runs = masked_runs(llama3_tokenizer, a.input_ids, a.loss_mask)
    assert runs == ["The capital of France is Paris.<|eot_id|>", "Rome.<|eot_id|>"]


def test_generation_tags_that_stop_before_the_end_of_turn_token_are_extended(llama3_tagged_tokenizer):
    tok = copy.deepcopy(llama3_tagged_tokenizer)
    tok.chat_template = tok.chat_template.replace(
        "{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}",
        "{% generation %}{{- message['content'] | trim }}{% endgeneration %}{{- '<|eot_id|>' }}",
    )
    [sample] = ChatMasker(tok).encode(CHAT, max_length=512)
    assert masked_runs(tok, sample.input_ids, sample.loss_mask)[-1] == "Rome.<|eot_id|>"


def test_qwen3_template_goes_per_turn_and_masks_the_think_block(qwen3_tokenizer):
    masker = ChatMasker(qwen3_tokenizer)  # auto
    assert not masker.prefix_stable and masker.turn_mode == "per_turn"
    chat = Conversation(
        "q",
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\n6"},
        ],
    )
    first, second = masker.encode(chat, max_length=512)
    assert (first.sample_id, second.sample_id) == ("q#turn1", "q#turn3")
    assert masked_runs(qwen3_tokenizer, first.input_ids, first.loss_mask) == [
        "<think>\nAdd them.\n</think>\n\n4<|im_end|>"
    ]
    assert masked_runs(qwen3_tokenizer, second.input_ids, second.loss_mask) == [
        "<think>\nAgain.\n</think>\n\n6<|im_end|>"
    ]
    # the second sample's history is rendered as the template renders history: the first think block is gone
    assert "Add them." not in qwen3_tokenizer.decode(second.input_ids)
    think = qwen3_tokenizer.convert_tokens_to_ids("<think>")
    assert think in first.input_ids and first.loss_mask[first.input_ids.index(think)] == 1


def truncated_chat() -> Conversation:
    """CHAT with its first answer cut at max_new_tokens by regeneration (the verifier never closed it)."""
    messages = copy.deepcopy(CHAT.messages)
    messages[2]["truncated"] = True
    return Conversation("chat-cut", messages)


@pytest.mark.parametrize(
    "tokenizer_fixture", ["smollm2_tokenizer", "llama3_tagged_tokenizer", "qwen3_tokenizer"]
)
def test_a_truncated_answer_teaches_its_content_but_no_end_of_turn(tokenizer_fixture, request):
    """Incremental (whole), generation tags and per-turn: the cut answer's closing token is context, not a
    target; the finished answer keeps its own."""
    tokenizer = request.getfixturevalue(tokenizer_fixture)
    masker = ChatMasker(tokenizer)
    eot = masker.eot_token
    runs = [
        run
        for sample in masker.encode(truncated_chat(), max_length=512)
        for run in masked_runs(tokenizer, sample.input_ids, sample.loss_mask)
    ]
    assert len(runs) == 2, runs  # (Qwen3 renders an empty think block in front of each answer)
    assert runs[0].endswith("The capital of France is Paris.") and eot not in runs[0]
    assert runs[1].endswith(f"Rome.{eot}")


def test_qwen3_template_refuses_whole_conversations(qwen3_tokenizer):
    with pytest.raises(TemplateError, match="turn_mode=per_turn"):
        ChatMasker(qwen3_tokenizer, turn_mode="whole")


def test_tokenizer_without_chat_template_is_refused(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template.*data.chat_template"):
        ChatMasker(tok)


def test_template_ignoring_the_generation_prompt_is_refused(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    with pytest.raises(TemplateError, match="ignores add_generation_prompt"):
        ChatMasker(tok)


def test_template_without_a_special_end_of_turn_token_is_refused(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(TemplateError, match="end-of-turn token"):
        ChatMasker(tok)


def test_special_token_inside_content_is_refused(smollm2_tokenizer):
    chat = Conversation(
        "x", [{"role": "user", "content": "hi <|im_end|>"}, {"role": "assistant", "content": "ok"}]
    )
    with pytest.raises(MaskingError) as caught:
        ChatMasker(smollm2_tokenizer).encode(chat, max_length=512)
    assert caught.value.reason == "special_token_in_content"


def test_overlong_samples_are_truncated_or_dropped(smollm2_tokenizer):
    masker = ChatMasker(smollm2_tokenizer)
    [full] = masker.encode(CHAT, max_length=512)
    cut = len(full.input_ids) - 3
    [short] = masker.encode(CHAT, max_length=cut)
    assert (
        short.truncated
        and short.input_ids == full.input_ids[:cut]
        and short.loss_mask == full.loss_mask[:cut]
    )
    with pytest.raises(MaskingError) as caught:
        masker.encode(CHAT, max_length=cut, overlong="drop")
    assert caught.value.reason == "overlong"
    first_answer = full.loss_mask.index(1)
    with pytest.raises(MaskingError) as caught:  # nothing of the first answer fits: no loss token left
        masker.encode(CHAT, max_length=first_answer)
    assert caught.value.reason == "no_loss_tokens"
