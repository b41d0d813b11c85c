"""The token tree one verification step checks: a chain is the special case with one child per node.

Node 0 is the root: the last committed token, which the verifier has not processed yet. Every other node is a
drafted token whose parent precedes it in index order, so ancestors always have lower indices. Siblings are tried
in index order by the rejection rule. ``proposals`` holds, per node, the distribution its token was drawn from
(chain sampling); ``None`` means the tokens were chosen deterministically (top-k trees, greedy chains), which the
rejection rule treats as point-mass proposals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] verifier-vocabulary ids; column 0 is the root
    parents: torch.Tensor  # [B, N] parent index; -1 for the root
    depths: torch.Tensor  # [B, N] 0 for the root
    proposals: torch.Tensor | None = (
        None  # [B, N, V] proposal distribution of each node's token (row 0 unused)
    )

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def children(self) -> torch.Tensor:
        """``[B, N, K]`` child indices of every node in sibling (index) order, ``-1`` where there are fewer."""
        batch, n = self.parents.shape
        idx = torch.arange(n, device=self.parents.device)
        same_parent = (self.parents[:, :, None] == self.parents[:, None, :]) & (
            idx[None, None, :] < idx[None, :, None]
        )
        rank = same_parent.sum(-1)  # position among its siblings
        width = int(rank[:, 1:].max()) + 1 if n > 1 else 1
        children = torch.full((batch, n, width), -1, dtype=torch.long, device=self.parents.device)
        rows = torch.arange(batch, device=self.parents.device)[:, None].expand(batch, n - 1)
        children[rows, self.parents[:, 1:], rank[:, 1:]] = idx[1:].expand(batch, n - 1)
        return children

    def ancestor_mask(self) -> torch.Tensor:
        """``[B, N, N]`` bool: node i may attend to node j iff j is i or one of its ancestors (the tree mask)."""
        batch, n = self.parents.shape
        eye = torch.eye(n, dtype=torch.float32, device=self.parents.device).expand(batch, n, n)
        step = torch.zeros(batch, n, n, device=self.parents.device)
        b_idx, i_idx = (self.parents >= 0).nonzero(as_tuple=True)
        step[b_idx, i_idx, self.parents[b_idx, i_idx]] = 1.0  # step @ x gathers each node's parent row
        reach = eye.clone()
        for _ in range(self.max_depth):
            reach = torch.clamp(eye + step @ reach, max=1.0)
        return reach.bool()


def chain_tree(root: torch.Tensor, drafted: torch.Tensor, proposals: torch.Tensor | None = None) -> DraftTree:
    """A chain ``root → d1 → … → dk``; ``proposals`` is ``[B, k, V]`` when the drafts were sampled."""
    batch, k = drafted.shape
    device = drafted.device
    tokens = torch.cat([root[:, None], drafted], dim=1)
    parents = (torch.arange(k + 1, device=device) - 1).expand(batch, k + 1).clone()
    depths = torch.arange(k + 1, device=device).expand(batch, k + 1).clone()
    if proposals is not None:
        proposals = torch.cat([proposals.new_zeros(batch, 1, proposals.shape[-1]), proposals], dim=1)
    return DraftTree(tokens=tokens, parents=parents, depths=depths, proposals=proposals)
