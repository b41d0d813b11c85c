"""On-policy data: replace every assistant turn with the verifier's own answer, turn by turn.

A draft learns to predict what the VERIFIER would say; ShareGPT's answers come from another model. Regenerating
makes the training targets on-policy. Multi-turn conversations are regenerated turn by turn: the answer to turn i
is generated from the history that already holds the regenerated answers 1..i-1 (the user turns stay as they are).

Batched across conversations (``regenerate.batch_size``). Back-ends: ``transformers`` (``model.generate``,
everywhere), ``vllm`` (one ``speculators.serving.VllmSession`` for the run: vLLM runs in its own virtualenv and
its engine starts once; much faster where vLLM runs) and ``engine`` (our own speculative decoding engine with the
current draft, ``regenerate.draft``: the same greedy answers, plus where the draft's tokens were rejected, stored as
``"rejected_at"`` character offsets in each answer and weighted up in training; see :mod:`data_gen.error_replay`).
Resumable: each finished batch is appended to a JSONL cache and
fsynced; a rerun reuses what is there (a line cut by a kill is discarded). Sampling is seeded per batch from
``(seed, cache name, batch index)``, so a resumed run draws the same numbers as an uninterrupted one.

An answer cut at ``max_new_tokens`` stays cut: its message is marked ``"truncated": true`` and the masker leaves
the template's end-of-turn token after it out of the loss (the verifier never emitted it, so the draft must not
learn to predict an end there); ``answers_cut_at_max_new_tokens`` counts them in the data-gen stats. The engine
back-end also counts ``drafted_steps`` (verify steps) and ``rejected_tokens`` (rejections located in the answers).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data_gen.error_replay import rejected_char_offsets, rejected_positions, strip_offsets
from data_gen.masks import ChatMasker, MaskingError
from data_gen.sources import Conversation

BACKENDS = ("transformers", "vllm", "engine")
DRAFT_FILES = ("config.json", "*.safetensors")  # what makes a draft's identity (not its model card)
log = logging.getLogger("data_gen")


@dataclass
class RegenerateSettings:
    """``data_gen.regenerate`` of the recipe (see recipes/data_gen/default.yaml)."""

    enabled: bool = False
    backend: str = "transformers"
    temperature: float = 0.0
    max_new_tokens: int = 512
    batch_size: int = 16
    threads: int | None = None
    draft: str | None = None  # engine: a draft export directory or a training run (its best checkpoint)
    k: int = 3  # engine: drafted tokens per verify step (chain length)
    replay_weight: float = 1.0  # engine: weight of a rejected token before normalisation (1.0: no emphasis)

    def check(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"data_gen.regenerate.backend={self.backend!r}; use one of {BACKENDS}")
        self._check_engine()
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"data_gen.regenerate.threads={self.threads}; use null (every core) or >= 1")
        if self.temperature < 0 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError(
                "data_gen.regenerate needs temperature >= 0, max_new_tokens >= 1 and batch_size >= 1"
            )

    def _check_engine(self) -> None:
        """The engine back-end's settings; ``draft`` given to another back-end is refused, not silently ignored."""
        if self.backend != "engine":
            if self.draft is not None:
                raise ValueError(
                    f"data_gen.regenerate.draft is read by backend=engine only (backend is {self.backend!r})"
                )
            return
        if not self.draft:
            raise ValueError(
                "data_gen.regenerate.backend=engine needs data_gen.regenerate.draft: the draft export directory "
                "or training run whose rejections are replayed"
            )
        if self.temperature > 0:
            raise ValueError(
                f"data_gen.regenerate.backend=engine decodes greedily (temperature={self.temperature} given): its "
                "rejections are measured against the verifier's greedy choice; set temperature: 0"
            )
        if self.k < 1 or not 0 < self.replay_weight < float("inf"):
            raise ValueError(
                f"data_gen.regenerate needs k >= 1 and a finite replay_weight > 0 (k={self.k}, "
                f"replay_weight={self.replay_weight})"
            )


@dataclass(frozen=True)
class Answer:
    """One generated answer: its text (special tokens removed) and whether ``max_new_tokens`` cut it (no stop
    token was generated). The engine back-end adds ``rejected_at``, character offsets in ``text`` where a rejected
    draft token starts (``len(text)``: the stop token; see :mod:`data_gen.error_replay`), and ``drafted_steps``,
    its verify steps; 0 means the answer was not decoded speculatively (the other back-ends), so no
    ``rejected_at`` is stored for it."""

    text: str
    truncated: bool = False
    rejected_at: tuple[int, ...] = ()
    drafted_steps: int = 0

    def stripped(self) -> tuple[str, tuple[int, ...]]:
        """The stored content (``text.strip()``) and ``rejected_at`` moved into it."""
        return strip_offsets(self.text, self.rejected_at)


# A generate function takes prompt token ids and a seed and returns one Answer per prompt.
GenerateFn = Callable[[list[list[int]], int], list[Answer]]


def transformers_generate(
    model: Any, tokenizer: Any, settings: RegenerateSettings, stop_ids: list[int]
) -> GenerateFn:
    """Batched ``model.generate`` with left padding; greedy at temperature 0. An answer without any of
    ``stop_ids`` ran into ``max_new_tokens``."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    stops = set(stop_ids)

    def generate(prompts: list[list[int]], seed: int) -> list[Answer]:
        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        torch.manual_seed(seed)
        sampling = {"do_sample": True, "temperature": settings.temperature, "top_p": 1.0, "top_k": 0}
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=settings.max_new_tokens,
                eos_token_id=stop_ids,
                pad_token_id=pad_id,
                **(sampling if settings.temperature > 0 else {"do_sample": False}),
            )
        return [
            Answer(
                tokenizer.decode(row[width:], skip_special_tokens=True),
                truncated=stops.isdisjoint(row[width:].tolist()),
            )
            for row in out.cpu()
        ]

    return generate


def load_engine_draft(source: str, verifier: Any) -> Any:
    """The draft ``source`` names (an export directory, a ``step-<N>`` checkpoint or a run directory: its best
    checkpoint), loaded as ``speculators eval`` loads it, on the verifier's device and in its dtype."""
    from speculators.algorithms import load_draft
    from speculators.runs import resolve_draft_dir

    weight = next(verifier.parameters())
    draft = load_draft(resolve_draft_dir(source), dtype=weight.dtype)
    return draft.to(device=weight.device, dtype=weight.dtype)


def draft_fingerprint(source: str) -> str:
    """sha256 of the config and weights of the draft ``source`` resolves to: the run identity names the draft by
    content, so a resume after the run directory's best checkpoint changed (or with another draft) is refused, and
    moving the directory or rewriting its model card is not."""
    from speculators.runs import resolve_draft_dir

    directory = resolve_draft_dir(source)
    digest = hashlib.sha256()
    for path in sorted({p for pattern in DRAFT_FILES for p in directory.glob(pattern)}):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def engine_generate(
    verifier: Any, draft: Any, tokenizer: Any, settings: RegenerateSettings, stop_ids: list[int]
) -> GenerateFn:
    """Batched greedy chain decoding with :class:`~speculators.decoding.engine.SpeculativeDecoder`: the
    verifier's own answers (lossless), each with the character offsets of its rejected draft tokens. The seed is
    unused: greedy decoding draws nothing."""
    from speculators.decoding.engine import DecodingConfig, SpeculativeDecoder

    config = DecodingConfig(
        method="chain",
        num_speculative_tokens=settings.k,
        temperature=0.0,
        max_new_tokens=settings.max_new_tokens,
    )
    # refuses a k the draft cannot draft (a block draft's slots), before any write
    decoder = SpeculativeDecoder(verifier, draft, config)
    stops = set(stop_ids)

    def decode(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=True)

    def answer(tokens: list[int], steps: list[int]) -> Answer:
        ended = not stops.isdisjoint(tokens)
        positions = rejected_positions(steps, settings.k, len(tokens))
        text, offsets = rejected_char_offsets(decode, tokens, positions, ended)
        return Answer(text, truncated=not ended, rejected_at=offsets, drafted_steps=len(steps))

    def generate(prompts: list[list[int]], seed: int) -> list[Answer]:
        result = decoder.generate(prompts, eos_token_ids=stop_ids)
        return [answer(t, s) for t, s in zip(result.tokens, result.stats.accepted, strict=True)]

    return generate


class VllmGenerator:
    """The vLLM back-end: one :class:`~speculators.serving.VllmSession` for the whole run (vLLM lives in its own
    virtualenv), so the engine starts once, not once per turn round (~20 s each on CPU). vLLM stops at the
    verifier's generation-config EOS ids and strips special tokens from the texts; finish reason ``length`` means
    the answer was cut. Call :meth:`close` at the end.
    """

    def __init__(
        self, verifier_path: str, settings: RegenerateSettings, dtype: str, max_model_len: int
    ) -> None:
        try:
            from speculators.serving.vllm_bridge import VllmSession, vllm_available
        except ImportError as error:
            raise RuntimeError(
                "data_gen.regenerate.backend=vllm is not available: speculators.serving.vllm_bridge "
                f"cannot be imported ({error}); use backend=transformers"
            ) from error
        if not vllm_available():
            raise RuntimeError(
                "data_gen.regenerate.backend=vllm is not available: the vLLM virtualenv is missing or has no "
                "vLLM (run `make vllm-env`, or set SPECULATORS_VLLM_PYTHON); or use backend=transformers"
            )
        self.verifier_path = verifier_path
        self.settings = settings
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.session = VllmSession(threads=settings.threads or os.cpu_count())

    def __call__(self, prompts: list[list[int]], seed: int) -> list[Answer]:
        from speculators.serving.vllm_bridge import VllmRequest

        request = VllmRequest(
            model=self.verifier_path,
            prompts=[list(p) for p in prompts],
            max_tokens=self.settings.max_new_tokens,
            temperature=self.settings.temperature,
            seed=seed,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            name="regenerate",
        )
        result = self.session.run(request)
        return [
            Answer(text, truncated=reason == "length")
            for text, reason in zip(result.texts, result.finish_reasons, strict=True)
        ]

    def close(self) -> None:
        self.session.close()


# ---- the resumable cache ------------------------------------------------------------------------------------
def read_cache(path: Path) -> dict[str, dict[str, Any]]:
    """Entries already regenerated; a trailing line cut by a kill is removed from the file."""
    if not path.exists():
        return {}
    raw = path.read_bytes()
    good_end = raw.rfind(b"\n") + 1
    if good_end < len(raw):
        with open(path, "r+b") as handle:
            handle.truncate(good_end)
    entries = {}
    for line in raw[:good_end].decode("utf-8").splitlines():
        if line.strip():
            entry = json.loads(line)
            entries[entry["id"]] = entry
    return entries


def append_cache(path: Path, entries: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries))
        handle.flush()
        os.fsync(handle.fileno())


def batch_seed(seed: int, name: str, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}\0{name}\0{index}".encode()).digest()[:4], "big")


# ---- regeneration -------------------------------------------------------------------------------------------
class Regenerator:
    """Regenerates conversations batch by batch through a :data:`GenerateFn`, caching results in JSONL."""

    def __init__(
        self,
        generate: GenerateFn,
        masker: ChatMasker,
        settings: RegenerateSettings,
        max_length: int,
        seed: int,
    ) -> None:
        self.generate = generate
        self.masker = masker
        self.settings = settings
        self.max_length = max_length
        self.seed = seed

    def close(self) -> None:
        """Release the back-end (the vLLM worker process); a no-op for ``transformers``."""
        close = getattr(self.generate, "close", None)
        if close is not None:
            close()

    def regenerate(
        self, conversations: list[Conversation], cache: Path, progress: Callable[[int], None] | None = None
    ) -> tuple[list[Conversation], Counter]:
        """The regenerated conversations (same order; ones that lost every turn are left out) and counts."""
        done = read_cache(cache)
        size = self.settings.batch_size
        for index in range(0, (len(conversations) + size - 1) // size):
            batch = conversations[index * size : (index + 1) * size]
            if all(c.id in done for c in batch):
                continue
            entries = self._batch(batch, batch_seed(self.seed, cache.name, index))
            append_cache(cache, entries)
            done.update({e["id"]: e for e in entries})
            if progress is not None:
                progress(len(batch))
        counts: Counter = Counter()
        out = []
        for conversation in conversations:
            entry = done[conversation.id]
            counts.update(entry.get("counts", {}))
            if entry.get("messages"):
                out.append(Conversation(conversation.id, entry["messages"]))
        return out, counts

    def _batch(self, batch: list[Conversation], seed: int) -> list[dict[str, Any]]:
        messages = [[dict(m) for m in c.messages] for c in batch]
        counts = [Counter() for _ in batch]
        refused: set[int] = set()  # rows whose prompt the chat template refuses
        turn = 0
        while True:
            jobs = []  # (conversation, message index, prompt ids)
            for row, msgs in enumerate(messages):
                turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
                if turn >= len(turns) or row in refused:
                    continue
                position = turns[turn]
                try:
                    prompt = self.masker.tokenize(self.masker.prompt_text(msgs[:position]))[0]
                except MaskingError:
                    # a strict template refuses this conversation ("roles must alternate"): it stays as it is,
                    # and masking, which renders the same prefix, drops and counts it with the template's words
                    refused.add(row)
                    continue
                if len(prompt) >= self.max_length:  # nothing of this answer would fit: end the chat before it
                    messages[row] = msgs[:position]
                    counts[row]["turns_cut_at_max_length"] += 1
                    continue
                jobs.append((row, position, prompt))
            if not jobs:
                break
            started = time.perf_counter()
            answers = self.generate([prompt for _, _, prompt in jobs], seed + turn)
            log.info(  # a batch can take minutes: say how each turn round went
                "regenerate: turn round %d of %d conversations: %d answers in %.0f s",
                turn + 1,
                len(batch),
                len(jobs),
                time.perf_counter() - started,
            )
            for (row, position, _), answer in zip(jobs, answers, strict=True):
                text, rejected = answer.stripped()
                if not text:
                    messages[row] = messages[row][:position]
                    counts[row]["empty_answers"] += 1
                    continue
                message = messages[row][position]
                message["content"] = text
                message.pop("truncated", None)
                message.pop("rejected_at", None)
                if answer.truncated:  # the masker keeps its end-of-turn token out of the loss
                    message["truncated"] = True
                    counts[row]["answers_cut_at_max_new_tokens"] += 1
                if answer.drafted_steps:  # the masker weights these tokens up (data_gen.error_replay)
                    message["rejected_at"] = list(rejected)
                    counts[row]["drafted_steps"] += answer.drafted_steps
                    counts[row]["rejected_tokens"] += len(rejected)
                counts[row]["regenerated_turns"] += 1
            turn += 1
        entries = []
        for conversation, msgs, count in zip(batch, messages, counts, strict=True):
            has_answer = any(m["role"] == "assistant" for m in msgs)
            if not has_answer:
                count["conversations_without_answer"] += 1
            entries.append(
                {"id": conversation.id, "messages": msgs if has_answer else None, "counts": dict(count)}
            )
        return entries


__all__ = [
    "Answer",
    "RegenerateSettings",
    "Regenerator",
    "VllmGenerator",
    "draft_fingerprint",
    "engine_generate",
    "load_engine_draft",
    "transformers_generate",
]
