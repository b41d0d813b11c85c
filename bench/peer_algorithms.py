"""The peer lane's algorithms: for each draft type the peer's trainer knows, the flags our recipe's settings become,
what is matched and what not (:mod:`bench.peer_lane` runs the lane).

Algorithms (issue 20): ``--algorithm`` picks a row of :data:`ALGORITHMS`: EAGLE-3 and EAGLE-3.1 (the peer's eagle3
with its two norms on), and the parallel drafters P-EAGLE, DFlash and DFlash2 (the peer's ``--speculator-type
peagle|dflash|dflash2``). All of them read the same converted data (the
peer's P-EAGLE and DFlash take the 3 aux + last layout below too) and share the data, vocabulary, optimizer and
schedule flags; each row declares the draft and objective flags its recipe's settings become (draft layers, K
depths / block size, COD seed or anchor cap, slot weighting, causal blocks, the mask token OUR resolver picks),
what is matched and what not; the lane JSON records both lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


# ---- the algorithms -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerAlgorithm:
    """One draft type the peer lane trains with the peer's own trainer: its ``--speculator-type``, our recipe it is
    matched to, the recipe's draft/objective settings (``--recipe`` reads them from the recipe instead), the peer
    flags those settings become, and what is (not) matched. Shared by every algorithm: the data, vocabulary,
    optimizer and schedule flags (:func:`peer_flags`) and :data:`COMMON_MATCHED` / :func:`common_not_matched`."""

    speculator_type: str
    recipe: str
    draft_defaults: dict[str, Any]
    draft_flags: Callable[[dict[str, Any]], list[str]]
    matched: list[str]
    not_matched: Callable[[dict[str, Any]], list[str]]
    needs_mask_token: bool = False
    # why the peer's checkpoint goes through our ``speculators convert`` before it is validated and measured ('':
    # it is taken as the peer wrote it)
    convert_export: str = ""
    vllm_k: int | None = None  # k vLLM serves the export at; None: the export's own speculative_tokens

    def vllm_speculative_config(self, draft: Path) -> dict[str, Any]:
        """How the bench serves the export: through our algorithm units, as our drafts (P-EAGLE: parallel
        drafting), at ``vllm_k``."""
        from speculators.serving import draft_speculative_config

        return draft_speculative_config(draft, self.vllm_k)


def _bool_flag(name: str, on: bool) -> str:
    return f"--{name}" if on else f"--no-{name}"


def llama_layer_flags(draft: dict[str, Any]) -> list[str]:
    """Our EAGLE-3-shaped layers: llama, full attention, norm before the residual; EAGLE-3.1's two norms as the
    draft sets them (off unless it declares them: the peer's eagle3 defaults them on)."""
    return [
        "--draft-arch", "llama",
        "--full-attention-indices", *map(str, range(draft["num_layers"])),
        _bool_flag("norm-before-residual", draft["norm_before_residual"]),
        _bool_flag("norm-before-fc", bool(draft.get("norm_before_fc"))),
        _bool_flag("norm-output", bool(draft.get("norm_output"))),
    ]  # fmt: skip


def eagle3_flags(draft: dict[str, Any]) -> list[str]:
    """EAGLE-3: llama layers at full attention, norm before the residual, TTT unrolled with per-step decay."""
    return [
        *llama_layer_flags(draft),
        "--mask-token-id", "0",  # unused by eagle3; explicit so the peer does not load a tokenizer to pick one
        "--ttt-steps", str(draft["ttt_steps"]),
        "--ttt-step-loss-decay", repr(draft["step_weight_decay"]),
    ]  # fmt: skip


def peagle_flags(draft: dict[str, Any]) -> list[str]:
    """P-EAGLE: our EAGLE-3-shaped layers (llama, full attention), K = our ttt_steps depths, our COD seed cap and
    mask token, trainable embedding."""
    return [
        *llama_layer_flags(draft),
        _bool_flag("embed-requires-grad", draft["embed_requires_grad"]),
        "--mask-token-id", str(draft["mask_token_id"]),
        "--num-depths", str(draft["ttt_steps"]),
        "--max-anchors", str(draft["max_anchors"]),
    ]  # fmt: skip


def dflash_flags(draft: dict[str, Any]) -> list[str]:
    """DFlash: qwen3 layers (what vLLM builds), our block size, anchors, slot weighting and mask token; the anchor
    slot is not a prediction (block_size - 1 drafts, as ours). Causal blocks (our ``block_causal``) = every layer
    sliding-window with the window at the verifier's context, intra-block causal (the peer's full-attention layers
    are always bidirectional); bidirectional blocks = every layer full attention."""
    attention = (
        ["--sliding-window", str(draft["sliding_window"]), "--no-sliding-window-non-causal"]
        if draft["block_causal"]
        else ["--full-attention-indices", *map(str, range(draft["num_layers"]))]
    )
    weighting = {"exp_decay": "fixed-exp-decay", "dpace": "dpace"}[draft["position_weighting"]]
    return [
        "--draft-arch", "qwen3",
        *attention,
        "--mask-token-id", str(draft["mask_token_id"]),
        "--block-size", str(draft["block_size"]),
        "--no-sample-from-anchor",
        "--max-anchors", str(draft["max_anchors"]),
        "--per-position-loss-weight", weighting,
        "--dflash-decay-gamma", repr(draft["decay_gamma"]),
        "--dpace-alpha", repr(draft["dpace_alpha"]),
    ]  # fmt: skip


def dflash2_flags(draft: dict[str, Any]) -> list[str]:
    """DFlash2: DFlash's flags (layers, block, anchors, slot weights, mask token) plus its convolutions and
    candidate selector as our recipe sets them (``model.dflash2.*``, ``train.dflash2.selector_weight``)."""
    return [
        *dflash_flags(draft),
        "--conv-kernel-size", str(draft["conv_kernel_size"]),
        "--conv-group-size", str(draft["conv_group_size"]),
        "--selector-rank", str(draft["selector_rank"]),
        "--selector-top-k", str(draft["selector_top_k"]),
        "--selector-loss-alpha", repr(draft["selector_weight"]),
    ]  # fmt: skip


def dflash2_not_matched(draft: dict[str, Any]) -> list[str]:
    return [
        *dflash_not_matched(draft),
        "selector target: both take the verifier's argmax among the unary top-k; when the top-k misses it ours "
        "puts it in place of the last candidate (the peer's handling not verified equal)",
    ]


def eagle3_not_matched(draft: dict[str, Any]) -> list[str]:
    return [
        "fc init: peer random; ours fc_init feature_rms (columns scaled by 1/RMS of each feature dim)",
        "TTT inputs: the peer teacher-forces ground-truth tokens into later steps; no out-of-vocab target mask",
    ]


def peagle_not_matched(draft: dict[str, Any]) -> list[str]:
    gaps = [
        "fc init: peer random; ours fc_init feature_rms (columns scaled by 1/RMS of each feature dim)",
        "mask_hidden init: peer torch.randn; ours follows our P-EAGLE model's init",
        "compute: the peer forwards only the COD-sampled elements; ours computes every depth at every position and "
        "trains the COD-sampled ones (same loss elements, different CPU per step)",
        "out-of-vocab targets: the peer does not mask them; ours does (train.mask_out_of_vocab)",
        "per-depth normalisation: ours normalises each depth by its trained count; the peer's compound loss over "
        "the flat sampled sequence (not verified equal)",
    ]
    if draft["step_weight_decay"] != 1.0:
        gaps.append(f"depth weights: ours {draft['step_weight_decay']}^d; the peer weighs every depth 1.0")
    if not draft["embed_requires_grad"]:
        gaps.append("embedding: the peer's P-EAGLE always trains it (its config default); ours freezes it")
    return gaps


def dflash_not_matched(draft: dict[str, Any]) -> list[str]:
    gaps = [
        "fc init: peer random; ours per model.fc_init (feature_rms in the *_large recipes)",
        "anchors: both sample up to max_anchors loss-mask positions per micro batch, each with its own RNG",
        "out-of-vocab targets: the peer does not mask them; ours does (train.mask_out_of_vocab)",
        "loss normalisation: ours divides the weighted sum by the global batch's weight total; the peer's compound "
        "loss (not verified equal)",
    ]
    if draft["position_weighting"] == "dpace":
        gaps.append(
            "D-PACE: the peer requires --loss-fn ce (hard argmax targets) for it; the lane keeps kl_div"
        )
    return gaps


COMMON_DRAFT = {"num_layers": 1}
EAGLE3_DRAFT = {**COMMON_DRAFT, "ttt_steps": 3, "step_weight_decay": 0.8, "norm_before_residual": True}
DFLASH_DRAFT = {
    **COMMON_DRAFT,
    "block_size": 5,
    "block_causal": True,
    "max_anchors": 256,
    "position_weighting": "exp_decay",
    "decay_gamma": 4.0,
    "dpace_alpha": 0.5,
    "mask_token_id": None,
    "sliding_window": None,  # None: the verifier's context (max_position_embeddings), as ours
}
ALGORITHMS: dict[str, PeerAlgorithm] = {
    "eagle3": PeerAlgorithm(
        speculator_type="eagle3",
        recipe="eagle3_smollm2_large",
        draft_defaults=EAGLE3_DRAFT,
        draft_flags=eagle3_flags,
        matched=[
            "draft: llama decoder layers, full attention, norm_before_residual, no norm_before_fc/norm_output",
            "TTT steps, step-weight decay (--ttt-step-loss-decay)",
        ],
        not_matched=eagle3_not_matched,
        vllm_k=3,
    ),
    # EAGLE-3.1: the peer's eagle3 with both norms on (its own eagle3 default), matched to eagle31_smollm2_large
    "eagle31": PeerAlgorithm(
        speculator_type="eagle3",
        recipe="eagle31_smollm2_large",
        draft_defaults={**EAGLE3_DRAFT, "norm_before_fc": True, "norm_output": True},
        draft_flags=eagle3_flags,
        matched=[
            "draft: llama decoder layers, full attention, norm_before_residual, norm_before_fc and norm_output on "
            "(--norm-before-fc --norm-output: EAGLE-3.1)",
            "TTT steps, step-weight decay (--ttt-step-loss-decay)",
        ],
        not_matched=eagle3_not_matched,
        vllm_k=3,
    ),
    "peagle": PeerAlgorithm(
        speculator_type="peagle",
        recipe="peagle_smollm2_large",
        draft_defaults={
            **COMMON_DRAFT,
            "ttt_steps": 4,
            "step_weight_decay": 1.0,
            "norm_before_residual": True,
            "embed_requires_grad": True,
            "max_anchors": 256,
            "mask_token_id": None,
        },
        draft_flags=peagle_flags,
        matched=[
            "draft: llama decoder layers (our EAGLE-3 layer), full attention, norm_before_residual, no "
            "norm_before_fc/norm_output, trainable embedding",
            "K depths = our train.ttt_steps (--num-depths: the export's speculative_tokens)",
            "COD sampling: our peagle.max_anchors seeds (--max-anchors), keep ratio max(0.7^d, 0.2) (both defaults)",
            "mask token: our resolver's id (speculators.mask_token on the data's token counts) via --mask-token-id",
        ],
        not_matched=peagle_not_matched,
        needs_mask_token=True,
    ),
    "dflash": PeerAlgorithm(
        speculator_type="dflash",
        recipe="dflash_smollm2_large",
        draft_defaults=DFLASH_DRAFT,
        draft_flags=dflash_flags,
        matched=[
            "draft: qwen3 decoder layers (q/k norm), our num_layers, block_size (block_size - 1 drafts, the anchor "
            "slot untrained: --no-sample-from-anchor), causal blocks as ours (block_causal)",
            "anchors per micro batch (--max-anchors), slot weights exp(-(j-1)/gamma) = ours exp(-j/gamma) "
            "(--per-position-loss-weight fixed-exp-decay, --dflash-decay-gamma)",
            "mask token: our resolver's id (speculators.mask_token on the data's token counts) via --mask-token-id",
        ],
        not_matched=dflash_not_matched,
        needs_mask_token=True,
    ),
    # DFlash2: the full verifier vocabulary (no draft vocabulary: 0.9.0 refuses a reduced one)
    "dflash2": PeerAlgorithm(
        speculator_type="dflash2",
        recipe="dflash2_smollm2_large",
        draft_defaults={
            **DFLASH_DRAFT,
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 256,
            "selector_top_k": 16,
            "selector_weight": 1.0,
        },
        draft_flags=dflash2_flags,
        matched=[
            "draft: DFlash's (qwen3 layers, block size, causal blocks as ours, anchors, slot weights, mask token)",
            "convolutions: kernel and group size (--conv-kernel-size, --conv-group-size); selector rank, top-k and "
            "loss weight (--selector-rank, --selector-top-k, --selector-loss-alpha)",
            "vocabulary: the verifier's whole vocabulary on both sides (no --d2t-path/--t2d-path)",
        ],
        not_matched=dflash2_not_matched,
        needs_mask_token=True,
        convert_export="speculators 0.9.0 saves a DFlash2 draft without its embedding and head (it rebuilds both "
        "from the verifier on load); `speculators convert` writes the verifier's, as the format requires",
    ),
}
