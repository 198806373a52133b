"""Deterministic global batches: step → the same sample indices whatever the world size or the
accumulation, so 1 rank ≡ N ranks and batch B ≡ B/k × k accumulation (docs/architecture.md, habit
5)."""

from __future__ import annotations

import heapq
import random
from typing import Callable, Dict, List, Optional, Sequence

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
        return [
            self._perm(i // self.n)[i % self.n] for i in range(start, start + self.global_batch)
        ]

    def micro_batches(self, step: int, rank: int, world: int, micro: int) -> List[List[int]]:
        """This rank's micro-batches of the step's global batch (accumulation order)."""
        idx = self.global_indices(step)
        chunks = [idx[i : i + micro] for i in range(0, len(idx), micro)]
        return chunks[rank::world]

    def rank_rows(self, step: int, rank: int, world: int) -> List[int]:
        """This rank's share of the step's global batch: global_batch / world consecutive
        indices."""
        share = self.global_batch // world
        return self.global_indices(step)[rank * share : (rank + 1) * share]

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch / self.n


def step_micro_batches(
    batches: GlobalBatches, step: int, mesh, micro: int, max_tokens: int, tokens: Sequence[int]
) -> List[List[int]]:
    """This rank's micro-batches of step ``step``: ``micro`` rows each (``max_tokens=0``), or its
    rows grouped by ``token_micro_batches`` within ``max_tokens`` real tokens (``tokens[i]``: record
    i's, a pair's chosen + rejected), as many on every rank. ``mesh``: the process group as far as
    this needs it (``rank``, ``world_size``, ``max``; an ``rlhf.engine.mesh.Mesh``, which data does
    not import)."""
    if not max_tokens:
        return batches.micro_batches(step, mesh.rank, mesh.world_size, micro)
    rows = batches.rank_rows(step, mesh.rank, mesh.world_size)
    return token_micro_batches(rows, [tokens[i] for i in rows], max_tokens, mesh.max)


def bootstrap_weights(rows: Sequence[int], members: int, seed: int) -> List[List[float]]:
    """Each row's weight in each ensemble member's loss: 0 or 2 with equal odds (the
    double-or-nothing bootstrap: mean 1, variance 1, as Poisson(1)'s), drawn from the record's index
    alone, so that a member sees the same half of the data in every epoch, on any number of ranks
    and micro-batches."""
    out = []
    for i in rows:
        rng = random.Random(seeding.nested(seed, i, seeding.BOOTSTRAP))
        out.append([2.0 if rng.random() < 0.5 else 0.0 for _ in range(members)])
    return out


def micro_batching(micro: int, max_tokens: int, global_batch: int, world: int) -> str:
    """The micro-batching a stage uses, for its opening log line."""
    if max_tokens:
        return f"micro-batches of at most {max_tokens} tokens (as many on every rank)"
    return f"{micro} per micro-batch, {global_batch // (micro * world)} accumulation"


def token_micro_batches(
    rows: Sequence[int], lengths: Sequence[int], max_tokens: int, agree: Callable[[int], int]
) -> List[List[int]]:
    """``rows`` (``lengths[j]`` real tokens in ``rows[j]``) in micro-batches of at most
    ``max_tokens`` tokens (a row over the budget alone in one), as many on every rank: each rank's
    smallest count that fits, agreed by ``agree`` (the max over ranks, one collective; FSDP forwards
    are collective). Rows go longest first into the least-filled micro-batch, so that tokens spread
    evenly; each micro-batch keeps its rows in their order. Empty micro-batches only where a rank
    holds fewer rows than the agreed count."""
    lengths = list(lengths)
    over = sum(n > max_tokens for n in lengths)
    rest = sum(n for n in lengths if n <= max_tokens)
    own = max(over + -(-rest // max_tokens), 1)
    while _fill(lengths, own, max_tokens) is None:
        # at most len(rows): one row per micro-batch fits
        own += 1
    count = agree(own)
    bins = _fill(lengths, count, max_tokens)
    if bins is None:
        # longest-first over more micro-batches did not fit: split the fitting packing
        bins = _split(_fill(lengths, own, max_tokens), lengths, count)
    return [[rows[j] for j in sorted(b)] for b in bins]


def _fill(lengths: List[int], count: int, max_tokens: int) -> Optional[List[List[int]]]:
    """Positions of ``lengths`` longest first into the least-filled of ``count`` bins (ties: the
    first); None when a bin of more than one row exceeds ``max_tokens``."""
    heap = [(0, k) for k in range(count)]
    bins: List[List[int]] = [[] for _ in range(count)]
    for j in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        load, k = heapq.heappop(heap)
        if bins[k] and load + lengths[j] > max_tokens:
            return None
        bins[k].append(j)
        heapq.heappush(heap, (load + lengths[j], k))
    return bins


def _split(bins: List[List[int]], lengths: List[int], count: int) -> List[List[int]]:
    """``bins`` grown to ``count``: the shortest row of the fullest bin of several rows moves to a
    new bin (no bin grows, so the budget still holds); empty bins once every row is alone."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        multi = [b for b in bins if len(b) > 1]
        if not multi:
            bins.append([])
            continue
        fullest = max(multi, key=lambda b: sum(lengths[j] for j in b))
        fullest.sort(key=lambda j: (-lengths[j], j))
        bins.append([fullest.pop()])
    return bins
