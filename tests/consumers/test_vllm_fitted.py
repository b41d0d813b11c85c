"""vLLM's acceptance of a draft depends on every one of its weights, and equals what our engine measures.

The 100 % / 0 % tests (test_vllm.py) zero the draft's final norm, so they prove the config and d2t only. Here drafts
are quickly fitted to their verifier (acceptance about 3 of 4 at k = 3, reached only through fc, attention, MLP,
norms, lm_head, the aux layer ids and ``norm_before_residual``), and vLLM must report, on the same token prompts in
fp32, exactly the acceptance our engine measures: a Llama-style and a Qwen3-style draft as our library writes them,
and a checkpoint made by ``speculators convert`` from each source layout (original EAGLE-3, SpecForge with its
output-of-layer aux ids, an older speculators export). Negative controls, in the same vLLM worker run: aux ids one
off (the SpecForge ids taken in vLLM's convention), one transposed tensor in a converted source, and
``norm_before_residual`` flipped. Each must move vLLM's number away from ours.

The verifiers are random 8-layer models initialised with std 0.3 rather than the shared fixtures' 0.02: those
greedily repeat a short loop that a draft predicts from the token alone, whatever its aux features say.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from speculators.decoding.engine import DecodingConfig, SpeculativeDecoder
from speculators.export import convert_checkpoint
from speculators.format.config import Eagle3Config, default_aux_layer_ids, window_layout
from speculators.models import Eagle3DraftModel
from speculators.serving import vllm_bridge as bridge
from tests.conftest import require_consumer
from tests.export.conftest import write_eagle3_original, write_specforge
from tests.export.test_convert import make_old_speculators
from tests.support import quickfit  # the quick-fit mini trainer
from tests.support.verifiers import build_tiny_verifier
from train.targets import TargetHead

pytestmark = [
    pytest.mark.consumer,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::speculators.export.ExportWarning"),
]

K = 3
NEW_TOKENS = 32
DRAFT_VOCAB = 512
INIT_STD = 0.3
# the negative controls and how far (at least) each must move vLLM's acceptance length from ours
CONTROLS = ("aux-ids-one-off", "transposed-o_proj", "norm_before_residual-flipped")
MIN_SHIFT = 0.3


@dataclass
class Fitted:
    verifier_dir: Path
    prompts: list[list[int]]
    draft: Eagle3DraftModel
    ours: dict[str, Any]  # our engine's DecodingStats summary
    tokens: list[list[int]]


def chat_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for text in quickfit.FIT_TEXTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return prompts


def fit(
    verifier_dir: Path,
    prompts: list[list[int]],
    norm_before_residual: bool,
    steps: int,
    sliding_window: int | None = None,
) -> Fitted:
    """A draft fitted on the verifier's greedy continuations of ``prompts``, and what our engine measures of it;
    with ``sliding_window``, its layer attends over that many positions, in training and decoding alike."""
    from transformers import AutoModelForCausalLM

    verifier = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    aux_ids = default_aux_layer_ids(verifier.config.num_hidden_layers)
    data = quickfit.collect(verifier, prompts, aux_ids, NEW_TOKENS)
    vocab_size = verifier.config.vocab_size
    vocab = quickfit.draft_vocabulary(data, vocab_size, min(DRAFT_VOCAB, vocab_size))
    draft = quickfit.init_draft(verifier, str(verifier_dir), vocab, aux_ids)
    if (
        draft.config.norm_before_residual != norm_before_residual or sliding_window
    ):  # same start, other layout
        config = Eagle3Config.from_dict(
            {**draft.config.to_dict(), "norm_before_residual": norm_before_residual}
        )
        if sliding_window:
            config.transformer_layer_config.update(window_layout(sliding_window, config.num_layers))
        rebuilt = Eagle3DraftModel(config)
        rebuilt.load_state_dict(draft.state_dict())
        draft = rebuilt
    quickfit.fit_steps(draft, TargetHead.from_model(verifier, vocab.target_ids), data, steps)
    decoder = SpeculativeDecoder(
        verifier, draft, DecodingConfig(method="chain", num_speculative_tokens=K, max_new_tokens=NEW_TOKENS)
    )
    with torch.no_grad():
        result = decoder.generate(prompts)
    return Fitted(verifier_dir, prompts, draft, result.stats.summary(), result.tokens)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fitted")


@pytest.fixture(scope="module")
def fitted(root, smollm2_tokenizer) -> dict[str, Fitted]:
    """A Llama-style draft trained as EAGLE-3 and SpecForge train theirs (norm_before_residual false) and a
    Qwen3-style one (true)."""
    out = {}
    # steps for an acceptance length near 3.5 of 4 (a few seconds): short of 4, so a wrong weight can move it
    # either way; the un-normed residual of norm_before_residual=false takes longer to fit
    for arch, norm_before_residual, steps in (("llama", False, 60), ("qwen3", True, 30)):
        verifier_dir = build_tiny_verifier(
            root / f"{arch}-verifier",
            arch=arch,
            tokenizer=smollm2_tokenizer,
            vocab_size=len(smollm2_tokenizer),
            initializer_range=INIT_STD,
        )
        out[arch] = fit(verifier_dir, chat_prompts(smollm2_tokenizer), norm_before_residual, steps)
        assert 2.5 <= out[arch].ours["acceptance_length_global"] <= 3.9, out[arch].ours
    return out


def transposed(model: Eagle3DraftModel, name: str) -> Eagle3DraftModel:
    broken = copy.deepcopy(model)
    with torch.no_grad():
        weight = broken.get_parameter(name)
        weight.copy_(weight.T.clone())
    return broken


@pytest.fixture(scope="module")
def checkpoints(root, fitted) -> dict[str, tuple[str, Path]]:
    """name -> (which fitted draft it holds, the directory vLLM serves): written by our library, converted from
    each source layout, and the negative controls."""
    llama, qwen3 = fitted["llama"], fitted["qwen3"]
    verifier = str(llama.verifier_dir)

    def convert(source: Path, name: str, **options: Any) -> Path:
        out = root / name
        convert_checkpoint(
            source, out, verifier=options.pop("verifier", verifier), dtype="float32", **options
        )
        return out

    specforge = write_specforge(root / "specforge-src", llama.draft, aux_ids=[1, 3, 4])  # output-of-layer ids
    original = write_eagle3_original(root / "original-src", llama.draft)
    old = make_old_speculators(root / "old-speculators-src", qwen3.draft)
    found = {
        "llama": ("llama", llama.draft.save_pretrained(root / "llama", dtype=torch.float32)),
        "qwen3": ("qwen3", qwen3.draft.save_pretrained(root / "qwen3", dtype=torch.float32)),
        "converted-eagle3-original": ("llama", convert(original, "original")),
        "converted-specforge": ("llama", convert(specforge, "specforge")),
        "converted-old-speculators": (
            "qwen3",
            convert(old, "old-speculators", verifier=str(qwen3.verifier_dir), norm_before_residual=True),
        ),
        "aux-ids-one-off": ("llama", convert(specforge, "ids-one-off", aux_convention="vllm")),
        "transposed-o_proj": (
            "llama",
            convert(
                write_eagle3_original(
                    root / "transposed-src", transposed(llama.draft, "layers.0.self_attn.o_proj.weight")
                ),
                "transposed",
            ),
        ),
        "norm_before_residual-flipped": ("llama", convert(original, "flipped", norm_before_residual=True)),
    }
    config = json.loads((found["converted-specforge"][1] / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # SpecForge's [1, 3, 4] shifted by one
    config = json.loads((found["aux-ids-one-off"][1] / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    return found


@pytest.fixture(scope="module")
def vllm_env() -> None:
    """The one rule for a missing consumer (skip locally, fail under CI=true), checked before any draft is fitted."""
    require_consumer(bridge.vllm_available(), "the vLLM virtualenv", "vllm-env")


@pytest.fixture(scope="module")
def served(vllm_env, checkpoints, fitted, root) -> dict[str, Any]:
    """Every checkpoint in ONE vLLM worker run (one vLLM import; engines one after another), fp32, greedy."""
    requests = []
    for name, (which, directory) in checkpoints.items():
        source = fitted[which]
        requests.append(
            bridge.VllmRequest(
                name=name,
                model=source.verifier_dir,
                prompts=source.prompts,
                speculative_config=bridge.eagle3_speculative_config(directory, K),
                max_tokens=NEW_TOKENS,
                ignore_eos=True,
                dtype="float32",
                max_model_len=256,
            )
        )
    results = bridge.run_vllm(requests, timeout=900, log_path=root / "vllm-worker.log")
    return {result.name: result for result in results}


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "qwen3",
        "converted-eagle3-original",
        "converted-specforge",
        "converted-old-speculators",
    ],
)
def test_vllm_measures_the_acceptance_our_engine_measures(served, checkpoints, fitted, name):
    ours, result = fitted[checkpoints[name][0]], served[name]
    assert result.token_ids == ours.tokens  # fp32 greedy: the same outputs, drafted or not
    spec = result.spec
    assert spec is not None and spec.num_speculative_tokens == K and spec.num_drafts > 0
    assert spec.mean_acceptance_length == pytest.approx(ours.ours["acceptance_length_global"], abs=1e-9)
    assert spec.per_position_acceptance_rate == pytest.approx(
        ours.ours["per_position_acceptance_unconditional"], abs=1e-9
    )


@pytest.mark.parametrize("name", CONTROLS)
def test_a_misread_weight_or_id_changes_vllms_acceptance(served, checkpoints, fitted, name):
    ours, spec = fitted[checkpoints[name][0]].ours, served[name].spec
    assert spec is not None and spec.num_drafts > 0
    shift = ours["acceptance_length_global"] - spec.mean_acceptance_length
    assert shift >= MIN_SHIFT, (name, ours["acceptance_length_global"], spec.mean_acceptance_length)
