"""Standalone worker: load a checkpoint with the ``speculators`` package (0.9.0) in ITS virtualenv and describe it.

Usage: ``python speculators_package_worker.py REQUEST.json RESULT.json`` with request ``{"model": <draft dir>}``
(optionally ``"block_forward": {"inputs", "output"}``: a block drafter's logits, see ``block_forward``; and
``"convert_dflash": {"input", "verifier"}``: first convert an external (z-lab) DFlash draft into ``model`` with the
package's own converter; ``"build": {...}``: first build and save a draft with the package's own constructor, see
``build_peer_draft``; ``"peagle_forward": {"inputs", "output"}``: a P-EAGLE draft's logits, see ``peagle_forward``;
``"ttt_forward": {"inputs", "output"}``: an EAGLE-3 draft's training-time-test logits, see ``ttt_forward``;
``"mtp_forward": {"inputs", "output"}``: an MTP draft's per-step logits, see ``mtp_forward``; ``"convert_mtp":
{"verifier"}``: first extract a verifier's own MTP layer into ``model`` with the package's MTP converter).
It must not import our package (both are named ``speculators``; here the name means the upstream library). The
result names the class the package chose, the resolved config values it acts on, and every tensor of the loaded
model with its shape, dtype and a digest, so the caller can compare them with what it wrote.

Digest convention (shared with ``speculators/serving/speculators_package.py``): sha256 of the tensor's bytes after
conversion to float32 (floating tensors) or int64 (integer and bool tensors), C-contiguous, on CPU.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def digest(tensor: Any) -> str:
    import torch

    wide = torch.float32 if tensor.is_floating_point() else torch.int64
    return hashlib.sha256(tensor.detach().to("cpu", wide).contiguous().numpy().tobytes()).hexdigest()


def describe(model: Any) -> dict[str, Any]:
    tensors = {}
    for name, tensor in model.state_dict().items():
        tensors[name] = {
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "sha256": digest(tensor),
            "has_nan": bool(tensor.is_floating_point() and tensor.isnan().any()),
        }
    config = model.config
    layer = config.transformer_layer_config
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config_class": type(config).__name__,
        "layer_model_type": getattr(layer, "model_type", None),
        "draft_vocab_size": getattr(config, "draft_vocab_size", None),
        "vocab_size": getattr(layer, "vocab_size", None),
        "norm_before_residual": getattr(config, "norm_before_residual", None),
        "aux_layer_ids": list(
            getattr(config, "eagle_aux_hidden_state_layer_ids", None)
            or getattr(config, "aux_hidden_state_layer_ids", None)
            or (
                getattr(model, "target_layer_ids", None)
                if hasattr(config, "num_nextn_predict_layers")
                else None
            )
            or []
        ),
        "block_keys": {
            key: getattr(config, key)
            for key in ("block_size", "mask_token_id", "sliding_window_non_causal", "sample_from_anchor")
            if hasattr(config, key)
        },
        "speculative_tokens": [m.speculative_tokens for m in config.speculators_config.proposal_methods],
        "verifier": config.speculators_config.verifier.name_or_path,
        "tensors": tensors,
    }


def block_forward(model: Any, spec: dict[str, str]) -> None:
    """Draft logits of a block drafter (DFlash family) through the package's own training forward
    (``_backbone_forward``), in float32, for blocks anchored at given positions of one sequence.

    Inputs (a safetensors file): ``hidden_states [1, T, n_aux * H]`` (the verifier's aux states), ``input_ids
    [1, T]``, ``anchors [A]``. The package draws its anchors at random among the loss-masked positions and keeps all
    of them when there are at most ``max_anchors``, so a loss mask set exactly at ``anchors`` makes it use those.
    Writes ``logits [A, block_size, draft V]`` and ``lm_head`` / ``embed_tokens`` as the package holds them. A DFlash2
    draft adds ``candidate_ids`` / ``candidate_scores [A, block_size, top_k]``: each slot's unary top-k and the
    package's own selector scores of them (``score_candidates``), the predecessor of each slot being the block's
    data token before it (``_predecessor_ids``), as its training forward scores them. A DSpark
    draft's logits include its Markov bias, computed by the package's own head from the token before each slot's
    target (``sample_from_anchor`` false: the anchor for slots 0 and 1, then the block's data tokens), as its
    training forward adds it."""
    import torch
    from safetensors.torch import load_file, save_file

    inputs = load_file(spec["inputs"])
    hidden, ids, anchors = inputs["hidden_states"], inputs["input_ids"], inputs["anchors"]
    length = ids.shape[1]
    loss_mask = torch.zeros(1, length)
    loss_mask[0, anchors] = 1
    model = model.float().eval()
    width, slots_per_block = model.config.transformer_layer_config.hidden_size, model.block_size
    with torch.no_grad():
        hidden, logits, _, _, block_indices = model._backbone_forward(
            hidden.float(),
            ids,
            loss_mask,
            torch.zeros(1, length, width),
            torch.zeros(1, length, dtype=torch.long),
            max_anchors=int(anchors.numel()),
        )
    logits = logits.reshape(int(anchors.numel()), slots_per_block, -1)
    selector = getattr(model, "candidate_selector", None)
    extra = {}
    if selector is not None:  # DFlash2: its selector's scores on each slot's unary top-k, teacher forced
        with torch.no_grad():
            predecessors = model._predecessor_ids(ids, block_indices).reshape(1, -1)
            candidates = logits.reshape(1, -1, logits.shape[-1]).topk(selector.top_k, dim=-1).indices
            scores = selector.score_candidates(
                logits.reshape(1, -1, logits.shape[-1]), hidden, predecessors, candidates
            )
        shape = (int(anchors.numel()), slots_per_block, selector.top_k)
        extra = {
            "candidate_ids": candidates.reshape(shape),
            "candidate_scores": scores.reshape(shape).float(),
        }
    markov = getattr(model, "markov_head", None)
    if markov is not None:
        slots = torch.arange(slots_per_block)
        prev_positions = (anchors[:, None] + slots[None] - 1).clamp(min=0)
        prev_positions[:, 0] = anchors  # slot 0 proposes nothing; the package gives it the anchor
        prev_positions = torch.maximum(prev_positions, anchors[:, None])
        prev = ids[0, prev_positions]
        with torch.no_grad():
            logits = logits + markov.block_bias(
                prev_token_ids=prev, hidden_states=hidden.view(int(anchors.numel()), slots_per_block, -1)
            )
    save_file(
        {
            "logits": logits.contiguous(),
            "lm_head": model.lm_head.weight.detach().contiguous(),
            "embed_tokens": model.embed_tokens.weight.detach().contiguous(),
            **{name: tensor.contiguous() for name, tensor in extra.items()},
        },
        spec["output"],
    )


def build_peer_draft(spec: dict[str, Any], out_dir: str) -> None:
    """Build a draft with the package's OWN training-time constructor and save it with its own ``save_pretrained``:
    what its trainer writes at step 0 (``create_transformer_layer_config`` + ``<Model>.from_training_args``), with
    every trainable weight random so that no tensor can be confused with another on the way through a converter.

    ``spec``: ``type`` (the package's module under ``speculators.models``), ``package_class`` (its class there: the
    caller reads it from our unit, ``Algorithm.package_class``), ``verifier`` (a local HF dir), ``draft_arch``, ``num_layers``,
    ``target_layer_ids``, ``mask_token_id``, ``draft_vocab_size`` (a spread-out subset of the verifier vocabulary:
    non-trivial d2t offsets), ``seed``, and the type's own keys (``num_depths``; ``block_size``,
    ``sample_from_anchor``, ``markov_rank``, ``confidence_head_with_markov``)."""
    import torch

    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(int(spec.get("seed", 0)))
    layer = create_transformer_layer_config(
        verifier_name_or_path=spec["verifier"],
        num_layers=int(spec.get("num_layers", 1)),
        draft_arch=spec.get("draft_arch", "qwen3"),
        hidden_act=None,
        sliding_window=int(spec.get("sliding_window", 2048)),
        full_attention_indices=list(spec.get("full_attention_indices", [])),
    )
    vocab, draft_vocab = int(layer.vocab_size), int(spec["draft_vocab_size"])
    kept = torch.linspace(0, vocab - 1, draft_vocab).round().long().unique()
    if kept.numel() != draft_vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab} does not spread over {vocab} ids")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    d2t = kept - torch.arange(draft_vocab)
    shaping = (
        "type",
        "package_class",
        "verifier",
        "draft_arch",
        "num_layers",
        "seed",
        "sliding_window",
        "full_attention_indices",
    )
    own = {k: v for k, v in spec.items() if k not in shaping}  # what the package's trainer passes as its args
    model_class = getattr(
        importlib.import_module(f"speculators.models.{spec['type']}"), spec["package_class"]
    )
    model = model_class.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=spec["verifier"], **own
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(("verifier_", "embed_tokens", "lm_head")):
                continue  # the verifier's copies, as the package loads them
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name == "mask_hidden":
                param.normal_()
            else:
                param.normal_(std=0.05)
    model.save_pretrained(out_dir)


def peagle_forward(model: Any, spec: dict[str, str]) -> None:
    """P-EAGLE logits through the package's own training forward for GIVEN (anchor, depth) elements instead of its
    random COD draw: its sampler is swapped for one returning the requested elements and its loss for one that
    keeps the logits. Everything between (mask token and ``mask_hidden`` at depth >= 1, fc, layers, its attention
    mask over chains, positions anchor + depth) is the package's code.

    Inputs (safetensors): ``hidden_states [1, T, n_aux * H]``, ``input_ids [1, T]`` (the token paired with each
    position's states), ``anchors [E]``, ``depths [E]`` (depth 0 must cover every position, as COD does).
    Writes ``logits [E, draft V]`` in float32."""
    import torch
    from safetensors.torch import load_file, save_file

    from speculators.models.peagle import core

    inputs = load_file(spec["inputs"])
    hidden, ids = inputs["hidden_states"].float(), inputs["input_ids"]
    captured: dict[str, Any] = {}

    def given_elements(**_: Any) -> tuple[Any, Any]:
        return inputs["anchors"], inputs["depths"]

    def keep_logits(logits: Any, **_: Any) -> tuple[Any, dict]:
        captured["logits"] = logits
        return logits.sum() * 0, {}

    core.generate_cod_sample_indices, core.compute_metrics = given_elements, keep_logits
    length = ids.shape[1]
    model = model.float().eval()
    width = model.config.transformer_layer_config.hidden_size
    with torch.no_grad():
        model(
            hidden_states=hidden,
            input_ids=ids,
            document_ids=torch.zeros(1, length, dtype=torch.long),
            loss_mask=torch.ones(1, length),
            verifier_last_hidden_states=torch.zeros(1, length, width),
        )
    save_file({"logits": captured["logits"][0].float().contiguous()}, spec["output"])


def ttt_forward(model: Any, spec: dict[str, Any]) -> None:
    """EAGLE-3 logits of every training-time-test step through the package's own training forward, its loss swapped
    for one that keeps the logits. Everything else is the package's code: ``input_norm`` / ``fc_norm`` and fc over
    the aux states, step 0 on the projected features, step j on the draft's own step j-1 output (normed when
    ``norm_output``), its flex attention over the cached steps, positions advanced by one per step.

    Inputs (safetensors): ``hidden_states [1, T, n_aux * H]``, ``input_ids [1, T]`` (the token fed at step 0 with
    each position's states; step j feeds them shifted j left, zero-filled, as the package does); ``spec["steps"]``.
    The sequence is zero-padded at the end to a multiple of the flex block (128): causal attention keeps the padding
    out of every real position. Writes ``logits [steps, T, draft V]`` in float32."""
    import torch
    from safetensors.torch import load_file, save_file

    from speculators.models.eagle3 import core

    inputs = load_file(spec["inputs"])
    hidden, ids = inputs["hidden_states"].float(), inputs["input_ids"]
    length = ids.shape[1]
    padded = -(-length // 128) * 128
    hidden = torch.nn.functional.pad(hidden, (0, 0, 0, padded - length))
    ids = torch.nn.functional.pad(ids, (0, padded - length))
    captured: list[Any] = []

    def keep_logits(logits: Any, *_: Any, **__: Any) -> tuple[Any, dict]:
        captured.append(logits[0, :length].float())
        return logits.sum() * 0, {}

    core.compute_metrics = keep_logits
    model = model.float().eval()
    width = model.config.transformer_layer_config.hidden_size
    with torch.no_grad():
        model(
            hidden_states=hidden,
            input_ids=ids,
            document_ids=torch.zeros(1, padded, dtype=torch.long),
            position_ids=torch.arange(padded).unsqueeze(0),
            loss_mask=torch.ones(1, padded),
            verifier_last_hidden_states=torch.zeros(1, padded, width),
            ttt_steps=int(spec["steps"]),
        )
    save_file({"logits": torch.stack(captured).contiguous()}, spec["output"])


def mtp_forward(model: Any, spec: dict[str, str]) -> None:
    """MTP logits through the package's own training forward (``MTPDraftModel.forward``: every step teacher-forced
    over the whole sequence, each step's hidden the previous step's output), in float32.

    Inputs (safetensors): ``hidden_states [1, T, H]`` (the verifier's last hidden state, final norm applied: what
    the package's data calls ``verifier_last_hidden_states``), ``input_ids [1, T]``. Writes ``logits [steps, T', V]``
    (T' = T - steps - 1, the positions every step covers) in float32."""
    import torch
    from safetensors.torch import load_file, save_file

    inputs = load_file(spec["inputs"])
    model = model.float().eval()
    with torch.no_grad():
        logits, _, _ = model(input_ids=inputs["input_ids"], hidden_states=inputs["hidden_states"].float())
    save_file({"logits": torch.stack([step[0] for step in logits]).float().contiguous()}, spec["output"])


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: speculators_package_worker.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    request = json.loads(Path(argv[1]).read_text())
    result_path = Path(argv[2])
    try:
        from importlib.metadata import version

        from speculators import SpeculatorModel

        if request.get("convert_dflash"):  # the package's own converter writes request["model"] first
            from speculators.convert.dflash import DFlashConverter

            job = request["convert_dflash"]
            DFlashConverter().convert(
                job["input"], request["model"], base_model=job["verifier"], validate=False
            )
        if request.get("convert_mtp"):  # the package's MTP converter extracts a verifier's MTP layer first
            from speculators.convert.mtp import MTPConverter

            job = request["convert_mtp"]
            MTPConverter().convert(
                job["verifier"], request["model"], base_model=job["verifier"], validate=False
            )
        if request.get("build"):  # the package's own constructor writes request["model"] first
            build_peer_draft(request["build"], request["model"])
        started = time.perf_counter()
        model = SpeculatorModel.from_pretrained(request["model"])
        seconds = time.perf_counter() - started
        if request.get("block_forward"):
            block_forward(model, request["block_forward"])
        if request.get("peagle_forward"):
            peagle_forward(model, request["peagle_forward"])
        if request.get("ttt_forward"):
            ttt_forward(model, request["ttt_forward"])
        if request.get("mtp_forward"):
            mtp_forward(model, request["mtp_forward"])
        result = {
            "ok": True,
            "speculators_version": version("speculators"),
            "load_seconds": seconds,
            **describe(model),
        }
        status = 0
    except Exception as exc:  # noqa: BLE001 - reported to the caller with the traceback
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        status = 1
    result_path.write_text(json.dumps(result))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
