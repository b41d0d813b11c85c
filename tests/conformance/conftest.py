"""Session fixtures of the conformance suite: one verifier, every unit's fitted draft exported and decoded by our
engine (controls included), ONE vLLM worker for every vLLM request and ONE speculators-package interpreter for
every package request.

The verifier is a random 8-layer Llama (std 0.3) whose greedy tokens come from its first ``ALPHABET`` ids (the
other lm_head rows are zero): over 64 ids a token does not identify its successor, so a fitted draft must read the
aux states and a misread one shows (over the full vocabulary a quickly fitted block draft predicts mostly from the
anchor token, and aux ids one off cost it little).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from speculators import algorithms
from speculators.decoding.engine import DecodingConfig, SpeculativeDecoder, plain_generate
from speculators.mask_token import resolve_mask_token
from speculators.serving import vllm_bridge as bridge
from tests.conformance.units import (
    NEW_TOKENS,
    UNITS,
    K,
    control_names,
    source_names,
    unit_of,
    write_control,
    write_source,
)
from tests.conftest import require_consumer
from tests.support import quickfit
from tests.support.smollm2_drafts import CHAT_PROMPTS
from tests.support.tiny_models import single_thread
from tests.support.verifiers import build_tiny_verifier
from train.losses import shift_left

INIT_STD = 0.3
ALPHABET = 64
# the served units' deterministic-acceptance drafts (``deterministic_requests``): one token from the prefill, then
# K + 1 per verify step when every draft is accepted
DETERMINISTIC = [name for name, unit in UNITS.items() if not unit.vllm_cpu_refusal]
VERIFY_STEPS = 4
# served with one speculative token fewer than they draft (a caller's choice vLLM honours); not per algorithm
FEWER_TOKENS = ["eagle3"]
TINY_KV_CACHE_GIB = 0.0625
ZERO_TOKENS = 1 + VERIFY_STEPS * (K + 1)


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
    verifier: Verifier | None = None  # the suite verifier it decoded with (the unit's)


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
    prompts = quickfit.fit_prompts(smollm2_tokenizer)
    with single_thread(), torch.no_grad():
        plain = plain_generate(model, prompts, max_new_tokens=NEW_TOKENS).tokens
    assert max(max(tokens) for tokens in plain) < ALPHABET
    mask_id, reason = resolve_mask_token(smollm2_tokenizer, model.config.vocab_size)
    return Verifier(directory, model, prompts, plain, mask_id, reason)


@pytest.fixture(scope="session")
def mtp_verifier(conformance_root, smollm2_tokenizer) -> Verifier:
    """The MTP unit's verifier: a tiny Qwen3-Next shipping an MTP layer (tests/support/mtp.py), every layer full
    attention (a linear-attention layer's recurrent state cannot drop rejected draft tokens: docs/drafters.md), on
    the same tokenizer, prompts and ``ALPHABET`` trick as the shared verifier."""
    from transformers import AutoModelForCausalLM

    from tests.support.mtp import build_tiny_mtp_verifier

    directory = build_tiny_mtp_verifier(
        conformance_root / "verifier-qwen3-next",
        tokenizer=smollm2_tokenizer,
        vocab_size=len(smollm2_tokenizer),
        hidden_size=128,
        init_std=INIT_STD,
        head_rows=ALPHABET,
    )
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompts = quickfit.fit_prompts(smollm2_tokenizer)
    with single_thread(), torch.no_grad():
        plain = plain_generate(model, prompts, max_new_tokens=NEW_TOKENS).tokens
    assert max(max(tokens) for tokens in plain) < ALPHABET
    mask_id, reason = resolve_mask_token(smollm2_tokenizer, model.config.vocab_size)
    return Verifier(directory, model, prompts, plain, mask_id, reason)


def unit_verifier(request, unit) -> Verifier:
    """The suite verifier a unit runs on (``Unit.verifier``)."""
    return request.getfixturevalue({"llama": "verifier", "qwen3_next": "mtp_verifier"}[unit.verifier])


def mtp_states(verifier: Verifier) -> tuple[torch.Tensor, torch.Tensor]:
    """The first prompt and its greedy continuation ``[1, T]`` and the verifier's last hidden state over it,
    before its final norm ``[1, T, H]`` (what our MTP draft reads; it applies the norm itself)."""
    from speculators.verifier import capture_aux_states

    sequence = torch.tensor([verifier.prompts[0] + verifier.plain[0]])
    layers = verifier.model.config.num_hidden_layers
    with torch.no_grad(), capture_aux_states(verifier.model, [layers]) as box:
        verifier.model(sequence)
    return sequence, box["states"].last_prenorm


def decode(verifier: Verifier, directory: Path) -> Export:
    """Our engine's greedy decoding of the prompts with the draft read back from ``directory`` (k = K)."""
    draft = algorithms.load_draft(directory, dtype=torch.float32).eval()
    settings = DecodingConfig(method="chain", num_speculative_tokens=K, max_new_tokens=NEW_TOKENS)
    with torch.no_grad():
        result = SpeculativeDecoder(verifier.model, draft, settings).generate(verifier.prompts)
    return Export(directory, result.stats.summary(), result.tokens, verifier=verifier)


@pytest.fixture(scope="session")
def exports(request, conformance_root) -> dict[str, Export]:
    """``type`` -> the unit's fitted draft, exported (fp32) and decoded by our engine from the export, on the unit's
    verifier; ``type/control`` -> the same for each control copy; ``type@layout`` -> the draft written in another
    producer's layout and converted back by ``speculators convert``."""
    out = {}
    with single_thread():  # 2 shared cores: every extra OpenMP thread waits out a scheduler slice per op
        for name, unit in UNITS.items():
            verifier = unit_verifier(request, unit)
            draft = unit.fit(verifier)
            directory = draft.save_pretrained(conformance_root / name, dtype=torch.float32)
            out[name] = decode(verifier, directory)
            out[name].draft = draft
        for control in control_names():
            name, what = control.split("/")
            target = conformance_root / f"{name}-{what}"
            out[control] = decode(out[name].verifier, write_control(out[name].directory, target, what))
        for source in source_names():
            name, layout = source.split("@")
            target = conformance_root / f"{name}@{layout}"
            verifier = out[name].verifier
            out[source] = decode(verifier, write_source(out[name].draft, layout, target, verifier.directory))
    return out


@pytest.fixture(scope="session")
def zero_verifier(verifier, conformance_root) -> Path:
    """The suite's verifier with its final norm zeroed: every logit is 0, greedy decoding always emits token 0."""
    from tests.support.smollm2_drafts import zero_logit_copy

    return zero_logit_copy(verifier.directory, conformance_root / "verifier-zero-logits")


def write_deterministic(export: Path, target: Path, zero_verifier: Path, shifted: bool) -> Path:
    """A copy of ``export`` for ``zero_verifier`` whose draft logits are all 0 (its final ``norm.weight`` zeroed),
    so it always proposes draft id 0, mapped to token 0 (the zero verifier's only output: every proposal accepted)
    or, ``shifted``, with the whole vocabulary moved up one id, to token 1 (none accepted). docs/format.md, "Serving
    and deterministic end-to-end checks"."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(export, target)
    tensors = load_file(str(target / "model.safetensors"))
    tensors["norm.weight"] = torch.zeros_like(tensors["norm.weight"])
    targets = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
    targets[0] = 0  # draft id 0 means token 0 (ids stay increasing: targets[1] > the old targets[0] >= 0)
    targets = targets + int(shifted)
    assert int(targets.max()) < len(tensors["t2d"])
    tensors["d2t"] = targets - torch.arange(len(targets))
    tensors["t2d"] = torch.zeros_like(tensors["t2d"]).index_fill_(0, targets, True)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = str(zero_verifier)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def deterministic_requests(
    exports: dict[str, Export], zero_verifier: Path, root: Path
) -> list[bridge.VllmRequest]:
    """Per served unit, on the zero-logit verifier (one prompt, bf16: vLLM's serving dtype; zero logits are exact in
    any): the agreeing draft served as the model (``type:accept``), the shifted one through ``speculative_config``
    (``type:reject``), the agreeing one with aux ids one off (``type:accept/aux-ids-one-off``) and, for a type vLLM
    drafts in parallel, the agreeing one drafted sequentially (``type:accept-sequential``), with each drafter forward
    of the parallel and sequential runs counted (one prompt: a proposal is one drafter call)."""
    zero = dict(
        prompts=exports[DETERMINISTIC[0]].verifier.prompts[:1],
        max_tokens=ZERO_TOKENS,
        ignore_eos=True,
        dtype="bfloat16",
        max_model_len=256,
        kv_cache_gib=TINY_KV_CACHE_GIB,
    )
    requests = []
    for name in DETERMINISTIC:
        accept = write_deterministic(exports[name].directory, root / f"{name}-accept", zero_verifier, False)
        reject = write_deterministic(exports[name].directory, root / f"{name}-reject", zero_verifier, True)
        off = write_control(accept, root / f"{name}-accept-aux-off", "aux-ids-one-off")
        spec = bridge.draft_speculative_config(accept)
        counted = dict(zero, count_draft_forwards=bool(spec.get("parallel_drafting")))
        requests.append(bridge.VllmRequest(name=f"{name}:accept", model=accept, **counted))
        for suffix, draft in (("reject", reject), ("accept/aux-ids-one-off", off)):
            config = bridge.draft_speculative_config(draft)
            requests.append(
                bridge.VllmRequest(
                    name=f"{name}:{suffix}", model=zero_verifier, speculative_config=config, **zero
                )
            )
        if spec.get("parallel_drafting"):
            sequential = {**spec, "parallel_drafting": False}
            requests.append(
                bridge.VllmRequest(
                    name=f"{name}:accept-sequential",
                    model=zero_verifier,
                    speculative_config=sequential,
                    **counted,
                )
            )
    return requests


PROBED = [name for name, unit in UNITS.items() if unit.vllm_block_probes]


@pytest.fixture(scope="session")
def block_probes_dirs(smollm2_dir, smollm2_tokenizer, conformance_root) -> dict[str, Path]:
    """``type~probe`` -> the directory of each probe draft (tests/support/block_probes.py) of every unit that
    declares ``vllm_block_probes``, on a counts-based draft vocabulary of the chat prompts (token 0 kept)."""
    from tests.support.block_probes import build_probes
    from tests.support.smollm2_drafts import draft_vocab_from_text

    texts = [message["content"] for chat in CHAT_PROMPTS for message in chat]
    texts.append(smollm2_tokenizer.apply_chat_template(CHAT_PROMPTS[0], tokenize=False))
    vocab = draft_vocab_from_text(smollm2_tokenizer, texts)
    out = {}
    for name in PROBED:
        for probe, directory in build_probes(smollm2_dir, vocab, conformance_root / f"{name}-probes").items():
            out[f"{name}~{probe}"] = directory
    return out


@pytest.fixture(scope="session")
def probe_sequence(smollm2_dir, smollm2_tokenizer) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The first chat prompt and SmolLM2's HF greedy continuation ``[1, T]`` and every hidden state over it: the
    inputs on which speculators 0.9.0 computes the probes' block logits."""
    from transformers import AutoModelForCausalLM

    from tests.support.block_probes import RECORDED_TOKENS, smollm2_states

    chat = smollm2_tokenizer.apply_chat_template(
        CHAT_PROMPTS[0], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    prompt = list(chat["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        continuation = plain_generate(model, [prompt], max_new_tokens=RECORDED_TOKENS).tokens[0]
    sequence = torch.tensor([prompt + continuation])
    return sequence, smollm2_states(smollm2_dir, sequence)


def probe_requests(smollm2_dir: Path, block_probes: dict[str, Path]) -> list[bridge.VllmRequest]:
    """SmolLM2's plain decoding of one chat prompt (``smollm2:recorded``) and each probe through
    ``speculative_config`` with every proposal of vLLM's drafter recorded (fp32, EOS ignored)."""
    from tests.support.block_probes import RECORDED_TOKENS

    recorded = dict(
        prompts=CHAT_PROMPTS[:1],
        max_tokens=RECORDED_TOKENS,
        ignore_eos=True,
        dtype="float32",
        max_model_len=512,
    )
    requests = (
        [bridge.VllmRequest(name="smollm2:recorded", model=smollm2_dir, **recorded)] if block_probes else []
    )
    for name, directory in block_probes.items():
        spec = bridge.draft_speculative_config(directory)
        requests.append(
            bridge.VllmRequest(
                name=name, model=smollm2_dir, speculative_config=spec, record_drafts=True, **recorded
            )
        )
    return requests


@pytest.fixture(scope="session")
def vllm_served(
    exports, verifier, zero_verifier, smollm2_dir, block_probes_dirs, conformance_root
) -> dict[str, bridge.VllmResult | str]:
    """Every unit's export, control and converted source, and plain decoding, in ONE vLLM worker (a session: one
    vLLM import, an engine per configuration; fp32, greedy, EOS ignored), each through ``speculative_config``; each
    unit's export also served as the model (``LLM(model=<draft dir>)``, name ``type:as-model``), where vLLM's
    speculators adapter finds the verifier and the method in the config; each served unit's deterministic drafts
    (``deterministic_requests``). Besides: plain decoding again with another seed (``plain:again``: the session
    reuses the engine), a request for a model that does not exist (``broken``), plain decoding after it
    (``plain:after-broken``: a fresh engine), the real SmolLM2 on chat prompts (``chat``) and the block probes
    (``probe_requests``). name -> its result, or vLLM's error
    text where it refused the request (the session survives a refused request)."""
    require_consumer(bridge.vllm_available(), "the vLLM virtualenv", "vllm-env")
    # kv_cache_gib: the tiny verifiers' 16k-token cache in 64 MiB (the default 1 GiB costs each engine ~1 s more)
    common = dict(
        prompts=verifier.prompts,
        max_tokens=NEW_TOKENS,
        ignore_eos=True,
        dtype="float32",
        max_model_len=256,
        kv_cache_gib=TINY_KV_CACHE_GIB,
    )
    chat = dict(prompts=CHAT_PROMPTS, max_tokens=24, dtype="float32", max_model_len=512)
    requests = [
        bridge.VllmRequest(name="plain", model=verifier.directory, **common),
        bridge.VllmRequest(name="plain:again", model=verifier.directory, **{**common, "seed": 2}),
        bridge.VllmRequest(name="broken", model=conformance_root / "no-model", prompts=["hi"]),
        bridge.VllmRequest(name="plain:after-broken", model=verifier.directory, **common),
        bridge.VllmRequest(name="chat", model=smollm2_dir, **chat),
    ]
    for name in [*UNITS, *control_names(), *source_names()]:
        if unit_of(name).vllm_cpu_refusal and name not in UNITS:
            continue  # a refused type's controls would only repeat its refusal
        spec = bridge.draft_speculative_config(exports[name].directory)
        served_by = exports[name].verifier.directory  # the unit's verifier (MTP's ships its MTP layer)
        requests.append(bridge.VllmRequest(name=name, model=served_by, speculative_config=spec, **common))
    for name, unit in UNITS.items():
        if not unit.vllm_cpu_refusal:
            requests.append(
                bridge.VllmRequest(name=f"{name}:as-model", model=exports[name].directory, **common)
            )
    for name in FEWER_TOKENS:  # vLLM's num_speculative_tokens below the draft's own: name ``type:k<K - 1>``
        spec = bridge.draft_speculative_config(exports[name].directory, K - 1)
        served_by = exports[name].verifier.directory
        requests.append(
            bridge.VllmRequest(name=f"{name}:k{K - 1}", model=served_by, speculative_config=spec, **common)
        )
    requests += deterministic_requests(exports, zero_verifier, conformance_root / "deterministic")
    requests += probe_requests(smollm2_dir, block_probes_dirs)
    out: dict[str, bridge.VllmResult | str] = {}
    with bridge.VllmSession(timeout=900, log_path=conformance_root / "vllm-worker.log") as session:
        for request in requests:
            try:
                out[request.name] = session.run(request)
            except bridge.VllmError as error:
                if request.name == "plain":
                    raise
                out[request.name] = str(error)
    return out


@pytest.fixture(scope="session")
def aux_sequence(verifier) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The first prompt and its greedy continuation ``[1, T]``, and the verifier's hidden states by layer index
    (``hidden_states[k]``: the stream entering layer k, the aux-id convention of our configs and of vLLM)."""
    sequence = torch.tensor([verifier.prompts[0] + verifier.plain[0]])
    with torch.no_grad():
        states = verifier.model(sequence, output_hidden_states=True).hidden_states
    return sequence, dict(enumerate(states))


PACKAGE_PROBES = ("bidirectional", "causal")


def probe_anchors(sequence: torch.Tensor) -> list[int]:
    """Block anchors of the probes' package forward, the last a block before the end of ``sequence``."""
    from tests.support.block_probes import BLOCK

    return [3, 11, 19, sequence.shape[1] - BLOCK - 1]


def probe_block_inputs(probe_sequence) -> dict[str, torch.Tensor]:
    """The package's block-forward inputs for a probe: SmolLM2's aux states, the tokens and the anchors."""
    from tests.support.block_probes import AUX_IDS

    sequence, states = probe_sequence
    aux = torch.cat([states[k] for k in AUX_IDS], dim=-1)
    return {
        "hidden_states": aux.float().contiguous(),
        "input_ids": sequence.contiguous(),
        "anchors": torch.tensor(probe_anchors(sequence)),
    }


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
def package_results(
    exports, verifier, aux_sequence, block_probes_dirs, probe_sequence, conformance_root
) -> dict[str, dict[str, Any]]:
    """Every unit's export loaded by speculators 0.9.0 in ONE interpreter of its virtualenv (package_batch.py),
    with that package's own forward where the unit names one; and the bidirectional and causal block probes with
    the package's block forward on SmolLM2's states (``probe_sequence``). name -> {"description", "logits" (or
    absent), and for a probe the "lm_head" and "embed_tokens" the package holds}."""
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
        if unit.package_forward == "mtp":  # the verifier's last state after its final norm, as 0.9.0 reads it
            own, prenorm = mtp_states(exports[name].verifier)
            hidden = exports[name].draft.project_features(prenorm)
            inputs = {"hidden_states": hidden.detach().float(), "input_ids": own}
            save_file(
                {k: v.contiguous() for k, v in inputs.items()}, str(work / f"{name}-inputs.safetensors")
            )
            outputs[name] = work / f"{name}-logits.safetensors"
            job["mtp_forward"] = {
                "inputs": str(work / f"{name}-inputs.safetensors"),
                "output": str(outputs[name]),
            }
        elif unit.package_forward:
            aux = torch.cat(
                [
                    states[i]
                    for i in algorithms.get(unit.model_type).aux_layer_ids(exports[name].draft.config)
                ],
                dim=-1,
            )
            inputs = {"hidden_states": aux.float(), "input_ids": sequence}
            if unit.package_forward == "block":
                inputs["anchors"] = torch.tensor(package_anchors(verifier))
            elif unit.package_forward == "ttt":  # the package feeds step 0 the token after each position's
                inputs["input_ids"] = shift_left(sequence, 1)
            else:
                inputs["anchors"], inputs["depths"] = peagle_elements(sequence.shape[1])
            save_file(
                {k: v.contiguous() for k, v in inputs.items()}, str(work / f"{name}-inputs.safetensors")
            )
            outputs[name] = work / f"{name}-logits.safetensors"
            job[f"{unit.package_forward}_forward"] = {
                "inputs": str(work / f"{name}-inputs.safetensors"),
                "output": str(outputs[name]),
                "steps": K,
            }
        jobs.append(job)
    names = list(UNITS)
    for name in [n for n in block_probes_dirs if n.split("~")[1] in PACKAGE_PROBES]:
        probe_inputs = probe_block_inputs(probe_sequence)
        save_file(probe_inputs, str(work / f"{name}-inputs.safetensors"))
        outputs[name] = work / f"{name}-logits.safetensors"
        forward = {"inputs": str(work / f"{name}-inputs.safetensors"), "output": str(outputs[name])}
        jobs.append({"model": str(block_probes_dirs[name].resolve()), "block_forward": forward})
        names.append(name)
    script = Path(__file__).with_name("package_batch.py")
    python = speculators_package_python()
    result = run_json_worker(python, script, {"jobs": jobs}, 900, "the speculators package", work / "log.txt")
    out = {}
    for name, description in zip(names, result["jobs"], strict=True):
        out[name] = {"description": description}
        if name in outputs and description.get("ok"):
            out[name].update(
                load_file(str(outputs[name]))
            )  # logits (and a DFlash2's candidate ids and scores)
    return out
