"""Deterministic global batches: step → the same sample indices whatever the world size or the
accumulation, so 1 rank ≡ N ranks and batch B ≡ B/k × k accumulation (docs/architecture.md, habit 5)."""

from __future__ import annotations

import random
from typing import Dict, List

from rlhf import seeding


class GlobalBatches:
    def __init__(self, n: int, global_batch: int, seed: int):
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self._perms: Dict[int, List[int]] = {}

    def _perm(self, epoch: int) -> List[int]:
        if epoch not in self._perms:
            p = list(range(self.n))
            random.Random(seeding.nested(self.seed, epoch, seeding.EPOCH)).shuffle(p)
            self._perms = {epoch: p}  # keep one epoch in memory
        return self._perms[epoch]

    def global_indices(self, step: int) -> List[int]:
        start = step * self.global_batch
        return [self._perm(i // self.n)[i % self.n] for i in range(start, start + self.global_batch)]

    def micro_batches(self, step: int, rank: int, world: int, micro: int) -> List[List[int]]:
        """This rank's micro-batches of the step's global batch (accumulation order)."""
        idx = self.global_indices(step)
        chunks = [idx[i : i + micro] for i in range(0, len(idx), micro)]
        return chunks[rank::world]

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch / self.n
