"""A reward-model ensemble's members combined into one reward (``ppo.reward_combine``), and their
disagreement. Pure tensor functions on [B, k] member scores (each member already normalised); no
torch import, so that the configuration validates names against ``COMBINE`` before torch loads.

- ``mean``: the members' mean (an ensemble as a better single reward model);
- ``lcb``: mean − λ·std over the members (``ppo.reward_lcb_coef`` = λ; uncertainty-weighted
  optimisation, Coste et al. 2023, "Reward Model Ensembles Help Mitigate Overoptimization");
- ``min``: the worst member (their worst-case optimisation);
- ``first``: the first member alone; the others only watch (a reward model optimised, others held
  out
  to see whether the policy is exploiting its errors: they count in the logged spread and mean).
"""

from __future__ import annotations


def disagreement(scores):
    """[B]: the members' standard deviation per row (population: 0 for one member)."""
    return scores.std(1, unbiased=False)


def _mean(scores, coef: float):
    return scores.mean(1)


def _lcb(scores, coef: float):
    return scores.mean(1) - coef * disagreement(scores)


def _min(scores, coef: float):
    return scores.min(1).values


def _first(scores, coef: float):
    return scores[:, 0]


COMBINE = {"mean": _mean, "lcb": _lcb, "min": _min, "first": _first}


def combine(scores, how: str, coef: float = 1.0):
    """[B, k] member scores → [B] reward by ``how`` (a key of ``COMBINE``)."""
    return COMBINE[how](scores, coef)
