"""Session fixtures of the conformance suite: one verifier, every unit's fitted draft exported and decoded by our
engine (controls included), ONE vLLM worker for every vLLM request and ONE speculators-package interpreter for
every package request.

The verifier is a random 8-layer Llama (std 0.3) whose greedy tokens come from its first ``ALPHABET`` ids (the
other lm_head rows are zero): over 64 ids a token does not identify its successor, so a fitted draft must read the
aux states and a misread one shows (over the full vocabulary a quickly fitted block draft predicts mostly from the
anchor token, and aux ids one off cost it little).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from speculators import algorithms
from speculators.decoding.engine import DecodingConfig, SpeculativeDecoder, plain_generate
from speculators.mask_token import resolve_mask_token
from speculators.serving import vllm_bridge as bridge
from tests.conformance.units import NEW_TOKENS, UNITS, K, control_names, write_control
from tests.conftest import require_consumer
from tests.support.quickfit import FIT_TEXTS
from tests.support.tiny_models import single_thread
from tests.support.verifiers import build_tiny_verifier

INIT_STD = 0.3
ALPHABET = 64


@dataclass
class Verifier:
    directory: Path
    model: Any
    prompts: list[list[int]]
    plain: list[list[int]]  # plain greedy decoding of the prompts
    mask_token_id: int
    mask_token_source: str


@dataclass
class Export:
    directory: Path
    summary: dict[str, Any]  # our engine's DecodingStats summary of the draft read back from ``directory``
    tokens: list[list[int]]
    draft: Any = None  # the fitted model (the unit's own export only, not its controls)


def chat_prompts(tokenizer) -> list[list[int]]:
    """``FIT_TEXTS`` as SmolLM2 chat prompts (token ids: both engines get exactly the same input)."""
    prompts = []
    for text in FIT_TEXTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


@pytest.fixture(scope="session")
def conformance_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("conformance")


@pytest.fixture(scope="session")
def verifier(conformance_root, smollm2_tokenizer) -> Verifier:
    """The suite's verifier (module docstring), its plain greedy outputs and the mask token the trainer picks."""
    from transformers import AutoModelForCausalLM

    directory = build_tiny_verifier(
        conformance_root / "verifier",
        arch="llama",
        tokenizer=smollm2_tokenizer,
        vocab_size=len(smollm2_tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=INIT_STD,
    )
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight[ALPHABET:] = 0.0
    model.save_pretrained(directory)
    prompts = chat_prompts(smollm2_tokenizer)
    with single_thread(), torch.no_grad():
        plain = plain_generate(model, prompts, max_new_tokens=NEW_TOKENS).tokens
    assert max(max(tokens) for tokens in plain) < ALPHABET
    mask_id, reason = resolve_mask_token(smollm2_tokenizer, model.config.vocab_size)
    return Verifier(directory, model, prompts, plain, mask_id, reason)


def decode(verifier: Verifier, directory: Path) -> Export:
    """Our engine's greedy decoding of the prompts with the draft read back from ``directory`` (k = K)."""
    draft = algorithms.load_draft(directory, dtype=torch.float32).eval()
    settings = DecodingConfig(method="chain", num_speculative_tokens=K, max_new_tokens=NEW_TOKENS)
    with torch.no_grad():
        result = SpeculativeDecoder(verifier.model, draft, settings).generate(verifier.prompts)
    return Export(directory, result.stats.summary(), result.tokens)


@pytest.fixture(scope="session")
def exports(conformance_root, verifier) -> dict[str, Export]:
    """``type`` -> the unit's fitted draft, exported (fp32) and decoded by our engine from the export;
    ``type/control`` -> the same for each control copy."""
    out = {}
    with single_thread():  # 2 shared cores: every extra OpenMP thread waits out a scheduler slice per op
        for name, unit in UNITS.items():
            draft = unit.fit(verifier)
            directory = draft.save_pretrained(conformance_root / name, dtype=torch.float32)
            out[name] = decode(verifier, directory)
            out[name].draft = draft
        for control in control_names():
            name, what = control.split("/")
            target = conformance_root / f"{name}-{what}"
            out[control] = decode(verifier, write_control(out[name].directory, target, what))
    return out


@pytest.fixture(scope="session")
def vllm_served(exports, verifier, conformance_root) -> dict[str, bridge.VllmResult | str]:
    """Every unit's export and control, and plain decoding, in ONE vLLM worker (a session: one vLLM import, an
    engine per configuration; fp32, greedy, EOS ignored). name -> its result, or vLLM's error text where it
    refused the request (the session survives a refused request)."""
    require_consumer(bridge.vllm_available(), "the vLLM virtualenv", "vllm-env")
    common = dict(
        prompts=verifier.prompts, max_tokens=NEW_TOKENS, ignore_eos=True, dtype="float32", max_model_len=256
    )
    names = [*UNITS, *control_names()]
    out: dict[str, bridge.VllmResult | str] = {}
    with bridge.VllmSession(timeout=900, log_path=conformance_root / "vllm-worker.log") as session:
        out["plain"] = session.run(bridge.VllmRequest(name="plain", model=verifier.directory, **common))
        for name in names:
            if UNITS[name.split("/")[0]].vllm_cpu_refusal and "/" in name:
                continue  # a refused type's controls would only repeat its refusal
            spec = bridge.draft_speculative_config(exports[name].directory)
            request = bridge.VllmRequest(
                name=name, model=verifier.directory, speculative_config=spec, **common
            )
            try:
                out[name] = session.run(request)
            except bridge.VllmError as error:
                out[name] = str(error)
    return out


@pytest.fixture(scope="session")
def aux_sequence(verifier) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The first prompt and its greedy continuation ``[1, T]``, and the verifier's hidden states by layer index
    (``hidden_states[k]``: the stream entering layer k, the aux-id convention of our configs and of vLLM)."""
    sequence = torch.tensor([verifier.prompts[0] + verifier.plain[0]])
    with torch.no_grad():
        states = verifier.model(sequence, output_hidden_states=True).hidden_states
    return sequence, dict(enumerate(states))


def package_anchors(verifier: Verifier) -> list[int]:
    """Block anchors inside the continuation, each at least a block before the end (the package never anchors
    in the last block)."""
    start = len(verifier.prompts[0])
    return [start, start + 9, start + 18]


def peagle_elements(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor, depth) elements as COD lays them out: depth 0 at every position, then chains from three seeds."""
    anchors, depths = [torch.arange(length)], [torch.zeros(length, dtype=torch.long)]
    seeds = torch.tensor([length // 4, length // 2, (3 * length) // 4])
    for depth in range(1, K + 1):
        chosen = seeds if depth < K else seeds[1:2]
        anchors.append(chosen)
        depths.append(torch.full_like(chosen, depth))
    return torch.cat(anchors), torch.cat(depths)


@pytest.fixture(scope="session")
def package_results(exports, verifier, aux_sequence, conformance_root) -> dict[str, dict[str, Any]]:
    """Every unit's export loaded by speculators 0.9.0 in ONE interpreter of its virtualenv (package_batch.py),
    with that package's own forward where the unit names one. name -> {"description", "logits" (or absent)}."""
    from safetensors.torch import load_file, save_file

    from speculators.serving.speculators_package import (
        speculators_package_available,
        speculators_package_python,
    )
    from speculators.serving.worker_process import run_json_worker

    require_consumer(speculators_package_available(), "the speculators virtualenv", "speculators-env")
    sequence, states = aux_sequence
    work = conformance_root / "package"
    work.mkdir()
    jobs, outputs = [], {}
    for name, unit in UNITS.items():
        job: dict[str, Any] = {"model": str(exports[name].directory.resolve())}
        if unit.package_forward:
            aux = torch.cat(
                [states[i] for i in algorithms.get(name).aux_layer_ids(exports[name].draft.config)], dim=-1
            )
            inputs = {"hidden_states": aux.float(), "input_ids": sequence}
            if unit.package_forward == "block":
                inputs["anchors"] = torch.tensor(package_anchors(verifier))
            else:
                inputs["anchors"], inputs["depths"] = peagle_elements(sequence.shape[1])
            save_file(
                {k: v.contiguous() for k, v in inputs.items()}, str(work / f"{name}-inputs.safetensors")
            )
            outputs[name] = work / f"{name}-logits.safetensors"
            job[f"{unit.package_forward}_forward"] = {
                "inputs": str(work / f"{name}-inputs.safetensors"),
                "output": str(outputs[name]),
            }
        jobs.append(job)
    script = Path(__file__).with_name("package_batch.py")
    python = speculators_package_python()
    result = run_json_worker(python, script, {"jobs": jobs}, 900, "the speculators package", work / "log.txt")
    out = {}
    for name, description in zip(UNITS, result["jobs"], strict=True):
        out[name] = {"description": description}
        if name in outputs and description.get("ok"):
            out[name]["logits"] = load_file(str(outputs[name]))["logits"]
    return out
