"""Golden tests of the RL math: closed forms, DeepSpeed-Chat's formulas on fixed tensors,
loop-vs-vectorised equivalence, masking."""

import math

import pytest
import torch

from rlhf.algorithms import ppo as A


def test_gae_closed_forms():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3)
    adv, ret = A.gae(r, v, m, gamma=1.0, lam=1.0)  # Monte-Carlo: A_t = Σ r − V_t
    assert torch.allclose(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    assert torch.allclose(ret, torch.ones(1, 3))
    adv, _ = A.gae(r, v, m, gamma=1.0, lam=0.0)  # one-step TD: δ_t
    assert torch.allclose(adv, torch.tensor([[0.1, 0.1, 0.3]]))
    adv, _ = A.gae(r, v, m, gamma=0.9, lam=0.5)
    d = [0 + 0.9 * 0.6 - 0.5, 0 + 0.9 * 0.7 - 0.6, 1 - 0.7]
    a2 = d[2]
    a1 = d[1] + 0.45 * a2
    a0 = d[0] + 0.45 * a1
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]]), atol=1e-6)


def gae_reference(rewards, values, mask, gamma, lam):
    """Scalar double loop, as in the papers."""
    B, N = rewards.shape
    adv = torch.zeros(B, N)
    for b in range(B):
        n = int(mask[b].sum())
        last = 0.0
        for t in reversed(range(n)):
            nv = float(values[b, t + 1]) if t + 1 < n else 0.0
            delta = float(rewards[b, t]) + gamma * nv - float(values[b, t])
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv


def test_gae_vectorised_equals_loop_and_ignores_padding():
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(5, 9, generator=g), torch.randn(5, 9, generator=g)
    lens = torch.tensor([9, 1, 4, 7, 3])
    m = (torch.arange(9)[None] < lens[:, None]).float()
    adv, ret = A.gae(r, v, m, 0.99, 0.95)
    assert torch.allclose(adv, gae_reference(r, v, m, 0.99, 0.95), atol=1e-5)
    r2, v2 = r.clone(), v.clone()
    # garbage beyond the response changes nothing
    r2[m == 0], v2[m == 0] = 123.0, -77.0
    adv2, ret2 = A.gae(r2, v2, m, 0.99, 0.95)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_deepspeed_chat_reward_formula():
    """DeepSpeed-Chat compute_rewards: −β(log π − log π_ref), clipped score added at the last
    token."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.4, -9.0, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -2.0], [-0.1, -0.9, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).float()
    score = torch.tensor([7.0, -0.3])
    beta, clip = 0.1, 5.0
    expected = -beta * (logp - ref) * mask
    expected[0, 3] += 5.0
    expected[1, 1] += -0.3
    got = A.token_rewards(score, A.kl_penalty(logp, ref, "k1"), mask, beta, clip)
    assert torch.allclose(got, expected)


def test_deepspeed_chat_actor_and_critic_losses():
    g = torch.Generator().manual_seed(1)
    logp, old = torch.randn(3, 5, generator=g) * 0.3, torch.randn(3, 5, generator=g) * 0.3
    adv = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]).float()
    ratio = torch.exp((logp - old) * mask)
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    expected = (pg * mask).sum() / mask.sum()
    loss, stats = A.policy_loss(logp, old, adv, mask, clip=0.2)
    assert torch.allclose(loss, expected, atol=1e-6)
    assert 0.0 <= stats["clipfrac"] <= 1.0
    values, old_v, ret = (
        torch.randn(3, 5, generator=g),
        torch.randn(3, 5, generator=g),
        torch.randn(3, 5, generator=g),
    )
    clipped = values.clamp(old_v - 0.2, old_v + 0.2)
    expected = (
        0.5 * (torch.max((values - ret) ** 2, (clipped - ret) ** 2) * mask).sum() / mask.sum()
    )
    assert torch.allclose(A.value_loss(values, old_v, ret, mask, clip=0.2), expected, atol=1e-6)


def test_dual_clip_caps_negative_advantage_loss():
    logp, old = torch.tensor([[2.0]]), torch.tensor([[0.0]])  # ratio e² ≈ 7.4
    adv, m = torch.tensor([[-1.0]]), torch.ones(1, 1)
    plain, _ = A.policy_loss(logp, old, adv, m, clip=0.2)
    capped, _ = A.policy_loss(logp, old, adv, m, clip=0.2, dual_clip=3.0)
    assert plain.item() == pytest.approx(math.exp(2.0)) and capped.item() == pytest.approx(3.0)


def test_kl_estimators():
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(50, generator=g), 0)
    q = torch.softmax(torch.randn(50, generator=g), 0)
    true_kl = (p * (p.log() - q.log())).sum()
    x = torch.multinomial(p, 200000, replacement=True, generator=g)
    for kind in ("k1", "k3"):
        est = A.kl_penalty(p.log()[x], q.log()[x], kind).mean()
        assert abs(est - true_kl) < 0.02, (kind, est, true_kl)
    assert (A.kl_penalty(p.log()[x], q.log()[x], "k3") >= 0).all()


def test_critic_free_estimators():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    m = torch.ones(8, 2)
    grpo = A.grpo_advantages(scores, 4, m)
    s = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    assert torch.allclose(grpo[:4, 0], (torch.tensor([1.0, 0, 0, 1]) - 0.5) / (s + 1e-6))
    # no signal when every sample scores alike, exactly, also where the mean rounds (0.1 × 3)
    assert torch.allclose(grpo[4:], torch.zeros(4, 2))
    tied = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.1, 0.2], dtype=torch.float64)
    assert tied[:3].mean() != tied[0]  # (the rounding)
    for std in (True, False):
        adv = A.grpo_advantages(tied, 3, torch.ones(6, 2, dtype=torch.float64), std_normalize=std)
        assert bool((adv[:3] == 0).all()) and bool((adv[3:] != 0).all())
    rloo = A.rloo_advantages(scores, 4, m)
    assert torch.allclose(rloo[:4, 0], torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))
    ret = A.discounted_returns(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert torch.equal(ret, torch.tensor([[3.0, 2.0, 0.0]]))


def test_whiten_and_adaptive_kl_and_running_moments():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = A.whiten(x, m)
    assert abs(A.masked_mean(w, m).item()) < 1e-6 and w[0, 3] == 0
    assert A.masked_mean(w * w, m).item() == pytest.approx(1.0, rel=1e-5)
    # with an all_reduce, the statistics are those of every rank's rows together
    halves = [(x[:, :2], m[:, :2]), (x[:, 2:], m[:, 2:])]
    sums = [
        torch.tensor([float((a * b).sum()), float(b.sum())], dtype=torch.float64) for a, b in halves
    ]
    calls = []

    def fake_all_reduce(t):
        # the other "rank" contributes its part of the same statistic
        calls.append(t.clone())
        other = (
            sums[1]
            if len(calls) == 1
            else torch.tensor(
                [float((((halves[1][0] - 2.0) ** 2) * halves[1][1]).sum())], dtype=torch.float64
            )
        )
        return t + other

    part = A.whiten(halves[0][0], halves[0][1], all_reduce=fake_all_reduce)
    assert torch.allclose(part, w[:, :2], atol=1e-6)
    kl = A.AdaptiveKL(0.1, target=6.0, horizon=100)
    kl.update(12.0, 10)
    assert kl.beta == pytest.approx(0.1 * 1.02)
    fixed = A.AdaptiveKL(0.1)
    fixed.update(100.0, 10)
    assert fixed.beta == 0.1
    rm = A.RunningMoments()
    data = torch.randn(1000) * 3 + 2
    for chunk in data.split(100):
        rm.update(chunk)
    assert rm.mean == pytest.approx(data.mean().item(), abs=1e-3)
    assert rm.std == pytest.approx(data.std(unbiased=False).item(), rel=1e-3)
