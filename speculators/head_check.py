"""The verifier's own logits on a few real positions, and the check that a training head reproduces them.

Training targets are the verifier's distribution: ``logits = transform(lm_head(norm(h)))`` applied to the pre-norm
last state ``h`` that capture stores. The trainer computes them without running the verifier (offline and streamed
training read only the final norm and lm_head from its files), so a head that computes them differently from the
verifier trains a wrong draft *silently*: greedy identity still holds, the trainer's simulated acceptance is scored
against the same wrong targets, and only a served acceptance far below the trainer's betrays it (a Gemma 3 final
norm read as Llama's ``x·w`` instead of ``x·(1 + w)``, say).

So wherever the verifier itself runs (data generation, the streamed producers, online training) it records a
:class:`HeadProbe`: the pre-norm states of a few real positions and the verifier's own log-probabilities there, from
its full forward. Before the first step the trainer feeds those states through its head and stops with one line
when the two disagree (:func:`check_head`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from speculators.atomic import fsync_replace, temp_sibling

PROBE_NAME = "head_probe.safetensors"  # beside the features (data_gen output, the stream spool)
PROBE_POSITIONS = 32  # real positions of the first training sample
PROBE_TOP_K = 32  # the verifier's most likely tokens per position whose log-probabilities are compared
# Loose enough for a correct head fed bf16-captured states in float32 (rounding moves near-ties and a few hundredths
# of a nat); a wrong final norm is far outside both (tests/families/test_head_check.py).
MIN_ARGMAX_AGREEMENT = 0.9
MAX_LOGPROB_ERROR = 0.25


class HeadMismatchError(RuntimeError):
    """The trainer's head does not compute the verifier's logits: its targets would train a wrong draft."""


@dataclass(frozen=True)
class HeadProbe:
    """The verifier's own answer at a few real positions: what any training head must reproduce."""

    last_prenorm: torch.Tensor  # [N, H] float32: the last decoder layer's output, before the final norm
    top_ids: torch.Tensor  # [N, K] long: the verifier's K most likely tokens, most likely first
    top_logprobs: torch.Tensor  # [N, K] float32: their log-probabilities under the verifier's full forward

    def save(self, path: str | Path) -> None:
        """Written to a temporary sibling and renamed (speculators.atomic), so a reader never sees half a probe."""
        path = Path(path)
        tensors = {
            "last_prenorm": self.last_prenorm.contiguous(),
            "top_ids": self.top_ids.contiguous(),
            "top_logprobs": self.top_logprobs.contiguous(),
        }
        temporary = temp_sibling(path)
        try:
            save_file(tensors, str(temporary))
            fsync_replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> HeadProbe | None:
        """The probe at ``path``, or None when there is none (data generated before probes were recorded)."""
        path = Path(path)
        if not path.is_file():
            return None
        from speculators.format.checkpoint import read_weights_file

        tensors, _ = read_weights_file(path)
        return cls(
            tensors["last_prenorm"].float(), tensors["top_ids"].long(), tensors["top_logprobs"].float()
        )


@torch.no_grad()
def record_head_probe(
    model: nn.Module, input_ids: Sequence[int] | torch.Tensor, positions: int = PROBE_POSITIONS
) -> HeadProbe:
    """Run the verifier's full forward (its own norm, lm_head and logit transform) on the first ``positions``
    tokens of ``input_ids`` and keep the pre-norm last states beside its log-probabilities."""
    from speculators.verifier import capture_aux_states, decoder_layers

    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)[:positions]
    if ids.numel() == 0:
        raise ValueError("a head probe needs at least one token")
    device = next(model.parameters()).device
    num_layers = len(decoder_layers(model))
    with capture_aux_states(model, [num_layers]) as box:
        logits = model(input_ids=ids[None].to(device)).logits
    last = box["states"].last_prenorm[0].float().cpu()
    logprobs = logits[0].float().log_softmax(-1).cpu()
    top = logprobs.topk(min(PROBE_TOP_K, logprobs.shape[-1]), dim=-1)
    return HeadProbe(last, top.indices, top.values)


@dataclass(frozen=True)
class HeadAgreement:
    """How closely a head reproduces the verifier on the probe's positions."""

    positions: int
    argmax_agreement: float  # share of positions whose argmax is the verifier's
    logprob_error: float  # mean |Δ log p| over the verifier's top-K tokens, nats

    @property
    def ok(self) -> bool:
        return self.argmax_agreement >= MIN_ARGMAX_AGREEMENT and self.logprob_error <= MAX_LOGPROB_ERROR

    def line(self) -> str:
        return (
            f"argmax agreement {self.argmax_agreement:.1%}, log-prob error {self.logprob_error:.3f} nats on "
            f"{self.positions} positions"
        )


@torch.no_grad()
def compare_head(full_logits: Callable[[torch.Tensor], torch.Tensor], probe: HeadProbe) -> HeadAgreement:
    """``full_logits`` maps pre-norm states ``[N, H]`` to logits over the verifier's whole vocabulary."""
    logprobs = full_logits(probe.last_prenorm).float().log_softmax(-1).cpu()
    mine = logprobs.gather(-1, probe.top_ids)
    return HeadAgreement(
        positions=int(probe.last_prenorm.shape[0]),
        argmax_agreement=float((logprobs.argmax(-1) == probe.top_ids[:, 0]).float().mean()),
        logprob_error=float((mine - probe.top_logprobs).abs().mean()),
    )


def check_head(
    full_logits: Callable[[torch.Tensor], torch.Tensor], probe: HeadProbe, verifier: str, where: str
) -> HeadAgreement:
    """The agreement, or :class:`HeadMismatchError` in one line naming the verifier, the probe and the fix."""
    agreement = compare_head(full_logits, probe)
    if not agreement.ok:
        raise HeadMismatchError(
            f"the training head does not reproduce {verifier}'s own logits ({agreement.line()} recorded in "
            f"{where}; needs ≥ {MIN_ARGMAX_AGREEMENT:.0%} and ≤ {MAX_LOGPROB_ERROR} nats): its targets would "
            "train a wrong draft; declare the verifier's family in speculators/families/ (docs/families.md)"
        )
    return agreement


__all__ = [
    "PROBE_NAME",
    "HeadAgreement",
    "HeadMismatchError",
    "HeadProbe",
    "check_head",
    "compare_head",
    "record_head_probe",
]
