"""Verification: which drafted tokens the verifier keeps, and the token it adds after them.

Greedy: walk down the tree while some child equals the verifier's argmax; then append the argmax (a correction, or
a bonus token at a leaf). The output is exactly plain greedy decoding.

Sampling (lossless): at the current node with target ``p``, try the children in order. A child x drawn from proposal
``q`` is accepted with probability ``min(1, p(x)/q(x))``; on rejection the target becomes ``norm(max(0, p − q))``
and the next sibling is tried against it. When no child is accepted (or the node is a leaf), the next token is drawn
from the current target: a residual resample after rejections, the bonus token after full acceptance. Each sibling
is one standard speculative-sampling step whose output is distributed as its own target, so by induction the emitted
token is distributed exactly as ``p``. Deterministically chosen siblings (top-k trees) are point-mass proposals
``q = δ_x``: acceptance ``p(x)`` and residual ``p`` with ``x`` removed, which is lossless for any fixed choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculators.decoding.sampling import sample, uniform
from speculators.decoding.tree import DraftTree


@dataclass
class Verdict:
    path: (
        torch.Tensor
    )  # [B, D + 1] node indices from the root; entries past num_accepted repeat the last node
    num_accepted: torch.Tensor  # [B] drafted tokens accepted
    next_token: torch.Tensor  # [B] the verifier's token after the accepted path (correction or bonus)

    def emitted(self, tree: DraftTree) -> list[list[int]]:
        """Per row: the accepted drafted tokens followed by the verifier's own token."""
        accepted = tree.tokens.gather(1, self.path[:, 1:])
        out = []
        for row, count in enumerate(self.num_accepted.tolist()):
            out.append(accepted[row, :count].tolist() + [int(self.next_token[row])])
        return out


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """Accept the longest path whose tokens equal the verifier's argmax at each parent."""
    batch = tree.tokens.shape[0]
    rows = torch.arange(batch, device=logits.device)
    argmax = logits.argmax(dim=-1)  # [B, N]
    children = tree.children()
    current = torch.zeros(batch, dtype=torch.long, device=logits.device)
    active = torch.ones(batch, dtype=torch.bool, device=logits.device)
    accepted = torch.zeros(batch, dtype=torch.long, device=logits.device)
    path = [current]
    for _ in range(tree.max_depth):
        want = argmax[rows, current]
        kids = children[rows, current]  # [B, K]
        kid_tokens = tree.tokens.gather(1, kids.clamp(min=0))
        match = (kid_tokens == want[:, None]) & (kids >= 0)
        moved = match.any(dim=-1) & active
        current = torch.where(moved, kids.gather(1, match.int().argmax(dim=-1, keepdim=True))[:, 0], current)
        accepted += moved.long()
        active &= moved
        path.append(current)
    return Verdict(path=torch.stack(path, dim=1), num_accepted=accepted, next_token=argmax[rows, current])


class RejectionSampler:
    """The lossless rule. Subclasses that change :meth:`accept_probability` or :meth:`residual` are how the tests
    build deliberately broken rules and prove the statistical test can tell."""

    def accept_probability(self, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(p_x / q_x.clamp(min=torch.finfo(q_x.dtype).tiny), max=1.0)

    def residual(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``norm(max(0, p − q))``; where it has no mass (p ≤ q everywhere, reached only through rounding), ``p``."""
        rest = torch.clamp(p - q, min=0.0)
        mass = rest.sum(dim=-1, keepdim=True)
        return torch.where(mass > 0, rest / mass.clamp(min=torch.finfo(p.dtype).tiny), p)

    def verify(
        self, tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None
    ) -> Verdict:
        """``probs``: ``[B, N, V]`` target distributions at every node (temperature and top-p applied)."""
        batch, _, vocab = probs.shape
        device = probs.device
        rows = torch.arange(batch, device=device)
        children = tree.children()
        current = torch.zeros(batch, dtype=torch.long, device=device)
        active = torch.ones(batch, dtype=torch.bool, device=device)
        accepted = torch.zeros(batch, dtype=torch.long, device=device)
        next_token = torch.zeros(batch, dtype=torch.long, device=device)
        path = [current]
        for _ in range(tree.max_depth + 1):
            target = probs[rows, current]  # [B, V]
            moved = torch.zeros(batch, dtype=torch.bool, device=device)
            kids_here = children[rows, current]
            for slot in range(kids_here.shape[1]):
                kid = kids_here[:, slot]
                trying = active & ~moved & (kid >= 0)
                if not bool(trying.any()):
                    break
                kid = torch.where(trying, kid, 0)
                token = torch.where(trying, tree.tokens[rows, kid], 0)
                if tree.proposals is None:
                    proposal = torch.nn.functional.one_hot(token, vocab).to(target.dtype)
                else:
                    proposal = tree.proposals[rows, kid].to(target.dtype)
                p_x = target.gather(1, token[:, None])[:, 0]
                q_x = proposal.gather(1, token[:, None])[:, 0]
                take = trying & (uniform((batch,), generator, device) < self.accept_probability(p_x, q_x))
                rejected = trying & ~take
                current = torch.where(take, kid, current)
                moved |= take
                target = torch.where(rejected[:, None], self.residual(target, proposal), target)
            stopping = active & ~moved
            if bool(stopping.any()):
                draws = sample(target, generator)
                next_token = torch.where(stopping, draws, next_token)
            accepted += moved.long()
            active &= moved
            path.append(current)
            if not bool(active.any()):
                break
        while len(path) < tree.max_depth + 1:
            path.append(current)
        return Verdict(
            path=torch.stack(path[: tree.max_depth + 1], dim=1), num_accepted=accepted, next_token=next_token
        )
