"""Golden tests of the 2025–26 RL options: loss aggregation (and its invariance to how rows are
split over micro-batches and ranks), clip-higher, Dr.GRPO, dynamic sampling's group test, DAPO's
overlong penalty, rollout/training mismatch correction, and the settings that must be refused."""

import math

import pytest
import torch

from rlhf.algorithms import estimators as E
from rlhf.algorithms import ppo as A
from rlhf.config import AlgorithmConfig, Config, PPOConfig
from rlhf.errors import ConfigError

# two sequences: 3 and 1 response tokens; per-token losses
LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token_mean", (1 + 2 + 3 + 4) / 4),  # over the 4 tokens
        # each sequence's mean, then their mean
        ("seq_mean_token_mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),
        ("seq_mean_token_sum", ((1 + 2 + 3) + 4) / 2),  # each sequence's sum, then their mean
        ("token_sum_norm", (1 + 2 + 3 + 4) / (2 * 8)),  # Dr.GRPO: sum / (sequences × 8 tokens)
    ],
)
def test_loss_aggregation_golden(mode, expected):
    w = A.loss_weights(MASK, mode)
    denom = A.loss_denominator(mode, tokens=float(MASK.sum()), rows=2.0, norm_tokens=8)
    assert float((LOSS * w).sum() / denom) == pytest.approx(expected)


@pytest.mark.parametrize("mode", E.LOSS_AGG)
def test_loss_aggregation_does_not_depend_on_the_split(mode):
    """The update sums Σ w·ℓ / (denominator / W) over micro-batches on each of W ranks, and the
    ranks average their gradients: every split of the rows gives the loss (hence the gradient) of
    one pass."""
    g = torch.Generator(device="cpu").manual_seed(0)
    loss = torch.randn(12, 7, generator=g, device="cpu", requires_grad=True)
    lens = torch.randint(1, 8, (12,), generator=g, device="cpu")
    mask = (torch.arange(7, device="cpu")[None] < lens[:, None]).float()
    denom = A.loss_denominator(mode, float(mask.sum()), 12.0, 7)
    whole = (loss * A.loss_weights(mask, mode)).sum() / denom
    (grad_whole,) = torch.autograd.grad(whole, loss)
    for world, micro in ((1, 1), (1, 5), (2, 2), (3, 4)):
        total = 0.0
        for rank in range(world):
            rows = torch.arange(rank, 12, world, device="cpu")  # a rank's rows
            for part in rows.split(micro):  # its micro-batches
                total = total + (loss[part] * A.loss_weights(mask[part], mode)).sum() / (
                    denom / world
                )
        (grad,) = torch.autograd.grad(total / world, loss)  # data-parallel ranks average gradients
        assert torch.allclose(grad, grad_whole, atol=1e-7), (mode, world, micro)


def test_clip_higher_golden():
    # ratios 1.5, 0.5, 1.25 (old log-probs 0)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.25]]))
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    m = torch.ones(1, 3)
    sym, _ = A.policy_loss(logp, old, adv, m, clip=0.2, normalizer=1.0)
    # symmetric: −min(ρA, clip(ρ, 0.8, 1.2)A) = −1.2, +0.8, −1.2
    assert float(sym) == pytest.approx(-1.2 + 0.8 - 1.2)
    high, _ = A.policy_loss(logp, old, adv, m, clip=0.2, normalizer=1.0, clip_high=0.28)
    # clip-higher: upper bound 1.28 → −1.28, +0.8, −1.25
    assert float(high) == pytest.approx(-1.28 + 0.8 - 1.25)
    cfg = AlgorithmConfig(clip_ratio_high=0.28)
    assert cfg.clip_ratio_low is None  # the low side stays clip_ratio


def test_dr_grpo_and_zero_variance_groups():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    m = torch.ones(8, 2)
    dr = A.grpo_advantages(scores, 4, m, std_normalize=False)
    assert torch.allclose(dr[:4, 0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.equal(A.zero_variance_groups(scores, 4), torch.tensor([False, True]))
    alg = AlgorithmConfig(estimator="grpo", std_normalize=False)
    adv, _ = E.advantages(alg, scores, torch.zeros(8, 2), None, m, 4, 0.05)
    assert torch.equal(adv, dr)


def test_overlong_penalty_golden():
    # max 16 tokens, buffer 4: no penalty up to 12, then −(L − 12)/4 · 0.5, capped at −0.5
    lengths = torch.tensor([5, 12, 13, 14, 16])
    got = A.overlong_penalty(lengths, max_len=16, buffer=4, penalty=0.5)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))


def test_mismatch_correction_golden_and_a_noop_when_log_probs_agree():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    # ratios π_train/π_rollout: 1, 2, 5, 0.556
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.1, 0.9]]))
    m = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    tis = A.mismatch_weights(old, rollout, m, "tis", cap=3.0)
    assert torch.allclose(tis, torch.tensor([[1.0, 2.0, 3.0, 0.5 / 0.9]]))
    mis = A.mismatch_weights(old, rollout, m, "mis", cap=3.0)
    assert torch.equal(mis, torch.tensor([[1.0, 1.0, 0.0, 1.0]]))
    for mode in ("tis", "mis"):
        # fp32 rollouts: no change
        assert torch.equal(A.mismatch_weights(old, old, m, mode, cap=2.0), m)
    # the policy loss weighs each token's clipped surrogate by the correction
    logp = old.clone()
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    loss, _ = A.policy_loss(logp, old, adv, m, normalizer=4.0, weights=tis)
    assert float(loss) == pytest.approx(-(1.0 + 2.0 + 3.0 + 0.5 / 0.9) / 4)


def test_group_estimators_refuse_one_sample_per_prompt():
    for est in ("grpo", "rloo"):
        with pytest.raises(ConfigError, match=r"ppo.samples_per_prompt=1"):
            Config(
                stage="ppo",
                algorithm=AlgorithmConfig(estimator=est),
                ppo=PPOConfig(samples_per_prompt=1),
            )
    with pytest.raises(ConfigError, match=r"ppo.dynamic_sampling"):
        Config(stage="ppo", ppo=PPOConfig(dynamic_sampling=True))  # GAE has no groups
    with pytest.raises(ConfigError, match=r"algorithm.loss_agg"):
        AlgorithmConfig(loss_agg="mean")
    Config(stage="ppo", ppo=PPOConfig(samples_per_prompt=1))  # GAE needs no group


def test_kl_estimator_defaults():
    assert E.kl_kind(AlgorithmConfig(estimator="grpo")) == "k3"
    assert E.kl_kind(AlgorithmConfig(estimator="gae")) == "k1"
    assert E.kl_kind(AlgorithmConfig(estimator="grpo", kl_estimator="k1")) == "k1"
    assert not math.isnan(float(A.kl_penalty(torch.zeros(1), torch.zeros(1), "k3")))
