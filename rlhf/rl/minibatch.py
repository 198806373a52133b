"""Which experience rows each rank updates on, so that N ranks update on exactly the minibatches
one process would, and each rank's share runs in micro-batches of a bounded number of rows (or of
real tokens); and the micro-batches of the scoring forwards (``row_groups``, ``in_micro_batches``).

Row layout (one helper, ``global_rows``): rank r holds prompts r, r+W, r+2W, … of the step's
global prompt list, each prompt's ``samples_per_prompt`` samples in consecutive rows.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from rlhf.data.sampler import token_micro_batches
from rlhf.engine.mesh import Mesh


def global_rows(rows: int, samples_per_prompt: int, rank: int, world: int) -> torch.Tensor:
    """Global index of each of this rank's ``rows`` experience rows."""
    j = torch.arange(rows, device="cpu")
    return ((j // samples_per_prompt) * world + rank) * samples_per_prompt + j % samples_per_prompt


def rank_of_row(global_ids: torch.Tensor, samples_per_prompt: int, world: int) -> torch.Tensor:
    """The rank that holds each global row (the inverse of ``global_rows``)."""
    return (global_ids // samples_per_prompt) % world


class Minibatch(NamedTuple):
    rows: torch.Tensor  # this rank's local row indices
    # 0.0: this rank holds no row of it and runs one stand-in row
    weight: float
    most: int  # the most rows any rank holds in it
    global_size: int  # rows over all ranks


def minibatches(
    global_ids: torch.Tensor,
    total_rows: int,
    count: int,
    samples_per_prompt: int,
    world: int,
    generator: torch.Generator,
) -> Iterator[Minibatch]:
    """This rank's share of each of ``count`` global minibatches of a seeded shuffle of all rows. A
    rank with no row in a minibatch gets one zero-weight row (the forwards are collective)."""
    perm = torch.randperm(total_rows, generator=generator, device="cpu")
    where = {int(gid): i for i, gid in enumerate(global_ids)}
    for chunk in perm.chunk(count):
        most = int(
            torch.bincount(rank_of_row(chunk, samples_per_prompt, world), minlength=world).max()
        )
        local = [where[int(x)] for x in chunk if int(x) in where]
        if local:
            yield Minibatch(torch.tensor(local, device="cpu"), 1.0, most, len(chunk))
        else:
            yield Minibatch(torch.tensor([0], device="cpu"), 0.0, most, len(chunk))


def live_rows(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows with a nonzero advantage on a token that carries loss, the only ones with
    a policy gradient (``ppo.update_rows=live`` leaves the others out)."""
    return (advantages * loss_mask != 0).any(1)


def micro_batches(
    rows: torch.Tensor,
    micro: int,
    most: int,
    tokens: Optional[Sequence[int]] = None,
    max_tokens: int = 0,
    mesh=None,
) -> List[torch.Tensor]:
    """``rows`` split into micro-batches of at most ``micro`` rows, as many on every rank (``most``:
    the largest share any rank holds, so the count is ceil(most / micro)); a rank that runs out
    repeats an empty selection, which the caller runs as a zero-weight row. With ``max_tokens``
    (ppo.max_tokens_per_micro_batch): grouped within that many real tokens (``tokens[i]``: local row
    i's) by ``token_micro_batches``, the count agreed over ``mesh``'s ranks (a collective)."""
    if max_tokens:
        ids = rows.tolist()
        groups = token_micro_batches(ids, [tokens[i] for i in ids], max_tokens, mesh.max)
        return [torch.tensor(g, dtype=rows.dtype, device=rows.device) for g in groups]
    count = max(1, -(-most // micro))
    parts = list(rows.split(micro))
    return parts + [rows[:0]] * (count - len(parts))


def auto_micro_batch(tokens: int, vocab: int, budget_bytes: int = 256 * 2**20) -> int:
    """Rows per micro-batch when ``ppo.micro_batch_per_rank=0``: as many as keep one micro-batch's
    fp32 logits (rows × tokens × vocab × 4 bytes) within ``budget_bytes`` — every row at once for a
    small vocabulary, a few rows for a 152k one."""
    return max(1, budget_bytes // max(tokens * vocab * 4, 1))


def micro_rows(engine, rows: int, tokens: int, micro: int) -> int:
    """Rows per forward: ``micro`` (ppo.micro_batch_per_rank) or, when 0, as many as keep a
    micro-batch's fp32 logits within budget for this model's vocabulary."""
    if micro:
        return micro
    vocab = getattr(engine.module.config, "vocab_size", 0) or 1
    return min(rows, auto_micro_batch(tokens, vocab))


# a micro-batch's rows: consecutive ones, or row indices
Rows = Union[slice, torch.Tensor]


def row_groups(att: torch.Tensor, micro: int, max_tokens: int, mesh: Mesh) -> List[Rows]:
    """The rows of the scoring forwards: consecutive slices of at most ``micro`` rows, or with
    ``max_tokens`` (ppo.max_tokens_per_micro_batch) the rows grouped within that many real tokens
    (``att``'s ones) by ``token_micro_batches``, as many groups on every rank (agreed: a
    collective)."""
    rows = att.shape[0]
    if not max_tokens:
        return [slice(s, s + micro) for s in range(0, rows, micro)]
    groups = token_micro_batches(list(range(rows)), att.sum(1).tolist(), max_tokens, mesh.max)
    return [torch.tensor(g, dtype=torch.long, device=att.device) for g in groups]


def in_micro_batches(fn: Callable[[Rows], torch.Tensor], groups: List[Rows]) -> torch.Tensor:
    """``fn(rows)`` over each of ``groups`` (``row_groups``), concatenated in row order (every rank
    has as many groups, hence the same number of collective forwards)."""
    outs = [fn(g) for g in groups]
    if all(isinstance(g, slice) for g in groups):
        return torch.cat(outs)
    order = torch.cat(groups)
    return torch.cat(outs)[torch.argsort(order)]


def subset_groups(
    rows: torch.Tensor, att: torch.Tensor, micro: int, max_tokens: int, mesh: Mesh
) -> List[Tuple[torch.Tensor, bool]]:
    """``row_groups`` over ``rows`` (some of this rank's row indices), as many groups on every rank
    (agreed: a collective): (rows, True), and for a rank short of groups (row 0, False), a stand-in
    whose forward runs (FSDP's are collective) and whose result ``in_subset`` drops."""
    if max_tokens:
        groups = token_micro_batches(rows.tolist(), att[rows].sum(1).tolist(), max_tokens, mesh.max)
    else:
        groups = [rows[i : i + micro].tolist() for i in range(0, len(rows), micro)]
        groups += [[]] * (mesh.max(len(groups)) - len(groups))
    return [(torch.tensor(g or [0], dtype=torch.long), bool(g)) for g in groups]


def in_subset(
    fn: Callable[[torch.Tensor], torch.Tensor],
    groups: List[Tuple[torch.Tensor, bool]],
    fill: torch.Tensor,
) -> torch.Tensor:
    """``fill`` with the rows of each real group of ``groups`` (``subset_groups``) replaced by
    ``fn(rows)``; the stand-ins run, their results dropped."""
    out = fill.clone()
    for rows, real in groups:
        got = fn(rows)
        if real:
            out[rows] = got
    return out
