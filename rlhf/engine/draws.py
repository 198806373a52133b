"""Sampling draws keyed per sample: what makes rollouts the same on any number of ranks.

Each row of a generation draws its uniforms (one per response column) from a CPU stream of its own,
seeded by the call's seed and the row's key; a row's key is its place in the call's global list of
samples (``row_keys`` of the prompts' keys; a rank's prompts are keyed by ``strided_keys`` under
``PromptSource``'s layout, or by the caller: the gold evaluation keys them by the example's index).
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from rlhf import seeding


def strided_keys(n: int, rank: int, world: int) -> List[int]:
    """The keys of a rank's ``n`` prompts when rank r holds prompts r, r+W, r+2W, … of a call's
    global list (``PromptSource``'s layout): their places in that list."""
    return [i * world + rank for i in range(n)]


def row_keys(prompt_keys: Sequence[int], samples_per_prompt: int) -> List[int]:
    """Each row's key in ``prompt_major`` order: sample ``s`` of the prompt keyed ``k`` is row
    ``k·samples + s``."""
    return [k * samples_per_prompt + s for k in prompt_keys for s in range(samples_per_prompt)]


def row_draws(keys: Sequence[int], n: int, seed: int, device) -> torch.Tensor:
    """[len(keys), n] uniform draws in [0, 1): row ``i``'s ``n`` draws (one per response column)
    from its own stream, seeded ``seeding.offset(seed, keys[i], seeding.SAMPLE)``. A row's draws
    depend on the seed and its key only — not on the rows beside it, its rank, its batch or which
    rows have ended: a sample keyed by its place in the step's global prompt list is the same on any
    number of ranks. Drawn on the CPU (the same numbers on every device), then moved to
    ``device``."""
    gen = torch.Generator(device="cpu")
    out = torch.empty((len(keys), n), dtype=torch.float32, device="cpu")
    for i, key in enumerate(keys):
        gen.manual_seed(seeding.offset(seed, int(key), seeding.SAMPLE))
        torch.rand((n,), generator=gen, device="cpu", out=out[i])
    return out.to(device)
