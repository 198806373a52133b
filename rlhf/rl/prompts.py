"""Where PPO's prompts come from: one owner of the step's prompts and of dynamic sampling's refills.

Step ``i`` takes global batch ``i`` of a seeded order of the prompts (``GlobalBatches``: the same
prompts whatever the world size), this rank's share being every ``world``-th prompt of it. DAPO's
dynamic sampling asks for more prompts in extra rounds; those come from a second seeded order, so
that a refill never changes which prompts later steps see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from rlhf.data.records import Example
from rlhf.data.sampler import GlobalBatches
from rlhf.engine.mesh import Mesh


@dataclass
class PromptBatch:
    """This rank's prompts of one generation: token ids and the records they came from."""

    ids: List[List[int]]
    examples: List[Example]


class PromptSource:
    def __init__(
        self,
        ids: List[List[int]],
        examples: List[Example],
        per_step: int,
        seed: int,
        mesh: Mesh,
        max_rounds: int,
    ):
        self.ids, self.examples, self.mesh, self.max_rounds = ids, examples, mesh, max_rounds
        self.batches = GlobalBatches(len(ids), per_step, seed)
        self.refills = GlobalBatches(len(ids), per_step, seed + 1)

    def __len__(self) -> int:
        return len(self.ids)

    def step(self, step: int) -> PromptBatch:
        """This rank's prompts of step ``step``."""
        return self._take(self.batches.global_indices(step))

    def refill(self, step: int, round_: int) -> PromptBatch:
        """This rank's prompts of dynamic sampling's extra round ``round_`` (1, 2, …) of step
        ``step``."""
        return self._take(self.refills.global_indices(step * self.max_rounds + round_ - 1))

    def _take(self, global_indices) -> PromptBatch:
        ix = global_indices[self.mesh.rank :: self.mesh.world_size]
        return PromptBatch([self.ids[i] for i in ix], [self.examples[i] for i in ix])
