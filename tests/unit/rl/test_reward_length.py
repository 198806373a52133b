"""ppo.reward_length_debias (rlhf/rl/experience.py ``length_debiased``): the reward model's part
with its least-squares line in response length taken out over every rank's rows — no correlation
with length left, the mean kept, a score that does not depend on length unchanged."""

import torch

from rlhf.engine.mesh import Mesh
from rlhf.rl.shaping import length_debiased


def test_length_carries_no_reward_after_debiasing():
    g = torch.Generator().manual_seed(0)
    length = torch.randint(5, 60, (64,), generator=g).float()
    content = torch.randn(64, generator=g)
    score = 0.05 * length + content  # a reward model that likes long answers
    out, slope = length_debiased(score, length, Mesh())
    assert abs(float(slope) - 0.05) < 0.02
    centred = length - length.mean()
    assert abs(float((out * centred).sum())) < 1e-3  # no linear dependence left
    assert torch.allclose(out.mean(), score.mean(), atol=1e-6)
    # what is left is the content, up to a constant
    assert torch.corrcoef(torch.stack([out, content]))[0, 1] > 0.99


def test_a_score_that_ignores_length_is_unchanged_and_equal_lengths_do_nothing():
    length = torch.tensor([10.0, 20.0, 30.0, 40.0])
    score = torch.tensor([1.0, -1.0, -1.0, 1.0])  # no slope
    out, slope = length_debiased(score, length, Mesh())
    assert float(slope) == 0.0 and torch.equal(out, score)
    out, slope = length_debiased(score, torch.full((4,), 7.0), Mesh())
    assert float(slope) == 0.0 and torch.equal(out, score)
