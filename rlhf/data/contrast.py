"""Contrast pairs for a reward model (``reward.contrast``): pairs whose loser is no answer to the
prompt at all.

A reward model trained on a few hundred human pairs learns what tells those pairs apart, and has
never been shown what PPO finds first: an answer that says nothing, an answer to another question.
On HH's harmless split a SmolLM2 reward model of 0.605 held-out accuracy pays more for an empty
answer (2.02) than for the SFT model's answers (0.9-1.1; docs/recipes.md, ``smollm2_hh``). The
remedy of RRM (Liu et al. 2024, "RRM: Robust Reward Model Training Mitigates Reward Hacking") is
data: pairs in which any response to the prompt beats a response to another prompt, which carries no
preference the human pairs could teach (its length, its style are another dialogue's), so the model
must look at whether the answer answers. The kinds:

- ``other``: the prompt with its chosen response beats the prompt with another pair's response (that
  pair's chosen or rejected one, by a seeded draw);
- ``empty``: the prompt with its chosen response beats the prompt with EOS alone.

Pairs are built on token columns (``tokenize_pairs``' ``chosen``, ``rejected``, ``prompt_len``),
drawn from ``run.seed`` alone: every rank builds the same ones.
"""

from __future__ import annotations

import random
from typing import Dict, List, Sequence

from rlhf import seeding

KINDS = ("other", "empty")
# draws of another prompt's response before a pair is left without one
TRIES = 8


def _responses(cols: dict, side: str) -> List[List[int]]:
    return [seq[p:] for seq, p in zip(cols[side], cols["prompt_len"])]


def _other_response(cols: dict, responses: dict, i: int, prompt: List[int], rng: random.Random):
    """A response of another prompt than pair ``i``'s (a pair with the same prompt, which data with
    several pairs a prompt has, answers the same question: drawn again, ``TRIES`` times at most;
    None if every draw was)."""
    n = len(cols["chosen"])
    for _ in range(TRIES):
        j = rng.randrange(n - 1)
        j += j >= i
        side = "chosen" if rng.random() < 0.5 else "rejected"
        if cols["chosen"][j][: cols["prompt_len"][j]] != prompt:
            return responses[side][j]
    return None


def _pairs(cols: dict, kind: str, rows: Sequence[int], rng: random.Random, eos: int) -> dict:
    """The contrast pairs of ``kind`` for ``rows`` (a pair whose two sides are equal is left out:
    it teaches nothing)."""
    responses = {side: _responses(cols, side) for side in ("chosen", "rejected")}
    out: Dict[str, list] = {"chosen": [], "rejected": [], "prompt_len": []}
    for i in rows:
        p = cols["prompt_len"][i]
        prompt = cols["chosen"][i][:p]
        if kind == "other":
            loser = _other_response(cols, responses, i, prompt, rng)
        else:
            loser = [eos]
        if loser is None or loser == responses["chosen"][i]:
            continue
        out["chosen"].append(cols["chosen"][i])
        out["rejected"].append(prompt + loser)
        out["prompt_len"].append(p)
    return out


def with_contrast(cols: dict, kinds: Sequence[str], share: float, seed: int, eos: int) -> dict:
    """``cols`` (training pairs) with ``round(share × n)`` contrast pairs of each kind appended,
    their rows a seeded sample of the pairs (distinct within a kind). ``cols`` itself is left as it
    was (it may be the tokenization cache's)."""
    n = len(cols["chosen"])
    out = {key: list(cols[key]) for key in ("chosen", "rejected", "prompt_len")}
    if n < 2:
        return out
    for kind in kinds:
        rng = random.Random(seeding.offset(seed, KINDS.index(kind) + 1, seeding.CONTRAST))
        rows = sorted(rng.sample(range(n), min(n, max(1, round(share * n)))))
        extra = _pairs(cols, kind, rows, rng, eos)
        for key in out:
            out[key].extend(extra[key])
    return out


def held_out(cols: dict, kinds: Sequence[str], seed: int, eos: int) -> Dict[str, dict]:
    """Each kind's contrast pairs over every held-out pair: what ``eval/contrast_<kind>_accuracy``
    scores (a reward model that ranks every answer above an empty one or another prompt's scores
    1.0); a kind with no pair left out."""
    out = {}
    n = len(cols["chosen"])
    for kind in kinds:
        if n < 2:
            continue
        rng = random.Random(seeding.offset(seed, KINDS.index(kind) + 1, seeding.CONTRAST_EVAL))
        pairs = _pairs(cols, kind, range(n), rng, eos)
        if pairs["chosen"]:  # (none left: nothing to score)
            out[kind] = pairs
    return out


def describe(kinds: Sequence[str], share: float) -> str:
    """The contrast pairs a run adds, for its opening line and its fingerprint ('' for none)."""
    if not kinds:
        return ""
    return f"contrast pairs {'+'.join(kinds)} at {share:g} each"
