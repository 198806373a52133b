"""PPO and critic-free estimators as pure tensor functions (no model, no distributed code).

Shapes: [B, N] over response tokens, ``mask`` 1 on real response tokens (EOS included).
References: Schulman et al. 2017 (PPO), 2016 (GAE); Ziegler et al. 2019 (per-token KL penalty,
adaptive β); DeepSpeed-Chat step 3 (reward at the last token, clipped value loss); Huang et al.
2024 "The N implementation details of RLHF with PPO"; Shao et al. 2024 (GRPO); Ahmadian et al. 2024
(RLOO); Hu 2025 (REINFORCE++).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from rlhf.algorithms.estimators import KL_ESTIMATORS
from rlhf.algorithms.tokens import last_index

Tensor = torch.Tensor


def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def whiten(
    x: Tensor,
    mask: Tensor,
    eps: float = 1e-8,
    all_reduce: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tensor:
    """(x − mean) / std over the masked entries of the whole global batch: ``all_reduce`` sums a
    float64 tensor over data-parallel ranks (None = this batch alone), so N ranks ≡ 1 process."""
    mean, var = global_moments(x, mask, all_reduce)
    return ((x - mean.float()) * torch.rsqrt(var.float() + eps)) * mask


def global_moments(
    x: Tensor, mask: Tensor, all_reduce: Optional[Callable[[Tensor], Tensor]] = None
) -> Tuple[Tensor, Tensor]:
    """Mean and variance (float64, two passes) of the masked entries of ``x`` over every rank
    (``all_reduce`` as ``whiten``'s; None = this batch alone)."""
    reduce = all_reduce or (lambda t: t)
    s = reduce(
        torch.tensor(
            [float((x * mask).sum()), float(mask.sum())], dtype=torch.float64, device=x.device
        )
    )
    mean = s[0] / s[1].clamp(min=1)
    v = reduce(
        torch.tensor(
            [float((((x - mean) ** 2) * mask).sum())], dtype=torch.float64, device=x.device
        )
    )
    return mean, v[0] / s[1].clamp(min=1)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k1") -> Tensor:
    """Per-token KL(π || π_ref) by estimator ``kind`` (a key of
    ``rlhf.algorithms.estimators.KL_ESTIMATORS``)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind}")
    return KL_ESTIMATORS[kind](logp - ref_logp)


def token_rewards(
    scores: Tensor, kl: Tensor, mask: Tensor, beta: float, clip: Optional[float] = None
) -> Tensor:
    """Per-token reward −β·KL_t, plus the (clipped) sequence score at the last response token
    (DeepSpeed-Chat's compute_rewards)."""
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    rewards = -beta * kl * mask
    idx = last_index(mask)
    return rewards.scatter_add(1, idx[:, None], scores[:, None].to(rewards.dtype))


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> Tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the tokens of ``mask``. δ_t = r_t + γ V_{t'} − V_t,
    with t' the next token of the mask (V = 0 after the last); A_t = δ_t + γλ A_{t'}. Positions
    outside the mask (an observation between two turns) are skipped, not ends: the recursion runs
    through them. Returns (advantages, returns = A + V), zero outside ``mask``."""
    values = values * mask
    rewards = rewards * mask
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    next_v = torch.zeros_like(last)
    on = mask > 0
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        step = (delta + gamma * lam * last) * mask[:, t]
        last = torch.where(on[:, t], step, last)
        next_v = torch.where(on[:, t], values[:, t], next_v)
        adv[:, t] = step
    return adv, (adv + values) * mask


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = Σ_{k≥t} γ^{k−t} r_k over the tokens of ``mask`` (REINFORCE++'s token-level return);
    positions outside it are skipped, as in ``gae``."""
    out = torch.zeros_like(rewards)
    run = torch.zeros_like(rewards[:, 0])
    on = mask > 0
    for t in reversed(range(rewards.shape[1])):
        step = (rewards[:, t] + gamma * run) * mask[:, t]
        run = torch.where(on[:, t], step, run)
        out[:, t] = step
    return out


def by_prompt(scores: Tensor, group_size: int) -> Tensor:
    """[rows] → [prompts, group_size]: a group is one prompt's samples, in consecutive rows
    (``rlhf.ops.sampling.prompt_major``; ``group_size`` is ``ppo.samples_per_prompt``)."""
    return scores.view(-1, group_size)


def grpo_advantages(
    scores: Tensor, group_size: int, mask: Tensor, eps: float = 1e-6, std_normalize: bool = True
) -> Tensor:
    """GRPO outcome advantages: (r − mean_group) / (std_group + eps), the same on every token;
    ``std_normalize=False`` is Dr.GRPO's r − mean_group (Liu et al. 2025: the std division weights
    easy and hard prompts unequally). A group whose samples all scored alike gets exactly 0 (its
    mean's rounding, e.g. of three 0.1s, is no signal)."""
    g = by_prompt(scores, group_size)
    adv = g - g.mean(1, keepdim=True)
    if std_normalize:
        adv = adv / (g.std(1, keepdim=True, unbiased=True) + eps)
    adv = torch.where(zero_variance_groups(scores, group_size)[:, None], 0.0, adv)
    return adv.reshape(-1, 1) * mask


def zero_variance_groups(scores: Tensor, group_size: int) -> Tensor:
    """[prompts] True where every sample of a prompt scored alike (no signal for a group estimator:
    DAPO's dynamic sampling drops them)."""
    g = by_prompt(scores, group_size)
    return (g == g[:, :1]).all(1)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment: 0 up to max_len − buffer tokens, then falling linearly to
    −penalty at max_len (Yu et al. 2025, eq. 13)."""
    start = max_len - buffer
    return -penalty * ((lengths.float() - start) / max(buffer, 1)).clamp(min=0.0, max=1.0)


# ---- loss aggregation (algorithm.loss_agg, names in rlhf.algorithms.estimators.LOSS_AGG) ----


def loss_weights(mask: Tensor, mode: str) -> Tensor:
    """Per-token weights w such that the loss is Σ w·ℓ over the global minibatch /
    ``loss_denominator``: token_mean and the sum modes weight every token 1; seq_mean_token_mean
    weights a token 1/|its response| (each sequence's mean, then the mean over sequences). A row's
    weights depend on that row only, so any split of the rows over micro-batches and ranks sums to
    the same loss."""
    if mode == "seq_mean_token_mean":
        return mask / mask.sum(1, keepdim=True).clamp(min=1)
    return mask


def loss_denominator(mode: str, tokens: float, rows: float, norm_tokens: int) -> float:
    """The global constant the weighted sum is divided by: the minibatch's tokens (token_mean), its
    sequences (seq_mean_*), or sequences × a fixed token count (Dr.GRPO's token_sum_norm)."""
    if mode == "token_mean":
        return tokens
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
        return rows
    if mode == "token_sum_norm":
        return rows * norm_tokens
    raise ValueError(f"unknown loss aggregation {mode}")


def mismatch_weights(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str, cap: float
) -> Tensor:
    """Per-token correction for rollouts sampled by an inference engine whose log-probs differ from
    the training recompute (π_train / π_rollout = ρ): ``tis`` truncated importance weight min(ρ, C)
    (Yao et al. 2025); ``mis`` masks tokens with ρ outside [1/C, C]; ``none`` ones. Detached."""
    if mode == "none":
        return torch.ones_like(mask)
    ratio = torch.exp((old_logp - rollout_logp).detach())
    if mode == "tis":
        return ratio.clamp(max=cap) * mask
    if mode == "mis":
        return ((ratio >= 1.0 / cap) & (ratio <= cap)).to(mask.dtype) * mask
    raise ValueError(f"unknown mismatch correction {mode}")


def rloo_advantages(scores: Tensor, group_size: int, mask: Tensor) -> Tensor:
    """RLOO: r_i − mean of the other k−1 samples of the same prompt, on every token."""
    g = by_prompt(scores, group_size)
    baseline = (g.sum(1, keepdim=True) - g) / max(group_size - 1, 1)
    return (g - baseline).reshape(-1, 1) * mask


def _reduce(loss: Tensor, mask: Tensor, normalizer: Optional[float]) -> Tensor:
    """Masked mean, or the masked sum over ``normalizer`` (e.g. the global token count / world size,
    so that data-parallel ranks reproduce one process)."""
    return masked_mean(loss, mask) if normalizer is None else (loss * mask).sum() / normalizer


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    clip: float = 0.2,
    dual_clip: Optional[float] = None,
    normalizer: Optional[float] = None,
    clip_high: Optional[float] = None,
    weights: Optional[Tensor] = None,
) -> Tuple[Tensor, dict]:
    """Clipped surrogate −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) (ε_high = ``clip_high``, default ε:
    DAPO's clip-higher when larger); with dual-clip (Ye et al. 2020) the loss of a negative
    advantage is capped at −c·A. ``weights`` [B, N]: per-token weights of the reduction (loss
    aggregation, mismatch correction; default ``mask``). Returns (loss, stats over ``mask``)."""
    if clip_high is None:
        clip_high = clip
    if weights is None:
        weights = mask
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip, 1.0 + clip_high)
    loss = torch.max(loss1, loss2)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.min(loss, -adv * dual_clip), loss)
    with torch.no_grad():
        m = mask.to(loss.dtype)
        clipped, akl, count = (
            ((loss2 > loss1).float() * m).sum(),
            (0.5 * log_ratio**2 * m).sum(),
            m.sum(),
        )
        # means over this call's tokens, and the sums behind them (to average over micro-batches)
        stats = {
            "clipfrac": clipped / count.clamp(min=1),
            "approx_kl": akl / count.clamp(min=1),
            "sums": torch.stack([clipped, akl, count]),
        }
    return _reduce(loss, weights, normalizer), stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: Optional[float] = 0.2,
    normalizer: Optional[float] = None,
) -> Tensor:
    """½·max((V − R)², (clip(V, V_old ± ε) − R)²) (DeepSpeed-Chat's critic_loss_fn)."""
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.max(loss, (clipped - returns) ** 2)
    return 0.5 * _reduce(loss, mask, normalizer)


def entropy_from_logits(logits: Tensor) -> Tensor:
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


def explained_variance(
    values: Tensor,
    returns: Tensor,
    mask: Tensor,
    all_reduce: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tensor:
    """1 − Var(returns − values) / Var(returns) over the masked tokens of every rank
    (``global_moments``)."""
    var_r = global_moments(returns, mask, all_reduce)[1]
    return 1.0 - global_moments(returns - values, mask, all_reduce)[1] / var_r.clamp(min=1e-8)


class AdaptiveKL:
    """Ziegler et al. 2019: β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon). Fixed when target is
    None."""

    def __init__(self, beta: float, target: Optional[float] = None, horizon: int = 10000):
        self.beta, self.target, self.horizon = beta, target, horizon

    def update(self, kl: float, n_steps: int) -> None:
        if self.target is None:
            return
        err = max(min(kl / self.target - 1.0, 0.2), -0.2)
        self.beta *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"beta": self.beta, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, s: dict) -> None:
        self.beta, self.target, self.horizon = s["beta"], s["target"], s["horizon"]


class RunningMoments:
    """Running mean/std (Chan et al. parallel update) for reward normalisation."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def update(self, x: Tensor) -> None:
        n = x.numel()
        if n == 0:
            return
        m, v = float(x.mean()), float(x.var(unbiased=False))
        delta, total = m - self.mean, self.count + n
        self.mean += delta * n / total
        self.var = (self.var * self.count + v * n + delta**2 * self.count * n / total) / total
        self.count = total

    @property
    def std(self) -> float:
        return max(self.var, 1e-12) ** 0.5

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, s: dict) -> None:
        self.mean, self.var, self.count = s["mean"], s["var"], s["count"]
