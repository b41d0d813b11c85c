"""Assistant-only loss masks from the verifier's own chat template.

mask = 1 exactly on the tokens the model generates in an assistant turn: its content (including a ``<think>``
block when the template renders one) and the end-of-turn token it must emit; 0 on system/user turns and on template
tokens (role headers, the newline after the end-of-turn token). An answer marked ``"truncated": true`` (regenerated
and cut at ``max_new_tokens``) keeps its content in the loss but not the end-of-turn token the template closes it
with: the verifier never emitted it. Two ways, tried in this order:

1. ``{% generation %}`` blocks in the template: ``apply_chat_template(..., return_assistant_tokens_mask=True)``
   gives the spans the template's author declared (extended by one token when the end-of-turn token follows).
2. Incremental rendering: for assistant turn i, ``ids(messages[:i], add_generation_prompt=True)`` and
   ``ids(messages[:i+1])`` must both be token prefixes of ``ids(messages)``; the span between them, cut after the
   first end-of-turn token, is the turn. The prefix check is what makes this reliable: a template that re-renders
   history (Qwen3 drops earlier ``<think>`` blocks) fails it, and then ``turn_mode`` decides:
     whole     one sample per conversation; refuse a template that is not prefix-stable,
     per_turn  one sample per assistant turn (context rendered as the template renders history),
     auto      whole when the template is prefix-stable on a probe conversation, else per_turn.

:class:`ChatMasker` probes the template once (a two-turn conversation, with a ``<think>`` block in the first
answer) and raises :class:`TemplateError` — instead of masking everything — when it has no chat template, ignores
``add_generation_prompt``, ends turns without a special token, or is not prefix-stable even turn by turn.
Conversations whose text contains one of the tokenizer's special tokens (e.g. a literal ``<|im_end|>``) are
refused per conversation: they would forge turn boundaries. So is a conversation the template itself refuses (a
strict template's ``raise_exception("Conversation roles must alternate ...")``, as Gemma 3's, Llama-2's and
Mistral's do): :class:`MaskingError` ``template_error``, dropped and counted by the pipeline, never the run.

Error replay (``data_gen.regenerate.backend: engine``, :mod:`data_gen.error_replay`): an assistant message carrying
``"rejected_at"`` (character offsets in its content where the current draft's token was rejected) gives its sample
per-token ``loss_weight``: the masker finds the content verbatim in the rendered text (after the turn's generation
prompt), maps each offset to the loss token holding it, and weights it ``replay_weight`` against 1.0 for the other
loss tokens, scaled to a mean of 1.0 over the sample's loss tokens (after any truncation). A content the template
does not render verbatim (Qwen3 splitting a ``<think>`` block out of it), or a generation-tag template whose text
re-tokenises differently from its ids, gets no emphasis for that turn. Samples without any ``rejected_at``, and
every sample when ``replay_weight`` is 1.0, keep ``loss_weight=None``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_gen.error_replay import normalized, replay_weights
from data_gen.sources import Conversation
from speculators.families import ChatFormat

TURN_MODES = ("auto", "whole", "per_turn")
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
PROBE = [
    {"role": "user", "content": "Hello! Who are you?"},
    {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nI am a helpful assistant."},
    {"role": "user", "content": "Tell me a joke."},
    {"role": "assistant", "content": "Why did the chicken cross the road? To get to the other side."},
]


class TemplateError(ValueError):
    """The chat template cannot be masked reliably; the message says why and what to do."""


class MaskingError(ValueError):
    """One conversation cannot be masked (counted and dropped by the pipeline); ``reason`` is the count key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@contextmanager
def template_refusals() -> Iterator[None]:
    """A Jinja error while rendering (a strict template's ``raise_exception("Conversation roles must
    alternate ...")``, an undefined field) as :class:`MaskingError` ``template_error``: it is about the
    conversation, which is dropped and counted, not about the run."""
    from jinja2.exceptions import TemplateError as JinjaTemplateError

    try:
        yield
    except JinjaTemplateError as error:
        raise MaskingError("template_error", f"the chat template refused it: {error}") from None


@dataclass
class EncodedSample:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]  # 0/1, same length
    truncated: bool = False
    # error replay: per-token weights, 0 outside the loss mask, mean 1.0 over loss tokens (None: uniform)
    loss_weight: list[float] | None = None


TEMPLATE_FILE_SUFFIXES = (".jinja", ".j2", ".txt")


def looks_like_path(value: str) -> bool:
    """Whether ``data.chat_template`` names a file rather than holding the template's text: one line without Jinja
    markup that is an existing file, ends in a template suffix or contains a path separator. Template text always
    has ``{{``/``{%`` and a path has neither, so a missing file is never mistaken for a (useless) template."""
    if "\n" in value or "{{" in value or "{%" in value:
        return False
    return value.strip().endswith(TEMPLATE_FILE_SUFFIXES) or "/" in value or "\\" in value or _is_file(value)


def _is_file(value: str) -> bool:
    try:
        return Path(value).expanduser().is_file()
    except OSError:  # e.g. a name too long for the file system: not a file
        return False


def load_chat_template(tokenizer: Any, override: str | None = None) -> str:
    """The template to use: ``override`` (a Jinja file path or the template text) or the tokenizer's own.

    A path that does not exist is an error: used as the template's text it would fail later with a message about
    the template (no generation prompt, no end-of-turn token) instead of the missing file."""
    if override:
        if not looks_like_path(override):  # template text (never stat'ed: a long one is no valid file name)
            return override
        path = Path(override).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
        state = "is a directory" if path.is_dir() else "does not exist"
        raise TemplateError(
            f"data.chat_template={override!r}: {path} {state}; give an existing Jinja template file (or the "
            "template's text itself), or leave data.chat_template unset to use the tokenizer's own"
        )
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not template:
        name = getattr(tokenizer, "name_or_path", "the verifier's tokenizer")
        raise TemplateError(
            f"{name} has no chat template, so assistant tokens cannot be told apart from the prompt. Use an "
            "instruct/chat verifier, or set data.chat_template to a Jinja template file for this tokenizer."
        )
    return template


class ChatMasker:
    """Tokenises conversations with the verifier's chat template and marks the assistant tokens.

    ``replay_weight``: the emphasis of a rejected draft token (``data_gen.regenerate.replay_weight``; the pipeline's
    ``build_regenerator`` sets it for the engine back-end); 1.0 builds no weights."""

    replay_weight: float = 1.0

    def __init__(
        self,
        tokenizer: Any,
        turn_mode: str = "auto",
        chat_template: str | None = None,
        chat: ChatFormat | None = None,
    ) -> None:
        if turn_mode not in TURN_MODES:
            raise ValueError(f"data.turn_mode={turn_mode!r}; use one of {TURN_MODES}")
        self.tokenizer = tokenizer
        self.template = load_chat_template(tokenizer, chat_template)
        self.special_tokens = {
            token.content: index
            for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if getattr(token, "special", False)
        }
        for token, index in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=False):
            self.special_tokens.setdefault(token, index)
        self.special_ids = set(self.special_tokens.values())
        self.chat = chat or ChatFormat()  # the verifier family's chat format (speculators/families)
        vocab = tokenizer.get_vocab()
        self.declared_eot_ids = {vocab[token] for token in self.chat.end_of_turn if token in vocab}
        self.uses_generation_tags = bool(GENERATION_TAG.search(self.template))
        self._probe(turn_mode)

    def _probe(self, turn_mode: str) -> None:
        """Check the template on :data:`PROBE` and settle the turn mode; a template that fails on this plain,
        alternating conversation is refused as a whole (:class:`TemplateError`)."""
        try:
            self._probe_template(turn_mode)
        except MaskingError as problem:
            if problem.reason != "template_error":
                raise
            raise TemplateError(
                f"the chat template cannot render a plain two-turn conversation ({problem}); fix the template or "
                "give data.chat_template"
            ) from None

    def _probe_template(self, turn_mode: str) -> None:
        requested = turn_mode
        self.eot_id = self._probe_end_of_turn()
        # every token that ends an assistant turn: the family's (harmony ends the last answer with <|return|>,
        # the ones in history with <|end|>), else the one the probe found
        self.eot_ids = self.declared_eot_ids or {self.eot_id}
        self.prefix_stable = self._is_prefix_stable(PROBE)
        if turn_mode == "auto":
            turn_mode = "whole" if self.prefix_stable or self.uses_generation_tags else "per_turn"
        if turn_mode == "whole" and not (self.prefix_stable or self.uses_generation_tags):
            raise TemplateError(
                "the chat template renders earlier turns differently once later turns follow (e.g. it drops "
                "earlier <think> blocks), so one sample per conversation cannot be masked reliably; set "
                "data.turn_mode=per_turn (or auto)"
            )
        if turn_mode == "per_turn":
            self._check_per_turn(PROBE)
        self.turn_mode = turn_mode
        self.fallback_per_turn = requested == "auto"  # a conversation that is not prefix-stable goes per turn

    # ---- rendering --------------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (what ``apply_chat_template`` tokenises); a template that refuses
        them raises :class:`MaskingError` (``template_error``), so only that conversation is dropped."""
        with template_refusals():
            return self.tokenizer.apply_chat_template(
                messages,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )

    def tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets, tokenised exactly as ``apply_chat_template`` does (no extra BOS)."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]

    def prompt_text(self, messages: list[dict[str, str]]) -> str:
        """The text the verifier continues to answer after ``messages`` (used by regeneration)."""
        return self.render(messages, add_generation_prompt=True)

    @property
    def eot_token(self) -> str:
        return self.tokenizer.convert_ids_to_tokens(self.eot_id)

    def describe(self) -> dict[str, Any]:
        return {
            "method": "generation_tags" if self.uses_generation_tags else "incremental",
            "turn_mode": self.turn_mode,
            "eot_token": self.eot_token,
            "eot_id": self.eot_id,
            "prefix_stable": self.prefix_stable,
        }

    # ---- probing the template -----------------------------------------------------------------------------
    def _probe_end_of_turn(self) -> int:
        first = PROBE[:1]
        prompt = self.render(first, True)
        if prompt == self.render(first, False) and not self.chat.prompt_ends_user_turn:
            raise TemplateError(
                "the chat template ignores add_generation_prompt, so the start of an assistant turn cannot be "
                "located; fix the template (it must emit the assistant header when add_generation_prompt is set)"
            )
        answered = self.render(PROBE[:2])
        if not answered.startswith(prompt):
            raise TemplateError(
                "the chat template's generation prompt is not a prefix of the rendered assistant turn, so "
                "assistant tokens cannot be located; fix the template or give data.chat_template"
            )
        ids, offsets = self.tokenize(answered)
        start = _token_starting_at(offsets, len(prompt))
        if start is None:
            raise TemplateError(
                "the end of the chat template's generation prompt falls inside a token of the rendered turn, so "
                "the first assistant token is ambiguous; fix the template or give data.chat_template"
            )
        ends = self.declared_eot_ids or self.special_ids  # harmony's <|channel|> is special but no turn end
        eot = next((token for token in ids[start:] if token in ends), None)
        if eot is None:
            raise TemplateError(
                "the chat template ends assistant turns without a special end-of-turn token, so the mask could "
                "not include the token that stops generation; use a template with one (e.g. <|im_end|>, "
                "<|eot_id|>)"
            )
        return eot

    def _is_prefix_stable(self, messages: list[dict[str, str]]) -> bool:
        full = self.render(messages)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if not (
                full.startswith(self.render(messages[:i], True))
                and full.startswith(self.render(messages[: i + 1]))
            ):
                return False
        return True

    def _check_per_turn(self, messages: list[dict[str, str]]) -> None:
        for i, message in enumerate(messages):
            if message["role"] == "assistant" and not self.render(messages[: i + 1]).startswith(
                self.render(messages[:i], True)
            ):
                raise TemplateError(
                    "even turn by turn, the chat template's generation prompt is not a prefix of the rendered "
                    "answer; this template cannot be masked reliably — give data.chat_template"
                )

    # ---- encoding -----------------------------------------------------------------------------------------
    def encode(
        self, conversation: Conversation, max_length: int, overlong: str = "truncate"
    ) -> list[EncodedSample]:
        """The samples of one conversation (one, or one per assistant turn), truncated or refused when too long."""
        try:
            return self._encode(conversation, max_length, overlong)
        except MaskingError as problem:
            if problem.reason != "template_error":
                raise
            raise MaskingError(problem.reason, f"conversation {conversation.id!r}: {problem}") from None

    def _encode(self, conversation: Conversation, max_length: int, overlong: str) -> list[EncodedSample]:
        self._refuse_special_tokens(conversation)
        if self.uses_generation_tags:
            raw = [self._encode_tagged(conversation)]
        elif self.turn_mode == "whole":
            try:
                raw = [self._encode_whole(conversation, max_length)]
            except MaskingError as problem:
                if problem.reason != "unstable_template" or not self.fallback_per_turn:
                    raise
                raw = self._encode_per_turn(conversation, max_length)
        else:
            raw = self._encode_per_turn(conversation, max_length)
        return [fit_length(sample, max_length, overlong) for sample in raw]

    def _refuse_special_tokens(self, conversation: Conversation) -> None:
        for message in conversation.messages:
            found = next((token for token in self.special_tokens if token in message["content"]), None)
            if found is not None:
                raise MaskingError(
                    "special_token_in_content",
                    f"conversation {conversation.id!r}: a {message['role']} turn contains the special token "
                    f"{found!r}, which would forge a turn boundary",
                )

    def _span(
        self, ids: list[int], offsets: list[tuple[int, int]], prompt_chars: int, answer_chars: int, where: str
    ) -> tuple[int, int]:
        """Token range [start, eot] of the assistant turn rendered between two character positions."""
        start = _token_starting_at(offsets, prompt_chars)
        if start is None:
            raise MaskingError(
                "boundary_inside_token",
                f"{where}: the first assistant token merges with the template's header; cannot mask it reliably",
            )
        # the LAST end-of-turn token inside the turn: one for most templates, but a harmony answer carries its
        # analysis message (<|end|>) before the final one (<|return|>), and the model writes both
        end = None
        for position in range(start, len(ids)):
            if offsets[position][0] >= answer_chars:
                break
            if ids[position] in self.eot_ids:
                end = position
        if end is not None:
            return start, end
        raise MaskingError(
            "no_end_of_turn", f"{where}: an assistant turn has no {self.eot_token!r} where it ends"
        )

    def _encode_tagged(self, conversation: Conversation) -> EncodedSample:
        with template_refusals():
            out = self.tokenizer.apply_chat_template(
                conversation.messages,
                chat_template=self.template,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        for position in range(len(ids) - 1):  # a span the template closed before the end-of-turn token
            if mask[position] == 1 and mask[position + 1] == 0 and ids[position + 1] in self.eot_ids:
                mask[position + 1] = 1
        if not any(mask):
            raise MaskingError(
                "unmaskable", f"conversation {conversation.id!r}: the template marked no token"
            )
        self._unmask_closing_of_truncated(conversation, ids, mask)
        return EncodedSample(
            conversation.id, ids, mask, loss_weight=self._tagged_weights(conversation, ids, mask)
        )

    # ---- error replay -----------------------------------------------------------------------------------------
    def _rejected_chars(
        self, message: dict[str, Any], text: str, after: int, before: int
    ) -> list[int] | None:
        """Absolute offsets in ``text`` of an assistant message's ``rejected_at``, its content searched verbatim in
        ``text[after:before]`` (the turn); ``[]`` when it is not there, None when the message carries none."""
        if message.get("rejected_at") is None:
            return None
        start = text.find(message["content"], after, before)
        return [] if start < 0 else [start + int(offset) for offset in message["rejected_at"]]

    def _weights(
        self, mask: list[int], offsets: list[tuple[int, int]], rejected: list[int] | None
    ) -> list[float] | None:
        """Raw per-token weights (normalised by :func:`fit_length`), or None without rejections or emphasis."""
        if rejected is None or self.replay_weight == 1.0:
            return None
        return replay_weights(mask, offsets, rejected, self.replay_weight)

    def _tagged_weights(
        self, conversation: Conversation, ids: list[int], mask: list[int]
    ) -> list[float] | None:
        """Weights for a generation-tag sample: its ids come without character offsets, so the rendered text is
        tokenised again; when that gives other ids the offsets cannot be trusted and the sample gets none."""
        messages = conversation.messages
        if self.replay_weight == 1.0 or all(m.get("rejected_at") is None for m in messages):
            return None
        full = self.render(messages)
        again, offsets = self.tokenize(full)
        if again != ids:
            return None
        rejected: list[int] | None = None
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], True)
            after = len(prompt) if full.startswith(prompt) else cursor
            rejected = _add(rejected, self._rejected_chars(message, full, after, len(full)))
            found = full.find(message["content"], after)
            cursor = found + len(message["content"]) if found >= 0 else cursor
        return self._weights(mask, offsets, rejected)

    def _unmask_closing_of_truncated(
        self, conversation: Conversation, ids: list[int], mask: list[int]
    ) -> None:
        """Generation-tag spans in answer order: drop the end-of-turn token ending the span of a truncated answer."""
        answers = [m for m in conversation.messages if m["role"] == "assistant"]
        ends = [p for p in range(len(mask)) if mask[p] and (p + 1 == len(mask) or not mask[p + 1])]
        for message, end in zip(answers, ends, strict=False):
            if message.get("truncated") and ids[end] in self.eot_ids:
                mask[end] = 0

    def _encode_whole(self, conversation: Conversation, max_length: int) -> EncodedSample:
        messages = conversation.messages
        full = self.render(messages)
        ids, offsets = self.tokenize(full)
        mask = [0] * len(ids)
        rejected: list[int] | None = None  # absolute character offsets of rejected tokens in ``full``
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, answered = self.render(messages[:i], True), self.render(messages[: i + 1])
            if not (full.startswith(prompt) and full.startswith(answered)):
                raise MaskingError(
                    "unstable_template",
                    f"conversation {conversation.id!r}: turn {i} renders differently inside the whole "
                    "conversation; use data.turn_mode=per_turn",
                )
            start, eot = self._span(
                ids, offsets, len(prompt), len(answered), f"conversation {conversation.id!r}"
            )
            if start >= max_length:
                break  # this turn and the later ones are beyond max_length anyway
            end = _loss_end(message, eot)
            mask[start:end] = [1] * (end - start)
            rejected = _add(rejected, self._rejected_chars(message, full, len(prompt), len(answered)))
        return EncodedSample(conversation.id, ids, mask, loss_weight=self._weights(mask, offsets, rejected))

    def _encode_per_turn(self, conversation: Conversation, max_length: int) -> list[EncodedSample]:
        messages = conversation.messages
        samples = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, answered = self.render(messages[:i], True), self.render(messages[: i + 1])
            if not answered.startswith(prompt):
                raise MaskingError(
                    "unstable_template",
                    f"conversation {conversation.id!r}: turn {i}'s prompt is not a prefix of its answer",
                )
            ids, offsets = self.tokenize(answered)
            start, eot = self._span(
                ids, offsets, len(prompt), len(answered), f"conversation {conversation.id!r}"
            )
            if start >= max_length:
                break
            end = _loss_end(message, eot)
            mask = [0] * start + [1] * (end - start) + [0] * (len(ids) - end)
            rejected = self._rejected_chars(message, answered, len(prompt), len(answered))
            weights = self._weights(mask, offsets, rejected)
            samples.append(EncodedSample(f"{conversation.id}#turn{i}", ids, mask, loss_weight=weights))
        if not samples:
            raise MaskingError(
                "overlong", f"conversation {conversation.id!r}: every prompt exceeds max_length"
            )
        return samples


def _add(found: list[int] | None, more: list[int] | None) -> list[int] | None:
    """Rejected offsets of several turns together; None while no turn carried ``rejected_at``."""
    if more is None:
        return found
    return (found or []) + more


def _loss_end(message: dict[str, Any], eot: int) -> int:
    """End (exclusive) of an answer's loss span: after its end-of-turn token, or before it when the answer was cut
    at ``max_new_tokens`` (the template closes the turn, the verifier did not)."""
    return eot if message.get("truncated") else eot + 1


def _token_starting_at(offsets: list[tuple[int, int]], char: int) -> int | None:
    """Index of the first token that starts exactly at ``char`` (None when a token straddles it)."""
    for index, (begin, end) in enumerate(offsets):
        if begin == char:
            return index
        if begin < char < end or begin > char:
            return None
    return None


def fit_length(sample: EncodedSample, max_length: int, overlong: str) -> EncodedSample:
    """Truncate (keeping the start) or refuse a sample longer than ``max_length``; refuse one left without loss.
    Loss weights are cut with the ids and normalised here, once, over the loss tokens that remain."""
    if len(sample.input_ids) > max_length:
        if overlong == "drop":
            raise MaskingError(
                "overlong",
                f"{sample.sample_id!r}: {len(sample.input_ids)} tokens > data.max_length={max_length}",
            )
        weights = sample.loss_weight[:max_length] if sample.loss_weight is not None else None
        sample = EncodedSample(
            sample.sample_id, sample.input_ids[:max_length], sample.loss_mask[:max_length], True, weights
        )
    if not any(sample.loss_mask):
        raise MaskingError(
            "no_loss_tokens", f"{sample.sample_id!r}: no assistant token within data.max_length"
        )
    if sample.loss_weight is not None:
        sample.loss_weight = normalized(sample.loss_weight, sample.loss_mask)
    return sample


__all__ = ["ChatMasker", "EncodedSample", "MaskingError", "TemplateError", "fit_length", "load_chat_template"]
