"""The RL estimators (``algorithm.estimator``) as one table: each row is an estimator's traits and
its advantage function. Everything that differs between estimators — whether the PPO stage builds a
critic, whether the baseline compares a prompt's samples, where the KL to the reference goes, which
KL estimator is the default — is read from its row; adding an estimator is one row, one function and
one test.

An advantage function takes the AlgorithmConfig and the step's ``Scored`` rows and returns
(advantages [B, N], value targets [B, N] or None).

The KL estimators (``algorithm.kl_estimator``) and loss aggregations (``algorithm.loss_agg``) are
tables here too. This module imports no torch (the tensor math is ``rlhf.algorithms.ppo``, imported
when an advantage is computed), so that ``rlhf.config``, which validates names against these
tables, stays quick to import: a bad command line fails before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

Tensor = "torch.Tensor"
AllReduce = Optional[Callable[[Tensor], Tensor]]


def _math():
    from rlhf.algorithms import ppo

    return ppo


@dataclass
class Scored:
    """What an advantage function reads: ``scores`` [B] per sequence, ``kl`` [B, N] per token
    (masked), ``values`` [B, N] (critic estimators; else None), ``mask`` [B, N], ``group_size`` a
    prompt's samples (consecutive rows), ``beta`` the KL coefficient, ``all_reduce`` the global sum
    for whitening (None in one process)."""

    scores: Tensor
    kl: Tensor
    values: Optional[Tensor]
    mask: Tensor
    group_size: int
    beta: float
    all_reduce: AllReduce = None
    # [B, N] rewards earned at a token, already in ``scores``: an environment's turn rewards at
    # their turns' last tokens (multi-turn episodes) and the distillation reward at every policy
    # token; None: none. Token-level estimators place them where they were earned.
    turn_rewards: Optional[Tensor] = None

    def token_rewards(self, clip: Optional[float]) -> Tensor:
        """Per-token rewards: −β·KL, the score at the last token — less the turn rewards, which sit
        at their own turns' last tokens."""
        m = _math()
        if self.turn_rewards is None:
            return m.token_rewards(self.scores, self.kl, self.mask, self.beta, clip)
        final = self.scores - self.turn_rewards.sum(1)
        return m.token_rewards(final, self.kl, self.mask, self.beta, clip) + self.turn_rewards


# (advantages [B, N], value targets [B, N] or None)
Advantages = Tuple[Tensor, Optional[Tensor]]


def _gae(alg, s: Scored) -> Advantages:
    """PPO: per-token rewards −β·KL plus the score at the last token, GAE over the critic's
    values."""
    m = _math()
    rewards = s.token_rewards(alg.reward_clip)
    adv, returns = m.gae(rewards, s.values, s.mask, alg.gamma, alg.lam)
    if alg.whiten_advantages:
        adv = m.whiten(adv, s.mask, all_reduce=s.all_reduce)
    return adv, returns


def _grpo(alg, s: Scored) -> Advantages:
    """GRPO: the score against its group's mean (and std); already normalised, so no batch
    whitening."""
    scores, clip = s.scores, alg.reward_clip
    if clip:
        scores = scores.clamp(-clip, clip)
    return _math().grpo_advantages(
        scores, s.group_size, s.mask, std_normalize=alg.std_normalize
    ), None


def _rloo(alg, s: Scored) -> Advantages:
    """RLOO: the KL-shaped score against the mean of the prompt's other samples."""
    m = _math()
    adv = m.rloo_advantages(s.scores - s.beta * s.kl.sum(1), s.group_size, s.mask)
    if alg.whiten_advantages:
        adv = m.whiten(adv, s.mask, all_reduce=s.all_reduce)
    return adv, None


def _reinforce_pp(alg, s: Scored) -> Advantages:
    """REINFORCE++: token-level KL-shaped returns, whitened over the global batch."""
    m = _math()
    rewards = s.token_rewards(alg.reward_clip)
    return m.whiten(
        m.discounted_returns(rewards, s.mask, alg.gamma), s.mask, all_reduce=s.all_reduce
    ), None


def _distill(alg, s: Scored) -> Advantages:
    """On-policy distillation (ppo.teacher_path): each token's advantage is its own reward — the
    teacher's −coef × reverse KL at that token (and an environment's turn reward at its turn's end)
    — undiscounted and with no baseline, a signal per token (Agarwal et al. 2024, Thinking Machines
    2025); the rest of the score (a rule, a reward model) against its prompt's mean (one sample per
    prompt: as it is) on every token. The KL to the reference is a loss term, as GRPO's."""
    m = _math()
    tokens = s.turn_rewards if s.turn_rewards is not None else s.mask * 0.0
    outcome = s.scores - tokens.sum(1)
    if s.group_size > 1:
        rest = m.grpo_advantages(outcome, s.group_size, s.mask, std_normalize=False)
    else:
        rest = outcome[:, None] * s.mask
    return (tokens + rest) * s.mask, None


@dataclass(frozen=True)
class Estimator:
    name: str
    # (AlgorithmConfig, Scored) -> Advantages
    advantages: Callable[[Any, Scored], Advantages]
    # learns a value function: the PPO stage builds and trains a critic
    critic: bool = False
    # its baseline compares a prompt's samples: ≥ 2 per prompt; dynamic sampling applies
    grouped: bool = False
    # the KL to the reference is a loss term (× β), not a per-token reward
    kl_in_loss: bool = False
    # the KL estimator when algorithm.kl_estimator is unset (rlhf.algorithms.ppo)
    kl_default: str = "k1"
    # learns from a teacher's per-token log-probs alone: ppo.teacher_path is required (with the
    # others it is optional: the per-token distillation reward reaches each as its turn rewards do —
    # at its token for gae and reinforce_pp, summed into the sequence score for grpo and rloo)
    needs_teacher: bool = False


ESTIMATORS: Dict[str, Estimator] = {
    e.name: e
    for e in (
        Estimator("gae", _gae, critic=True),
        # the KL as a loss term with the unbiased, non-negative k3 (as the GRPO paper)
        Estimator("grpo", _grpo, grouped=True, kl_in_loss=True, kl_default="k3"),
        Estimator("rloo", _rloo, grouped=True),
        Estimator("reinforce_pp", _reinforce_pp),
        Estimator("distill", _distill, kl_in_loss=True, kl_default="k3", needs_teacher=True),
    )
}


# KL(π || π_ref) per token from the log-ratio log π − log π_ref of the sampled tokens: k1 the
# log-ratio (unbiased, can be negative); k2 ½(log-ratio)²; k3 exp(−log-ratio) + log-ratio − 1
# (unbiased, ≥ 0; Schulman's approximation)
KL_ESTIMATORS: Dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda log_ratio: log_ratio,
    "k2": lambda log_ratio: 0.5 * log_ratio**2,
    "k3": lambda log_ratio: (-log_ratio).expm1() + log_ratio,
}

# how per-token policy losses become one number (rlhf.algorithms.ppo.loss_weights /
# loss_denominator)
LOSS_AGG = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")


def estimator(alg) -> Estimator:
    """The row of ``alg.estimator`` (an AlgorithmConfig, validated against this table)."""
    return ESTIMATORS[alg.estimator]


def kl_kind(alg) -> str:
    """``algorithm.kl_estimator``, or its estimator's default."""
    return alg.kl_estimator or estimator(alg).kl_default


def advantages(
    alg,
    scores: Tensor,
    kl: Tensor,
    values: Optional[Tensor],
    mask: Tensor,
    group_size: int,
    beta: float,
    all_reduce: AllReduce = None,
    turn_rewards: Optional[Tensor] = None,
) -> Advantages:
    """(advantages, value targets or None) of ``alg.estimator`` (the arguments: ``Scored``)."""
    scored = Scored(scores, kl, values, mask, group_size, beta, all_reduce, turn_rewards)
    return estimator(alg).advantages(alg, scored)
