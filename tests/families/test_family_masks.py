"""Assistant-only loss masks for every declared family: the masked TEXT is exactly what the model writes in its
answer turns (the answer, what the family's format makes the model write around it, and the token that ends the
turn), never a role header, a system prompt or a user turn. Each family's tokenizer carries its real special
tokens and a chat template written from its documented format (tests/support/families.py)."""

from __future__ import annotations

import pytest

from data_gen.masks import ChatMasker
from data_gen.sources import Conversation
from speculators import families
from tests.support.families import CONVERSATIONS, TINY_FAMILIES, family_tokenizer

# (text the model writes before the answer, the token that ends the answer) per family, for a turn that is the
# last of what was rendered
WRAP = {
    "llama": ("", "<|eot_id|>"),
    "qwen2": ("", "<|im_end|>"),
    "qwen3": ("<think>\n\n</think>\n\n", "<|im_end|>"),  # the last answer carries its (empty) think block
    "qwen3_moe": ("<think>\n\n</think>\n\n", "<|im_end|>"),
    "gpt_oss": ("<|channel|>final<|message|>", "<|return|>"),  # the model writes the harmony channel header
    "gemma3_text": ("", "<end_of_turn>"),
    "gemma4": ("", "<turn|>"),
    "mistral3": ("", "</s>"),
    "granite": ("", "<|end_of_text|>"),
}
# templates that render an answer differently once a later turn follows: one sample per answer turn
PER_TURN = {"qwen3", "qwen3_moe", "gpt_oss"}


def masked_texts(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded runs of masked tokens."""
    runs, current = [], []
    for token, keep in zip(ids, mask, strict=True):
        if keep:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


@pytest.fixture(scope="module", params=sorted(TINY_FAMILIES))
def family_masker(request):
    tokenizer = family_tokenizer(request.param)
    family = families.get(request.param)
    return request.param, tokenizer, ChatMasker(tokenizer, "auto", None, family.chat)


def test_every_declared_family_has_a_tiny_test_instance():
    assert sorted(TINY_FAMILIES) == families.names()
    assert len(families.names()) >= 8


def test_the_masked_text_is_exactly_the_assistant_answers(family_masker):
    name, tokenizer, masker = family_masker
    before, end = WRAP[name]
    assert masker.turn_mode == ("per_turn" if name in PER_TURN else "whole"), masker.describe()
    for index, messages in enumerate(CONVERSATIONS):
        samples = masker.encode(Conversation(f"c{index}", messages), max_length=4096)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        if name in PER_TURN:  # one sample per answer, each masking its own answer only
            assert len(samples) == len(answers)
            found = [masked_texts(tokenizer, s.input_ids, s.loss_mask) for s in samples]
            assert found == [[before + answer + end] for answer in answers], (name, found)
        else:
            (sample,) = samples
            found = masked_texts(tokenizer, sample.input_ids, sample.loss_mask)
            assert found == [before + answer + end for answer in answers], (name, found)
            # everything else is the template's and the users': none of it is in the loss
            unmasked = tokenizer.decode(
                [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m],
                skip_special_tokens=False,
            )
            for message in messages:
                if message["role"] != "assistant":
                    assert message["content"] in unmasked


def test_harmony_keeps_the_last_answers_analysis_and_drops_history_analysis():
    """gpt-oss: the analysis message the model writes before its final answer is in the loss (it is generated
    text); the template drops it from earlier turns, so the sample of the earlier turn has none."""
    tokenizer = family_tokenizer("gpt_oss")
    masker = ChatMasker(tokenizer, "auto", None, families.get("gpt_oss").chat)
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris.", "thinking": "The user asks about France."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome.", "thinking": "Now Italy."},
    ]
    first, second = masker.encode(Conversation("h", messages), max_length=4096)
    assert masked_texts(tokenizer, first.input_ids, first.loss_mask) == [
        "<|channel|>analysis<|message|>The user asks about France.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Paris.<|return|>"
    ]
    history = tokenizer.decode(second.input_ids, skip_special_tokens=False)
    assert "The user asks about France." not in history  # dropped from history by the template
    assert masked_texts(tokenizer, second.input_ids, second.loss_mask)[0].endswith("Rome.<|return|>")


def test_qwen3_strips_history_thinking_and_masks_the_last_think_block():
    tokenizer = family_tokenizer("qwen3")
    masker = ChatMasker(tokenizer, "auto", None, families.get("qwen3").chat)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreeting.\n</think>\n\nHello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "<think>\nFarewell.\n</think>\n\nGoodbye."},
    ]
    first, second = masker.encode(Conversation("t", messages), max_length=4096)
    assert masked_texts(tokenizer, first.input_ids, first.loss_mask) == [
        "<think>\nGreeting.\n</think>\n\nHello.<|im_end|>"
    ]
    assert "Greeting." not in tokenizer.decode(second.input_ids)
    assert masked_texts(tokenizer, second.input_ids, second.loss_mask) == [
        "<think>\nFarewell.\n</think>\n\nGoodbye.<|im_end|>"
    ]


def test_mistral_needs_its_family_to_accept_a_template_without_generation_prompt():
    """[/INST] ends the user turn and is the generation prompt: without the family's declaration the masker
    refuses the template as one ignoring add_generation_prompt."""
    from data_gen.masks import TemplateError

    tokenizer = family_tokenizer("mistral3")
    with pytest.raises(TemplateError, match="ignores add_generation_prompt"):
        ChatMasker(tokenizer, "auto")
    assert ChatMasker(tokenizer, "auto", None, families.get("mistral3").chat).eot_token == "</s>"
