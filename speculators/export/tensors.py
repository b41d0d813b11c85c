"""Bringing a draft's tensors into the standard form: unprefixed names, ``layers.0.`` instead of ``midlayer.``,
float weights in the export dtype, ``d2t`` as int64 OFFSETS, ``t2d`` as a bool mask, and ``embed_tokens.weight``
always present (copied from the verifier when a source left it out).

Every source (trainer checkpoints, gathered ZeRO shards, other projects' layouts) goes through
:func:`standard_tensors`, so the rules live in one place and each deviation becomes a warning that names it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from speculators.algorithms import AUX_BLOCKED_BY_FC
from speculators.format.validate import algorithm_of
from speculators.verifier import verifier_embedding

# Stored names some producers use for layer 0 (vLLM accepts both; the standard is `layers.0.`).
LAYER0_ALIASES = ("midlayer.",)
# Buffers that are derived, never part of a checkpoint; dropped silently when a state dict carries them.
DERIVED_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


class ExportWarning(UserWarning):
    """Something in a source was changed on the way to the standard form (shifted ids, converted d2t, ...)."""


def warn(message: str) -> None:
    warnings.warn(message, ExportWarning, stacklevel=3)


def detect_prefix(names: list[str], anchor: str = "lm_head.weight") -> str:
    """The prefix wrapping the draft's names in a state dict (``""``, ``"model."``, ``"module.draft."``, ...),
    found from the one tensor every draft of the type has (``Algorithm.anchor_tensor``: ``lm_head.weight`` for
    every type that stores its head)."""
    heads = [n.removesuffix(anchor) for n in names if n.endswith(anchor)]
    heads = [p for p in heads if p == "" or p.endswith(".")]
    if not heads:
        raise ValueError(f"no {anchor} among the tensors: this is not a state dict of the draft type")
    if len(set(heads)) > 1:
        raise ValueError(f"several {anchor} tensors ({sorted(heads)}): cannot tell which one is the draft")
    return heads[0]


def unprefixed(
    tensors: dict[str, torch.Tensor], where: str, anchor: str = "lm_head.weight"
) -> dict[str, torch.Tensor]:
    """Names relative to the draft (prefix stripped, ``midlayer.`` → ``layers.0.``); other modules' tensors (e.g. a
    verifier held in the same training wrapper) are left out with a warning."""
    prefix = detect_prefix(list(tensors), anchor)
    out: dict[str, torch.Tensor] = {}
    foreign = []
    for name, tensor in tensors.items():
        if not name.startswith(prefix):
            foreign.append(name)
            continue
        name = name[len(prefix) :]
        for alias in LAYER0_ALIASES:
            if name.startswith(alias):
                name = "layers.0." + name[len(alias) :]
        if name.endswith(DERIVED_BUFFERS):
            continue
        out[name] = tensor
    if prefix:
        warn(
            f"{where}: stripped the prefix {prefix!r} from the draft's tensor names (the standard is unprefixed)"
        )
    if foreign:
        warn(f"{where}: left out {len(foreign)} tensors outside the draft (e.g. {foreign[0]!r})")
    return out


def vocab_offsets(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int, where: str) -> torch.Tensor:
    """``d2t`` as offsets (``target = draft_id + d2t[draft_id]``), converting a table of target ids with a warning.

    ``t2d`` decides when both readings are possible; without it a strictly increasing table with every entry at or
    above its index is read as ids (offsets of a frequency-selected vocabulary are almost never like that).
    """
    d2t = d2t.to(torch.long).flatten()
    draft_ids = torch.arange(d2t.shape[0])
    as_offsets, as_ids = d2t + draft_ids, d2t

    def valid(targets: torch.Tensor) -> bool:
        in_range = bool(((targets >= 0) & (targets < vocab_size)).all())
        return in_range and torch.unique(targets).numel() == targets.numel()

    def matches(targets: torch.Tensor) -> bool:
        kept = torch.nonzero(t2d.bool()).flatten()
        return valid(targets) and torch.equal(torch.sort(targets).values, kept)

    if t2d is not None:
        if matches(as_offsets):
            return d2t
        if matches(as_ids):
            warn(f"{where}: d2t holds target ids, not offsets; converted (d2t = ids - arange(N))")
            return as_ids - draft_ids
        raise ValueError(
            f"{where}: d2t matches t2d neither as offsets nor as target ids; the vocabulary mapping is corrupt "
            "(rebuild d2t/t2d from the same token selection)"
        )
    offsets_ok, ids_ok = valid(as_offsets), valid(as_ids)
    looks_like_ids = d2t.numel() > 1 and bool((d2t >= draft_ids).all()) and bool((d2t[1:] > d2t[:-1]).all())
    if ids_ok and (looks_like_ids or not offsets_ok):
        warn(f"{where}: d2t holds target ids, not offsets; converted (d2t = ids - arange(N))")
        return as_ids - draft_ids
    if offsets_ok:
        return d2t
    raise ValueError(
        f"{where}: d2t maps draft ids outside the verifier vocabulary [0, {vocab_size}) either way"
    )


def standard_vocab(
    tensors: dict[str, torch.Tensor], draft_vocab_size: int, vocab_size: int, where: str
) -> dict[str, torch.Tensor]:
    """``d2t`` (int64 offsets) and ``t2d`` (bool), either derived from the other when only one is stored."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if draft_vocab_size == vocab_size:
        if d2t is not None and bool(vocab_offsets(d2t, t2d, vocab_size, where).any()):
            raise ValueError(
                f"{where}: draft vocab == verifier vocab but d2t is not the identity; fix the config"
            )
        return {}
    if t2d is not None:
        t2d = t2d.flatten().bool()
        if t2d.shape[0] != vocab_size:
            raise ValueError(f"{where}: t2d has {t2d.shape[0]} entries, the verifier vocabulary {vocab_size}")
    if d2t is None and t2d is None:
        raise ValueError(
            f"{where}: the draft vocabulary ({draft_vocab_size} of {vocab_size} tokens) has no d2t/t2d mapping; "
            "a reduced vocabulary is unusable without it"
        )
    if d2t is None:
        kept = torch.nonzero(t2d).flatten()
        warn(f"{where}: d2t was missing; derived it from t2d")
        d2t = kept - torch.arange(kept.numel())
    else:
        d2t = vocab_offsets(d2t, t2d, vocab_size, where)
    if d2t.shape[0] != draft_vocab_size:
        raise ValueError(
            f"{where}: d2t has {d2t.shape[0]} entries but draft_vocab_size is {draft_vocab_size}"
        )
    if t2d is None:
        warn(f"{where}: t2d was missing; derived it from d2t")
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[d2t + torch.arange(d2t.shape[0])] = True
    return {"d2t": d2t.to(torch.long).contiguous(), "t2d": t2d.to(torch.bool).contiguous()}


def standard_tensors(
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    dtype: torch.dtype,
    verifier_dir: str | Path | None = None,
    where: str = "checkpoint",
) -> dict[str, torch.Tensor]:
    """Exactly the tensors ``config`` implies, under the standard names and dtypes; raises ``ValueError`` naming
    every missing or unexpected tensor rather than writing a checkpoint a consumer would reject."""
    layer = config["transformer_layer_config"]
    vocab_size, draft_vocab_size = (
        int(layer["vocab_size"]),
        int(config.get("draft_vocab_size", layer["vocab_size"])),
    )
    unit = algorithm_of(config)
    if unit is None:
        raise ValueError(
            f"{where}: speculators_model_type {config.get('speculators_model_type')!r} is not a type this project "
            "exports (no declared unit in speculators.algorithms)"
        )
    tensors = unprefixed(tensors, where, unit.anchor_tensor)
    shapes = unit.expected_shapes(config)
    out = {n: t for n, t in tensors.items() if n not in ("d2t", "t2d")}
    out.update(standard_vocab(tensors, draft_vocab_size, vocab_size, where))
    if "embed_tokens.weight" not in out and "embed_tokens.weight" in shapes:
        if verifier_dir is None:
            raise ValueError(
                f"{where}: has no embed_tokens.weight; pass the verifier (--verifier) so its embedding is copied in "
                "(the speculators library otherwise loads uninitialised memory)"
            )
        warn(f"{where}: embed_tokens.weight was missing; copied the verifier's input embedding")
        out["embed_tokens.weight"] = verifier_embedding(verifier_dir)
    missing = sorted(set(shapes) - set(out))
    unexpected = sorted(set(out) - set(shapes))
    wrong = sorted(n for n in set(shapes) & set(out) if tuple(out[n].shape) != shapes[n])
    if missing or unexpected or wrong:
        details = [f"missing {missing}"] if missing else []
        details += [f"not part of this config {unexpected}"] if unexpected else []
        details += [f"{n} has shape {list(out[n].shape)}, expected {list(shapes[n])}" for n in wrong]
        raise ValueError(f"{where}: the tensors do not match the draft config: " + "; ".join(details))
    for name, tensor in out.items():
        if name not in ("d2t", "t2d"):
            out[name] = tensor.detach().to(dtype).contiguous()
    return out


def ascending_aux_layers(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], where: str
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Put the aux layers in ascending order, permuting every tensor laid out per aux layer to match: those the
    algorithm declares (``Algorithm.aux_blocked_tensors``: ``fc``'s columns, ``input_norm``, P-EAGLE's
    ``mask_hidden``) and the per-layer ``fc_norm``s.

    vLLM captures the aux states as ``sorted(set(ids))`` and concatenates them in that order, whatever order the
    config lists: a draft trained on ``[16, 2, 29]`` would silently read its features shuffled. Repeated ids are
    collapsed by vLLM too, so ``fc`` then gets fewer features than it was trained on and the engine fails; that
    case is warned about (the fix is distinct ids at training time).
    """
    unit = algorithm_of(config)
    key = unit.aux_layer_key if unit is not None else "eagle_aux_hidden_state_layer_ids"
    blocked = unit.aux_blocked_tensors if unit is not None else AUX_BLOCKED_BY_FC
    ids = [int(i) for i in config.get(key) or []]
    if len(set(ids)) != len(ids):
        warn(
            f"{where}: aux layer ids {ids} repeat a layer; vLLM captures each layer once (sorted, de-duplicated), "
            f"so fc would get {len(set(ids))} states instead of {len(ids)} and vLLM fails to run this draft. "
            "Train with distinct ids (a verifier with at least 8 layers for the default [2, L//2, L-3])."
        )
        return config, tensors
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    if order == list(range(len(ids))):
        return config, tensors
    tensors = dict(tensors)
    permuted = []
    for name, dim in blocked:
        if name in tensors:
            tensors[name] = permute_aux_blocks(tensors[name], dim, order, f"{where}: {name}")
            permuted.append(name)
    if "fc_norm.0.weight" in tensors:
        norms = [tensors.pop(f"fc_norm.{i}.weight") for i in range(len(ids))]
        tensors.update({f"fc_norm.{new}.weight": norms[old] for new, old in enumerate(order)})
        permuted.append("fc_norm.*")
    config = {**config, key: sorted(ids)}
    warn(
        f"{where}: aux layer ids {ids} were not ascending; vLLM concatenates the states in ascending order, so the "
        f"ids became {sorted(ids)} and {permuted} were permuted to match (the draft computes the same)"
    )
    return config, tensors


def permute_aux_blocks(tensor: torch.Tensor, dim: int, order: list[int], what: str) -> torch.Tensor:
    """``tensor`` with its ``len(order)`` equal blocks along ``dim`` (one per aux layer) put in ``order``."""
    if tensor.shape[dim] % len(order):
        raise ValueError(
            f"{what} has {tensor.shape[dim]} entries along dim {dim}, not a multiple of the {len(order)} aux layers"
        )
    width = tensor.shape[dim] // len(order)
    return torch.cat([tensor.narrow(dim, i * width, width) for i in order], dim=dim).contiguous()
