"""Loading our checkpoints with the upstream ``speculators`` package (the second consumer), from our environment.

``speculators==0.9.0`` lives in ``.venv-speculators`` (``make speculators-env``) because its torch/transformers
pins differ from ours, and because its import name collides with our package. The standalone
``speculators_package_worker.py`` loads a checkpoint there with ``SpeculatorModel.from_pretrained`` (offline) and
reports what it loaded; :func:`tensor_digest` computes the same digest here so weights can be compared exactly.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from speculators.serving.worker_process import (
    ConsumerUnavailable,
    consumer_python,
    python_has_module,
    run_json_worker,
)

SPECULATORS_PKG_PYTHON_ENV = "SPECULATORS_PKG_PYTHON"
SPECULATORS_PKG_VENV = ".venv-speculators"
WORKER_SCRIPT = Path(__file__).with_name("speculators_package_worker.py")


def speculators_package_python() -> Path:
    """The interpreter of the virtualenv holding ``speculators==0.9.0`` (``$SPECULATORS_PKG_PYTHON`` overrides)."""
    return consumer_python(SPECULATORS_PKG_PYTHON_ENV, SPECULATORS_PKG_VENV, "speculators-env")


def speculators_package_available() -> bool:
    """Whether that virtualenv exists and has the package (not imported: cheap)."""
    try:
        python = speculators_package_python()
    except ConsumerUnavailable:
        return False
    return python_has_module(str(python), "speculators")


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor as float32 (floating) or int64 (integer/bool) bytes: equal iff the values are equal,
    whatever dtype each side stores (bf16 → fp32 is exact). The worker computes the same."""
    wide = torch.float32 if tensor.is_floating_point() else torch.int64
    return hashlib.sha256(tensor.detach().to("cpu", wide).contiguous().numpy().tobytes()).hexdigest()


def load_with_speculators_package(draft_dir: str | Path, timeout: float = 600.0) -> dict[str, Any]:
    """Load ``draft_dir`` with ``speculators.SpeculatorModel.from_pretrained`` in the package's virtualenv.

    Returns ``{"ok", "speculators_version", "load_seconds", "class", "config_class", "layer_model_type",
    "draft_vocab_size", "vocab_size", "norm_before_residual", "aux_layer_ids", "speculative_tokens", "verifier",
    "tensors": {name: {"shape", "dtype", "sha256", "has_nan"}}}``. Raises :class:`ConsumerUnavailable` naming
    ``make speculators-env`` when the virtualenv is missing and ``WorkerError`` with the package's traceback when
    it refuses the checkpoint.
    """
    python = speculators_package_python()
    request = {"model": str(Path(draft_dir).resolve())}
    return run_json_worker(python, WORKER_SCRIPT, request, timeout, "the speculators package")


def block_logits_with_speculators_package(
    draft_dir: str | Path,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: list[int],
    workdir: str | Path,
    timeout: float = 600.0,
    build: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Load a block drafter (DFlash family) with the ``speculators`` package and run ITS forward on one sequence:
    ``hidden_states [1, T, n_aux * H]`` (the verifier's aux states), ``input_ids [1, T]``, one block anchored at
    each of ``anchors`` (each below ``T - block_size``: the package never anchors in the last block).

    Returns ``(description as load_with_speculators_package gives it, tensors)`` with ``tensors["logits"]
    [len(anchors), block_size, draft V]`` in float32 and the ``lm_head`` / ``embed_tokens`` the package ended up
    with (it fills both from the verifier on load). Why: equal logits on equal inputs is what proves both
    libraries read the checkpoint, the aux-id convention and the block's causality alike. ``build``: first build
    ``draft_dir`` with the package's own constructor (:func:`build_with_speculators_package`), in the same call."""
    from safetensors.torch import load_file, save_file

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    inputs, output = workdir / "block-inputs.safetensors", workdir / "block-logits.safetensors"
    save_file(
        {
            "hidden_states": hidden_states.detach().float().cpu().contiguous(),
            "input_ids": input_ids.detach().long().cpu().contiguous(),
            "anchors": torch.tensor(anchors, dtype=torch.long),
        },
        str(inputs),
    )
    request = {
        "model": str(Path(draft_dir).resolve()),
        "block_forward": {"inputs": str(inputs.resolve()), "output": str(output.resolve())},
        **({"build": build_request(build)} if build else {}),
    }
    python = speculators_package_python()
    description = run_json_worker(python, WORKER_SCRIPT, request, timeout, "the speculators package")
    return description, load_file(str(output))


def convert_dflash_with_speculators_package(
    source: str | Path, out_dir: str | Path, verifier: str | Path, timeout: float = 600.0
) -> dict[str, Any]:
    """Convert an external (z-lab) DFlash draft with the ``speculators`` package's own converter into ``out_dir``
    and load the result there; returns what :func:`load_with_speculators_package` returns. Why: its output is the
    speculators 0.9.0 layout as that package really writes it, which ``speculators convert`` must read."""
    request = {
        "model": str(Path(out_dir).resolve()),
        "convert_dflash": {"input": str(Path(source).resolve()), "verifier": str(Path(verifier).resolve())},
    }
    return run_json_worker(
        speculators_package_python(), WORKER_SCRIPT, request, timeout, "the speculators package"
    )


def build_request(spec: dict[str, Any]) -> dict[str, Any]:
    """The worker's ``build`` spec with the class the package builds the type with, as the type's unit declares it
    (``Algorithm.package_class``): the worker runs under the package's interpreter, where our registry is not."""
    from speculators import algorithms

    unit = algorithms.get(str(spec["type"]))
    if not unit.package_class:
        raise ValueError(
            f"the {unit.name} unit declares no package_class: the speculators package cannot build it"
        )
    return {**spec, "package_class": unit.package_class}


def build_with_speculators_package(
    spec: dict[str, Any], out_dir: str | Path, timeout: float = 600.0
) -> dict[str, Any]:
    """Build and save a draft into ``out_dir`` with the ``speculators`` package's own training-time constructor
    (``spec`` as the worker's ``build_peer_draft`` reads it: ``type`` peagle or dspark, ``verifier``, ...), then
    load it there; returns what :func:`load_with_speculators_package` returns. Why: a checkpoint that package
    really writes, in its layout and naming, is what ``speculators convert`` must read."""
    request = {"model": str(Path(out_dir).resolve()), "build": build_request(spec)}
    return run_json_worker(
        speculators_package_python(), WORKER_SCRIPT, request, timeout, "the speculators package"
    )


def peagle_logits_with_speculators_package(
    draft_dir: str | Path,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    depths: torch.Tensor,
    workdir: str | Path,
    timeout: float = 600.0,
    build: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Load a P-EAGLE draft with the ``speculators`` package and run ITS training forward over the given (anchor,
    depth) elements of one sequence (``hidden_states [1, T, n_aux * H]``, ``input_ids [1, T]``; depth 0 at every
    position): returns the description and the logits ``[E, draft V]`` (float32). Equal logits on equal inputs is
    what proves both libraries read the checkpoint, ``mask_hidden``, the mask token and the positions alike.
    ``build``: first build ``draft_dir`` with the package's own constructor, in the same call (one start of its
    interpreter, ~30 s, instead of two)."""
    from safetensors.torch import load_file, save_file

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    inputs, output = workdir / "peagle-inputs.safetensors", workdir / "peagle-logits.safetensors"
    save_file(
        {
            "hidden_states": hidden_states.detach().float().cpu().contiguous(),
            "input_ids": input_ids.detach().long().cpu().contiguous(),
            "anchors": anchors.detach().long().cpu().contiguous(),
            "depths": depths.detach().long().cpu().contiguous(),
        },
        str(inputs),
    )
    request = {
        "model": str(Path(draft_dir).resolve()),
        "peagle_forward": {"inputs": str(inputs.resolve()), "output": str(output.resolve())},
        **({"build": build_request(build)} if build else {}),
    }
    description = run_json_worker(
        speculators_package_python(), WORKER_SCRIPT, request, timeout, "the speculators package"
    )
    return description, load_file(str(output))["logits"]
