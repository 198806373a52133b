"""The RL estimators are one table (rlhf/algorithms/estimators.py): adding one is a row and its
advantage function, and everything that differs per estimator — the config's checks, the models
the PPO stage builds, the default KL estimator, where the KL goes, the advantages — follows."""

import pytest
import torch

from rlhf.algorithms import estimators as E
from rlhf.config import AlgorithmConfig, Config, PPOConfig
from rlhf.errors import ConfigError


def mean_baseline(alg, s):
    """A toy estimator: the score against the batch mean, on every token."""
    return (s.scores - s.scores.mean()).reshape(-1, 1) * s.mask, None


@pytest.fixture
def toy(monkeypatch):
    row = E.Estimator("toy", mean_baseline, grouped=True, kl_in_loss=True, kl_default="k2")
    monkeypatch.setitem(E.ESTIMATORS, "toy", row)
    return row


def test_a_new_estimator_is_one_row_and_one_function(toy):
    alg = AlgorithmConfig(estimator="toy")  # validated against the table
    assert E.estimator(alg) is toy and E.kl_kind(alg) == "k2"
    assert E.kl_kind(AlgorithmConfig(estimator="toy", kl_estimator="k1")) == "k1"
    scores, mask = torch.tensor([1.0, 3.0]), torch.ones(2, 3)
    adv, returns = E.advantages(alg, scores, torch.zeros(2, 3), None, mask, 2, 0.1)
    assert torch.equal(adv, torch.tensor([[-1.0] * 3, [1.0] * 3])) and returns is None
    # the stage builds no critic for it (critic=False), and its grouped baseline brings the group
    # checks
    cfg = Config(
        stage="ppo", algorithm=alg, ppo=PPOConfig(samples_per_prompt=2, dynamic_sampling=True)
    )
    assert cfg.roles() == ("actor", "reference", "reward_model")
    with pytest.raises(
        ConfigError, match=r"samples_per_prompt=1 is invalid for algorithm.estimator=toy"
    ):
        Config(stage="ppo", algorithm=alg, ppo=PPOConfig(samples_per_prompt=1))
    # messages list it with the others
    with pytest.raises(ConfigError, match="expected gae, grpo, rloo, reinforce_pp, distill or toy"):
        AlgorithmConfig(estimator="nope")


def test_the_table_holds_each_estimators_traits():
    traits = {
        n: (e.critic, e.grouped, e.kl_in_loss, e.kl_default, e.needs_teacher)
        for n, e in E.ESTIMATORS.items()
    }
    assert traits == {
        "gae": (True, False, False, "k1", False),
        "grpo": (False, True, True, "k3", False),
        "rloo": (False, True, False, "k1", False),
        "reinforce_pp": (False, False, False, "k1", False),
        "distill": (False, False, True, "k3", True),
    }
    with pytest.raises(
        ConfigError, match=r"needs a group estimator \(algorithm.estimator=grpo or rloo\), not gae"
    ):
        Config(stage="ppo", ppo=PPOConfig(dynamic_sampling=True))


def test_the_tables_do_not_import_torch():
    """rlhf.config validates against them: a bad command line fails before torch loads."""
    import subprocess
    import sys

    code = "import sys, rlhf.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_distillation_gives_each_token_its_own_reward_and_the_rest_of_the_score_a_group_baseline():
    alg = AlgorithmConfig(estimator="distill")
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    tokens = torch.tensor(
        [[-0.5, -0.1, 0.0], [0.2, -0.3, -0.4], [-1.0, 0.0, 0.0], [0.0, 0.0, -0.2]]
    )
    rule = torch.tensor([1.0, 0.0, 1.0, 1.0])  # the rest of the score: a rule reward
    # (the per-token rewards are in the score, as turn rewards are)
    scores = rule + tokens.sum(1)
    # (a loss term for this estimator: never in the advantages)
    kl = torch.full((4, 3), 9.0)
    adv, returns = E.advantages(alg, scores, kl, None, mask, 2, 0.5, turn_rewards=tokens)
    baseline = torch.tensor([0.5, -0.5, 0.0, 0.0])[:, None]  # the rule against its pair's mean
    assert returns is None and torch.allclose(adv, (tokens + baseline) * mask)
    # one sample a prompt
    adv1, _ = E.advantages(alg, scores, kl, None, mask, 1, 0.5, turn_rewards=tokens)
    assert torch.allclose(adv1, (tokens + rule[:, None]) * mask)
    # distillation alone
    alone, _ = E.advantages(alg, tokens.sum(1), kl, None, mask, 2, 0.5, turn_rewards=tokens)
    assert torch.allclose(alone, tokens * mask)


def test_distillation_needs_a_teacher_and_a_teacher_needs_a_weight():
    with pytest.raises(
        ConfigError,
        match=r"algorithm.estimator=distill learns from a teacher.*set ppo.teacher_path",
    ):
        Config(stage="ppo", algorithm=AlgorithmConfig(estimator="distill"))
    with pytest.raises(ConfigError, match=r"ppo.distill_coef=-1.0"):
        PPOConfig(teacher_path="t", distill_coef=-1.0)
    with pytest.raises(
        ConfigError,
        match=r"algorithm.estimator=distill learns from the teacher's reward, which ppo",
    ):
        Config(
            stage="ppo",
            algorithm=AlgorithmConfig(estimator="distill"),
            ppo=PPOConfig(teacher_path="t", distill_coef=0),
        )
    cfg = Config(
        stage="ppo", algorithm=AlgorithmConfig(estimator="distill"), ppo=PPOConfig(teacher_path="t")
    )
    assert cfg.roles() == ("actor", "reference", "reward_model", "teacher")
    # GKD alone: no per-token reward, the divergence its signal
    Config(
        stage="ppo",
        algorithm=AlgorithmConfig(estimator="distill", gkd_coef=1.0),
        ppo=PPOConfig(teacher_path="t", distill_coef=0),
    )


def test_gkd_divergence_is_the_generalised_jsd_chunked_and_exact():
    from rlhf.algorithms.tokens import chunked_divergence

    torch.manual_seed(0)
    s, t = torch.randn(3, 5, 11, dtype=torch.float64), torch.randn(3, 5, 11, dtype=torch.float64)
    ps, pt = s.softmax(-1), t.softmax(-1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)

    # forward KL
    assert torch.allclose(chunked_divergence(s, t, 0.0), kl(pt, ps).float(), atol=1e-6)
    # reverse KL
    assert torch.allclose(chunked_divergence(s, t, 1.0), kl(ps, pt).float(), atol=1e-6)
    for beta in (0.5, 0.3):
        m = beta * pt + (1 - beta) * ps
        jsd = beta * kl(pt, m) + (1 - beta) * kl(ps, m)
        assert torch.allclose(chunked_divergence(s, t, beta), jsd.float(), atol=1e-6)
    # a few positions at a time: the same numbers, and the gradient through every chunk
    s32 = s.float().requires_grad_()
    small = chunked_divergence(s32, t.float(), 0.3, chunk_bytes=1)
    small.sum().backward()
    whole = s.float().requires_grad_()
    chunked_divergence(whole, t.float(), 0.3).sum().backward()
    assert torch.allclose(small, jsd.float(), atol=1e-6) and torch.allclose(
        s32.grad, whole.grad, atol=1e-6
    )
    # top-k: the teacher's k likeliest tokens and one category for the rest of the vocabulary
    idx = t.topk(4, -1).indices

    def coarse(p):
        inside = p.gather(-1, idx)
        return torch.cat([inside, 1 - inside.sum(-1, keepdim=True)], -1)

    sk, tk = coarse(ps), coarse(pt)
    for beta, direct in ((0.0, kl(tk, sk)), (1.0, kl(sk, tk))):
        top = chunked_divergence(s, t, beta, top_k=4)
        assert torch.allclose(top, direct.float(), atol=1e-6)
        # a lower bound of the whole vocabulary's
        assert bool((top <= chunked_divergence(s, t, beta) + 1e-6).all())
    # a student that agrees with the teacher on the k tokens' proportions but moves its mass off
    # them is seen (renormalised over the k alone, its divergence would be 0: veRL #5041)
    off = t.clone()
    rest = torch.ones_like(off, dtype=torch.bool).scatter(-1, idx, False)
    off[rest] += 3.0
    for beta in (0.0, 0.5, 1.0):
        assert chunked_divergence(off, t, beta, top_k=4).min() > 0.05
        assert chunked_divergence(t, t, beta, top_k=4).abs().max() < 1e-6
    assert chunked_divergence(t, t, 0.5).abs().max() < 1e-6  # (fp32 rounding of the mixture)


def test_gkd_needs_a_teacher():
    with pytest.raises(
        ConfigError, match=r"algorithm.gkd_coef=0.5 compares the actor with a teacher"
    ):
        Config(stage="ppo", algorithm=AlgorithmConfig(gkd_coef=0.5))
    with pytest.raises(ConfigError, match=r"algorithm.gkd_beta"):
        AlgorithmConfig(gkd_beta=1.5)


def test_the_sampled_reverse_kl_reward_is_exact_in_expectation_and_in_its_gradient():
    """Every token of a small vocabulary as a sampled row, weighted by the student's probability:
    the distillation reward's mean is −KL(student ‖ teacher) and its policy gradient is −∇KL."""
    from rlhf.engine.mesh import Mesh
    from rlhf.rl.shaping import distillation

    torch.manual_seed(0)
    s_logits = torch.randn(7, dtype=torch.float64, requires_grad=True)
    t_logits = torch.randn(7, dtype=torch.float64)
    ls, lt = s_logits.log_softmax(-1), t_logits.log_softmax(-1)
    p = ls.exp()
    kl = (p * (ls - lt)).sum()
    # (a row per token; its greedy id unused)
    tokens = torch.arange(7.0, dtype=torch.float64)[:, None]
    student = torch.stack([ls.detach()[:, None], tokens], -1)
    teacher = torch.stack([lt[:, None], tokens], -1)
    reward, metrics = distillation(
        ls.detach()[:, None], teacher, student, torch.ones(7, 1), 1.0, Mesh()
    )
    assert torch.allclose((p.detach() * reward[:, 0]).sum(), -kl.detach())
    # the policy gradient's loss, advantage = reward
    surrogate = -(p.detach() * reward[:, 0] * ls).sum()
    (grad_pg,) = torch.autograd.grad(surrogate, s_logits, retain_graph=True)
    (grad_kl,) = torch.autograd.grad(kl, s_logits)
    assert torch.allclose(grad_pg, grad_kl)
    assert metrics["distill/agreement"] == 1.0 and metrics["distill/reverse_kl"] == -float(
        reward.mean()
    )
