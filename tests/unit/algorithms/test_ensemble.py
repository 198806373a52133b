"""Reward-model ensembles: the members' combination, per-member normalisation and clipping, the
bootstrap's draw, the critic's mean head, and the over-optimisation gate (golden values)."""

import math
import types

import pytest
import torch

from rlhf.algorithms.ensemble import COMBINE, combine, disagreement
from rlhf.data.sampler import bootstrap_weights
from rlhf.engine.mesh import Mesh
from rlhf.models.value import ScalarHeadModel, mean_head, sequence_scores
from rlhf.rl.gate import WINDOW, Gate
from rlhf.rl.scorers import RewardNormaliser
from tests.unit.models.test_value_head import tiny_rm

SCORES = torch.tensor([[1.0, 3.0], [0.0, 0.0], [-2.0, 4.0]])  # 3 rows × 2 members


def test_combinations_golden():
    assert disagreement(SCORES).tolist() == [1.0, 0.0, 3.0]  # population std: |a − b| / 2
    assert combine(SCORES, "mean").tolist() == [2.0, 0.0, 1.0]
    assert combine(SCORES, "lcb", 1.0).tolist() == [1.0, 0.0, -2.0]
    assert combine(SCORES, "lcb", 0.5).tolist() == [1.5, 0.0, -0.5]
    assert combine(SCORES, "min").tolist() == [1.0, 0.0, -2.0]
    # the others only watch: neither the largest, the smallest nor the mean of a row
    assert combine(torch.tensor([[2.0, 1.0, 3.0], [-1.0, -2.0, 4.0]]), "first").tolist() == [
        2.0,
        -1.0,
    ]
    assert set(COMBINE) == {"mean", "lcb", "min", "first"}
    # one member: every combination is the member itself
    one = SCORES[:, :1]
    for how in COMBINE:
        assert combine(one, how).tolist() == one[:, 0].tolist()


def test_normaliser_member_by_member_and_clip():
    stats = {
        "mean": 0.0,
        "std": 1.0,
        "members": [
            {"mean": 1.0, "std": 2.0, "min": -1.0, "max": 2.0},
            {"mean": -1.0, "std": 0.5, "min": -3.0, "max": 5.0},
        ],
    }
    norm = RewardNormaliser("stats", stats, clip=True)
    raw, share = norm.clip(SCORES)
    assert raw.tolist() == [[1.0, 3.0], [0.0, 0.0], [-1.0, 4.0]] and share.tolist() == [
        0.0,
        0.0,
        0.5,
    ]
    out = norm(raw, Mesh())
    assert out.tolist() == [[0.0, 8.0], [-0.5, 2.0], [-1.0, 10.0]]
    # one reward model: its top-level statistics, as before ensembles existed
    one = RewardNormaliser("stats", {"mean": 1.0, "std": 2.0})
    assert one(torch.tensor([3.0, -1.0]), Mesh()).tolist() == [1.0, -1.0]
    assert one.clip(torch.tensor([9.0]))[0].tolist() == [9.0]  # clip off: unchanged


def test_an_ensemble_without_member_statistics_normalises_each_member_alike():
    # e.g. a k-label model from elsewhere
    norm = RewardNormaliser("stats", {"mean": 1.0, "std": 2.0}, members=2)
    assert norm(SCORES, Mesh()).tolist() == [[0.0, 1.0], [-0.5, -0.5], [-1.5, 1.5]]


def test_running_state_keeps_its_single_model_format():
    one = RewardNormaliser("running", {})
    one(torch.tensor([1.0, 3.0]), Mesh())
    assert set(one.state_dict()) == {"mean", "var", "count"}  # checkpoints of earlier versions load
    ens = RewardNormaliser("running", {"members": [{}, {}]})
    ens(SCORES, Mesh())
    state = ens.state_dict()
    assert len(state["members"]) == 2 and state["members"][0]["mean"] != state["members"][1]["mean"]
    again = RewardNormaliser("running", {"members": [{}, {}]})
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_bootstrap_is_per_record_and_about_half():
    rows = list(range(2000))
    w = bootstrap_weights(rows, 3, seed=7)
    assert {x for r in w for x in r} == {0.0, 2.0}
    for m in range(3):
        # each member sees about half of the records
        share = sum(r[m] > 0 for r in w) / len(rows)
        assert 0.45 < share < 0.55, share
    assert [r[0] for r in w] != [r[1] for r in w]  # members draw apart
    # a record's draw does not depend on which rows share its micro-batch, nor on their order
    assert bootstrap_weights([1500, 3], 3, seed=7) == [w[1500], w[3]]
    assert bootstrap_weights([3], 3, seed=8) != [w[3]] or bootstrap_weights([4], 3, seed=8) != [
        w[4]
    ]


def test_ensemble_values_and_critic_mean_head():
    m = tiny_rm(3)
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])
    mask = (ids != 0).long()
    with torch.no_grad():
        members = sequence_scores(ScalarHeadModel(m)(ids, mask), mask)
        assert members.shape == (2, 3)
        # the critic's start: the mean of the scaled members
        mean_head(m, [1.0, 2.0, 0.5])
        assert m.config.num_labels == 1
        critic = sequence_scores(ScalarHeadModel(m)(ids, mask), mask)
    expected = (members * torch.tensor([1.0, 2.0, 0.5])).mean(1)
    assert critic.shape == (2,) and torch.allclose(critic, expected, atol=1e-6), (critic, expected)


def _actor():
    lin = torch.nn.Linear(2, 1, bias=False)
    return types.SimpleNamespace(model=lin, module=lin, mesh=Mesh())


def _feed(gate: Gate, actor, rewards, disagreements, kls):
    for i, (r, d, k) in enumerate(zip(rewards, disagreements, kls), start=1):
        with torch.no_grad():
            # the weights that generated step i's rollouts
            actor.model.weight.fill_(float(i))
        why = gate.observe(i, r, d, k)
        if why:
            return i, why
    return None, None


def test_gate_fires_on_disagreement_and_keeps_the_best_step():
    actor = _actor()
    gate = Gate(stop_disagreement=1.5, stop_kl=None, actor=actor)
    rewards = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.55, 0.5, 0.4, 0.3, 0.2]
    dis = [1.0] * 6 + [1.4, 1.8, 2.2, 2.6, 3.0, 3.4]
    step, why = _feed(gate, actor, rewards, dis, [0.0] * 12)
    # windows of 5: mean(d[4:9]) = 1.48, mean(d[5:10]) = 1.8 > 1.5 at step 10
    assert step == 10 and "ppo.stop_disagreement=1.5" in why, (step, why)
    # trailing-5 rewards: 0.40 at step 7, 0.47 at 8, 0.51 at 9, 0.51 at 10 (not better): step 9
    assert gate.best_step == 9 and math.isclose(gate.best_value, (0.4 + 0.5 + 0.6 + 0.55 + 0.5) / 5)
    # the weights that generated step 9's rollouts
    gate.best.restore()
    assert actor.model.weight.flatten().tolist() == [9.0, 9.0]


def test_gate_on_kl_and_state_round_trip():
    actor = _actor()
    kls = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    gate = Gate(stop_disagreement=None, stop_kl=0.55, actor=actor)
    step, why = _feed(gate, actor, [0.0] * 8, [None] * 8, kls)
    # trailing means 0.5 at step 7, 0.6 at step 8
    assert step == 8 and "ppo.stop_kl=0.55" in why
    # a gate restored from another's state after step 4 decides as the uninterrupted one
    a, b = Gate(None, 0.55), Gate(None, 0.55)
    for i in range(1, 5):
        a.observe(i, 0.0, None, kls[i - 1])
    b.load_state_dict(a.state_dict())
    assert [a.observe(i, 0.0, None, kls[i - 1]) for i in range(5, 9)] == [
        b.observe(i, 0.0, None, kls[i - 1]) for i in range(5, 9)
    ]


def test_gate_off_never_fires_and_warns_once(caplog):
    gate = Gate(None, None)
    assert not gate.on and gate.best is None
    with caplog.at_level("WARNING", logger="rlhf"):
        for i in range(1, 20):
            assert gate.observe(i, 0.0, 1.0 if i <= WINDOW else 5.0, 9.0) is None
    assert sum("disagree" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("how", sorted(COMBINE))
def test_ppo_config_accepts_each_combination(how):
    from rlhf.config import PPOConfig

    PPOConfig(reward_combine=how)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["stage=reward", "reward.ensemble=0"], "reward.ensemble=0 is invalid"),
        (["stage=ppo", "ppo.reward_combine=max"], "ppo.reward_combine='max' is invalid"),
        (["stage=ppo", "ppo.stop_disagreement=0.5"], "ppo.stop_disagreement=0.5 is invalid"),
        (
            ["stage=ppo", "ppo.stop_kl=2", "algorithm.kl_coef=0"],
            "ppo.stop_kl=2 reads the KL to the reference",
        ),
        (["stage=ppo", "ppo.warn_greedy_changed=1.5"], "ppo.warn_greedy_changed=1.5 is invalid"),
    ],
)
def test_bad_ensemble_and_gate_keys_are_one_clear_error(overrides, fragment):
    from rlhf.compose import compose_config
    from rlhf.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        compose_config(overrides)
    assert fragment in str(e.value), str(e.value)


def _answers(n: int, reward: float, changed=(), gain: float = 0.0) -> list:
    """n held-out greedy answers as evaluate_reward gives them: (digest, reward); those in
    ``changed`` are other answers, scored ``gain`` above the rest."""
    return [
        (f"new{i}" if i in changed else f"old{i}", reward + (gain if i in changed else 0.0))
        for i in range(n)
    ]


def test_held_out_reward_warning_judges_the_final_policy_once_and_survives_a_resume():
    gate = Gate(None, None, warn_heldout_drop=0.03)
    assert gate.heldout(0, 0.730, _answers(4, 0.730)) == (
        {"eval/greedy_changed": 0.0, "eval/reward_gain_changed": 0.0},
        None,
    )  # the start: the reference
    # mid-run: not judged (the greedy dip recovers)
    assert gate.heldout(20, 0.600, _answers(4, 0.600))[1] is None
    # −0.020 at the end: within the margin
    assert gate.heldout(40, 0.710, _answers(4, 0.710), final=True)[1] is None
    again = Gate(None, None, warn_heldout_drop=0.03)
    # a resumed run keeps the step-0 reference
    again.load_state_dict(gate.state_dict())
    for g in (gate, again):
        # −0.065 (the unseen seed 801015)
        _, why = g.heldout(80, 0.665, _answers(4, 0.665), final=True)
        assert (
            why and "0.065 lower than at the start" in why and "ppo.warn_heldout_drop=0.03" in why
        )
        assert g.heldout(120, 0.5, _answers(4, 0.5), final=True)[1] is None  # said once
    off = Gate(None, None, warn_heldout_drop=None)
    assert off.heldout(0, 1.0, _answers(4, 1.0))[1] is None
    assert off.heldout(1, -5.0, _answers(4, -5.0), final=True)[1] is None


def test_changed_greedy_answers_the_reward_model_cannot_tell_apart_are_a_warning():
    from rlhf.rl.gate import CHANGED_GAIN

    def final(changed, gain, threshold=0.1):
        gate = Gate(None, None, warn_heldout_drop=0.03, warn_greedy_changed=threshold)
        gate.heldout(0, 0.66, _answers(100, 0.66))
        again = Gate(None, None, warn_heldout_drop=0.03, warn_greedy_changed=threshold)
        again.load_state_dict(gate.state_dict())  # step 0's answers survive a resume
        mean = 0.66 + gain * len(changed) / 100
        return again.heldout(60, mean, _answers(100, 0.66, changed, gain), final=True)

    # seed 209180's pattern (docs/ppo.md): 27% changed, the reward model barely prefers them
    metrics, why = final(range(27), 0.05)
    assert metrics == pytest.approx({"eval/greedy_changed": 0.27, "eval/reward_gain_changed": 0.05})
    assert (
        why
        and "changed on 27 of 100 held-out prompts" in why
        and "ppo.warn_greedy_changed=0.1" in why
    )
    # it clearly prefers them: an improvement
    assert final(range(27), CHANGED_GAIN + 0.1)[1] is None
    assert final(range(10), 0.0)[1] is None  # 10%: not more than the threshold
    assert final(range(4), -0.4)[1] is None  # a healthy seed's few changes
    assert final(range(27), 0.05, threshold=None)[1] is None  # off
    gate = Gate(None, None, warn_greedy_changed=0.1)
    gate.heldout(0, 0.66, _answers(100, 0.66))
    # mid-run: logged, not judged
    assert gate.heldout(30, 0.66, _answers(100, 0.66, range(50), 0.0))[1] is None
