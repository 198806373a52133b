"""ppo.update_rows=live: the update's forwards and backwards leave out the rows without an
advantage (a GRPO group whose samples all scored alike) and give the gradients of every row (fp32,
one process; the loss's denominator still counts every row's tokens); where another term of the
loss reads every row (the KL in GRPO's loss at kl_coef > 0) every row runs, bit for bit as ``all``."""

import dataclasses

import pytest
import torch

from rlhf.config import AlgorithmConfig, EngineConfig, PPOConfig, TrainConfig
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import FrozenModel, TrainEngine
from rlhf.rl.experience import Collector
from rlhf.rl.prompts import PromptSource
from rlhf.rl.scorers import RewardNormaliser, Scorers
from rlhf.rl.update import Updater
from tests.distributed.parity_worker import tiny_model
from tests.distributed.token_budget_worker import capture_grads, reward_model
from tests.infer_helpers import mixed_prompts
from tests.unit.rl.test_ppo_token_budget import VOCAB, BusierPeer, Tok, rel

TOL = 1e-6
GROUP = 2  # samples a prompt


def step(
    update_rows: str, dead=(0, 2), kl=0.0, update_mesh=None, max_tokens: int = 0, micro: int = 0
):
    """([actor gradients of each of the step's 4 updates], the update's metrics, [tokens of each
    forward]) of
    one GRPO step whose groups ``dead`` have their advantages zeroed (as if they scored alike)."""
    torch.manual_seed(1)
    mesh, ecfg = Mesh(), EngineConfig(precision="fp32")
    alg = AlgorithmConfig(estimator="grpo", kl_coef=kl)
    ppo = PPOConfig(
        prompts_per_step=4,
        samples_per_prompt=GROUP,
        ppo_epochs=2,
        minibatches_per_epoch=2,
        max_new_tokens=10,
        max_tokens_per_micro_batch=max_tokens,
        micro_batch_per_rank=micro,
        update_rows=update_rows,
    )
    actor = TrainEngine(tiny_model(seed=0), mesh, ecfg, TrainConfig(lr=1e-3), total_steps=4)
    scorers = Scorers(
        ref=FrozenModel(tiny_model(seed=1), mesh, ecfg) if kl else None,
        critic=None,
        reward_model=FrozenModel(reward_model(mesh), mesh, ecfg),
        normalise=RewardNormaliser("none", {}),
        rule=None,
        rule_weight=1.0,
        data_format="prompt_response",
    )
    prompts = PromptSource(
        mixed_prompts(4, vocab=VOCAB), [None] * 4, 4, seed=0, mesh=mesh, max_rounds=0
    )
    hybrid = HybridEngine(actor, Tok(), ecfg)
    exp = Collector(hybrid, actor, scorers, prompts, alg, ppo, Tok(), mesh, seed=3).collect(0, kl)
    adv = exp.advantages.clone()
    for g in dead:
        adv[g * GROUP : (g + 1) * GROUP] = 0
    assert (adv != 0).any(1).sum() == exp.rows - GROUP * len(dead)  # the others carry one
    exp = dataclasses.replace(exp, advantages=adv)
    grads, rows = [], []
    capture_grads(actor, grads)
    forward = actor.forward

    def counted(**batch):
        rows.append(int(batch["input_ids"].numel()))  # tokens (a packed forward's: one row)
        return forward(**batch)

    actor.forward = counted
    actor.train()
    stats = Updater(actor, None, alg, ppo, update_mesh or mesh, seed=0).update(exp, 0, kl)
    return grads, stats, rows


@pytest.fixture(scope="module")
def every_row():
    return step("all")


def same_gradients(got: list, want: list) -> None:
    assert len(got) == len(want) == 4
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        assert rel(g, w) <= TOL, rel(g, w)


@pytest.mark.parametrize("max_tokens", [0, 30])
def test_live_rows_update_as_every_row(every_row, max_tokens):
    grads, stats, rows = step("live", max_tokens=max_tokens)
    same_gradients(grads, every_row[0])
    assert stats["actor/rows_skipped"] == pytest.approx(0.5)  # 2 of 4 groups
    assert "actor/rows_skipped" not in every_row[1]
    assert sum(rows) < 0.75 * sum(every_row[2])
    # the metrics of the rows run (the PG loss is the same sum over the same denominator)
    assert stats["actor/loss"] == pytest.approx(every_row[1]["actor/loss"], abs=1e-6)


def test_live_rows_with_a_busier_peer(every_row):
    """A rank whose peer runs more micro-batches runs stand-in rows at weight 0 for the rest."""
    grads, _, rows = step("live", update_mesh=BusierPeer(), micro=1)
    same_gradients(grads, every_row[0])
    # a minibatch: its live rows + the 4 its peer runs more, one a forward (4 live an epoch)
    assert len(rows) == 4 * 6


def test_no_live_row_still_steps():
    """Every group scored alike: one stand-in row per update, zero gradients, four steps."""
    grads, stats, rows = step("live", dead=(0, 1, 2, 3))
    assert len(grads) == 4 and len(rows) == 4
    assert all(float(g.abs().max()) == 0 for gs in grads for g in gs.values())
    assert stats["actor/rows_skipped"] == 1.0


def test_kl_in_the_loss_runs_every_row():
    """GRPO's KL term at kl_coef > 0 has a gradient on every row: ``live`` runs them all."""
    want, want_stats, want_rows = step("all", kl=0.1)
    got, stats, rows = step("live", kl=0.1)
    assert rows == want_rows and "actor/rows_skipped" not in stats
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(g[k], w[k]) for k in w)
