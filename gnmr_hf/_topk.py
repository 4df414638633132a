"""Deterministic top-k of a 1-D key without a host sync (internal, not a public API).

The controller must pick the `k` units with the largest ranking key, ties to the lower index, every optimizer
step, without reading anything back to the host. `torch.topk` alone is not enough: among equal keys it returns
an arbitrary subset. A stable sort is exact (equal keys keep their index order) but costs ~13 ns per entry on
a CPU up to a few thousand entries and much more beyond, against ~0.1 ns per entry for a vectorized `amax`.

So, chosen once from (n, k) on the host:

- direct (small n): a stable descending `argsort` of the whole key; its first k entries are the answer.
- blocked (large n): view the key as B blocks of L entries (padded with -inf), take each block's max (one
  vectorized reduction), stable-sort the B maxima to find the k best blocks, and stable-sort just the k*L
  entries of those blocks (in index order). Exact: each of the k best entries (by key, then lower index) lies
  in one of the k best blocks (by max, then lower block), since every chosen block holds an entry better than
  the best entry of any block left out. With L ~ sqrt(n / k) both sorts are about sqrt(n * k) long.
"""

from __future__ import annotations

import math

import torch

__all__ = ["TopK"]

# Up to here a stable sort of the whole key is as cheap as the blocked path's extra ops.
_DIRECT_MAX_N = 2048


class TopK:
    """The k largest entries of a length-n key, largest first, ties to the lower index, with no host sync.

    `key` is a length-n view of a padded buffer that the caller writes the key into (with `out=` or in-place
    ops), so the blocked path needs no copy; the padding stays -inf. Force a path with `blocked` (tests).
    """

    def __init__(self, n: int, k: int, device: torch.device, blocked: bool | None = None) -> None:
        self.n = n
        self.k = min(k, n)
        # A block length that is a multiple of 16 keeps the per-block max vectorized (2x faster at 10^5).
        block = 16 * math.ceil(math.sqrt(n / self.k) / 16)
        num_blocks = math.ceil(n / block)
        possible = num_blocks >= self.k and self.k * block < n
        self.blocked = possible and (n > _DIRECT_MAX_N if blocked is None else blocked)
        if not self.blocked:
            block, num_blocks = n, 1
        self.block = block
        self.num_blocks = num_blocks
        self._buffer = torch.full((num_blocks * block,), -torch.inf, dtype=torch.float64, device=device)
        self.key = self._buffer[:n]
        # Global index of every buffer entry, gathered alongside the key so positions map back in one op.
        self._index = torch.arange(num_blocks * block, device=device).view(num_blocks, block)

    def indices(self) -> torch.Tensor:
        """Int64 [k]: where the k largest entries of `self.key` are, largest first, ties to the lower index."""
        if not self.blocked:
            return torch.argsort(self.key, descending=True, stable=True)[: self.k]
        blocks = self._buffer.view(self.num_blocks, self.block)
        best = torch.argsort(blocks.amax(dim=1), descending=True, stable=True)[: self.k]
        chosen = torch.sort(best).values  # index order, so the stable sort below breaks ties by index
        sub = blocks.index_select(0, chosen).view(-1)
        pos = torch.argsort(sub, descending=True, stable=True)[: self.k]
        return self._index.index_select(0, chosen).view(-1)[pos]

    def mask(self) -> torch.Tensor:
        """Bool [n]: True at the k largest entries of `self.key`."""
        out = torch.zeros(self.n, dtype=torch.bool, device=self._buffer.device)
        return out.index_fill_(0, self.indices(), True)
