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
    # the stage builds no critic for it (critic=False), and its grouped baseline brings the group checks
    cfg = Config(stage="ppo", algorithm=alg, ppo=PPOConfig(samples_per_prompt=2, dynamic_sampling=True))
    assert cfg.roles() == ("actor", "reference", "reward_model")
    with pytest.raises(ConfigError, match=r"samples_per_prompt=1 is invalid for algorithm.estimator=toy"):
        Config(stage="ppo", algorithm=alg, ppo=PPOConfig(samples_per_prompt=1))
    # messages list it with the others
    with pytest.raises(ConfigError, match="expected gae, grpo, rloo, reinforce_pp, distill or toy"):
        AlgorithmConfig(estimator="nope")


def test_the_table_holds_each_estimators_traits():
    traits = {n: (e.critic, e.grouped, e.kl_in_loss, e.kl_default, e.needs_teacher) for n, e in E.ESTIMATORS.items()}
    assert traits == {
        "gae": (True, False, False, "k1", False),
        "grpo": (False, True, True, "k3", False),
        "rloo": (False, True, False, "k1", False),
        "reinforce_pp": (False, False, False, "k1", False),
        "distill": (False, False, True, "k3", True),
    }
    with pytest.raises(ConfigError, match=r"needs a group estimator \(algorithm.estimator=grpo or rloo\), not gae"):
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
    tokens = torch.tensor([[-0.5, -0.1, 0.0], [0.2, -0.3, -0.4], [-1.0, 0.0, 0.0], [0.0, 0.0, -0.2]])
    rule = torch.tensor([1.0, 0.0, 1.0, 1.0])  # the rest of the score: a rule reward
    scores = rule + tokens.sum(1)  # (the per-token rewards are in the score, as turn rewards are)
    kl = torch.full((4, 3), 9.0)  # (a loss term for this estimator: never in the advantages)
    adv, returns = E.advantages(alg, scores, kl, None, mask, 2, 0.5, turn_rewards=tokens)
    baseline = torch.tensor([0.5, -0.5, 0.0, 0.0])[:, None]  # the rule against its pair's mean
    assert returns is None and torch.allclose(adv, (tokens + baseline) * mask)
    adv1, _ = E.advantages(alg, scores, kl, None, mask, 1, 0.5, turn_rewards=tokens)  # one sample a prompt
    assert torch.allclose(adv1, (tokens + rule[:, None]) * mask)
    alone, _ = E.advantages(alg, tokens.sum(1), kl, None, mask, 2, 0.5, turn_rewards=tokens)  # distillation alone
    assert torch.allclose(alone, tokens * mask)


def test_distillation_needs_a_teacher_and_a_teacher_needs_a_weight():
    with pytest.raises(ConfigError, match=r"algorithm.estimator=distill learns from a teacher.*set ppo.teacher_path"):
        Config(stage="ppo", algorithm=AlgorithmConfig(estimator="distill"))
    with pytest.raises(ConfigError, match=r"ppo.distill_coef=0.*with ppo.teacher_path=t"):
        PPOConfig(teacher_path="t", distill_coef=0.0)
    cfg = Config(stage="ppo", algorithm=AlgorithmConfig(estimator="distill"), ppo=PPOConfig(teacher_path="t"))
    assert cfg.roles() == ("actor", "reference", "reward_model", "teacher")
