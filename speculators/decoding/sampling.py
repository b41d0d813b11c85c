"""Turning logits into the distributions that speculative decoding compares, and drawing from them.

The verifier's target distribution ``p`` and the draft's proposal ``q`` must be transformed by the SAME temperature
and top-p rule that plain sampling uses; otherwise "lossless" would be lossless with respect to the wrong ``p``.
Temperature 0 means greedy (argmax), handled by the callers without building distributions.
"""

from __future__ import annotations

import torch


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """``softmax(logits / T)`` restricted to the smallest top-p nucleus and renormalised (fp32, last dim)."""
    if temperature <= 0:
        raise ValueError("target_probs needs temperature > 0 (temperature 0 is greedy decoding)")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = _top_p_filter(probs, top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose cumulative mass first reaches ``top_p`` (always at least one)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    filtered = probs * keep
    return filtered / filtered.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` (``[..., V]`` → ``[...]``)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def uniform(
    shape: torch.Size | tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    return torch.rand(shape, generator=generator, device=device)
