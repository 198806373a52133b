"""ppo.update_rows=live: a GRPO step whose groups 0 and 2 all scored alike (a rule reward) scores
the old log-probs of the other rows alone and updates on them alone, with the gradients of every
row (fp32, one process; the loss's denominator still counts every row's tokens); where another term
of the loss reads every row (the KL in GRPO's loss at kl_coef > 0) every row is scored and runs, bit
for bit as ``all``."""

import pytest
import torch

from rlhf.config import AlgorithmConfig, EngineConfig, PPOConfig, TrainConfig
from rlhf.engine.hybrid import HybridEngine
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import FrozenModel, TrainEngine
from rlhf.rl.experience import Collector
from rlhf.rl.metrics import step_metrics
from rlhf.rl.minibatch import in_subset, subset_groups
from rlhf.rl.prompts import PromptSource
from rlhf.rl.scorers import RewardNormaliser, Scorers
from rlhf.rl.update import Updater
from tests.distributed.parity_worker import tiny_model
from tests.distributed.token_budget_worker import capture_grads
from tests.infer_helpers import mixed_prompts
from tests.unit.rl.test_ppo_token_budget import VOCAB, BusierPeer, Tok, rel

TOL = 1e-6
GROUP = 2  # samples a prompt
DEAD = (0, 2)  # the groups whose samples all score alike


def rule_with(dead):
    def rule(texts, examples, fmt):
        """Each response's own number in [0, 1) (from its characters), 0 for every sample of the
        ``dead`` groups."""
        return [
            0.0 if i // GROUP in dead else sum(map(ord, t)) % 97 / 97 for i, t in enumerate(texts)
        ]

    return rule


def step(
    update_rows: str,
    kl=0.0,
    update_mesh=None,
    max_tokens: int = 0,
    micro: int = 0,
    dead=DEAD,
    updates: int = 2,
):
    """(the experience, [actor gradients of each of the step's updates: ``updates`` epochs × as
    many minibatches], the update's metrics, [tokens of each actor forward: scoring's, then the
    update's]) of one GRPO step."""
    torch.manual_seed(1)
    mesh, ecfg = Mesh(), EngineConfig(precision="fp32")
    alg = AlgorithmConfig(estimator="grpo", kl_coef=kl, no_eos_penalty=0.0)
    ppo = PPOConfig(
        prompts_per_step=4,
        samples_per_prompt=GROUP,
        ppo_epochs=updates,
        minibatches_per_epoch=updates,
        max_new_tokens=10,
        max_tokens_per_micro_batch=max_tokens,
        micro_batch_per_rank=micro,
        update_rows=update_rows,
    )
    actor = TrainEngine(tiny_model(seed=0), mesh, ecfg, TrainConfig(lr=1e-3), total_steps=4)
    scorers = Scorers(
        ref=FrozenModel(tiny_model(seed=1), mesh, ecfg) if kl else None,
        critic=None,
        reward_model=None,
        normalise=RewardNormaliser("none", {}),
        rule=rule_with(dead),
        rule_weight=1.0,
        data_format="prompt_response",
    )
    prompts = PromptSource(
        mixed_prompts(4, vocab=VOCAB), [None] * 4, 4, seed=0, mesh=mesh, max_rounds=0
    )
    hybrid = HybridEngine(actor, Tok(), ecfg)
    updater = Updater(actor, None, alg, ppo, update_mesh or mesh, seed=0)
    collector = Collector(hybrid, actor, scorers, prompts, alg, ppo, Tok(), mesh, seed=3)
    collector.update_live_rows = updater.live_only  # (as the stage does)
    tokens = []
    forward = actor.forward

    def counted(**batch):
        tokens.append(int(batch["input_ids"].numel()))  # (a packed forward's: one row)
        return forward(**batch)

    actor.forward = counted
    exp = collector.collect(0, kl)
    live = (exp.advantages != 0).any(1)
    assert live.sum() == exp.rows - GROUP * len(dead)  # the others carry an advantage
    grads = []
    capture_grads(actor, grads)
    actor.train()
    stats = updater.update(exp, 0, kl)
    return exp, grads, stats, tokens


@pytest.fixture(scope="module")
def every_row():
    return step("all")


def same_gradients(got: list, want: list, updates: int = 4) -> None:
    assert len(got) == len(want) == updates
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        assert rel(g, w) <= TOL, rel(g, w)


@pytest.mark.parametrize("max_tokens", [0, 30])
def test_live_rows_score_and_update_as_every_row(every_row, max_tokens):
    ref_exp, ref_grads, ref_stats, ref_tokens = every_row
    exp, grads, stats, tokens = step("live", max_tokens=max_tokens)
    assert torch.equal(exp.sequences, ref_exp.sequences)
    assert torch.equal(exp.advantages, ref_exp.advantages)
    live = (exp.advantages != 0).any(1)
    # the rows with an advantage, and the first (row 0: a dead group's) for the parity guard
    assert torch.equal(exp.scored_rows, live | (torch.arange(exp.rows) == 0))
    assert ref_exp.scored_rows is None
    on = exp.mask.bool() & exp.scored_rows[:, None]
    assert float((exp.old_logprobs - ref_exp.old_logprobs)[on].abs().max()) <= TOL
    same_gradients(grads, ref_grads)
    assert stats["actor/rows_skipped"] == pytest.approx(0.5)  # 2 of 4 groups
    assert "actor/rows_skipped" not in ref_stats
    assert sum(tokens) < 0.75 * sum(ref_tokens)
    # the PG loss is the same sum over the same denominator
    assert stats["actor/loss"] == pytest.approx(ref_stats["actor/loss"], abs=1e-6)
    # the rollout-parity figures over the rows scored
    row, ref_row = step_metrics(exp, 0.0, Mesh()), step_metrics(ref_exp, 0.0, Mesh())
    for k in ("rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max", "rollout/kl"):
        assert 0 <= row[k] < 1e-5 and 0 <= ref_row[k] < 1e-5, k


def test_live_rows_with_a_busier_peer(every_row):
    """A rank whose peer runs more micro-batches runs stand-in rows at weight 0 for the rest."""
    _, grads, _, tokens = step("live", update_mesh=BusierPeer(), micro=1)
    same_gradients(grads, every_row[1])
    # scoring: one forward a row scored (4 live and row 0); the update, a minibatch: its live rows
    # + the 4 its peer runs more, one a forward (4 live an epoch, 2 epochs)
    assert len(tokens) == 5 + 24


def test_no_live_row_still_steps_and_is_checked():
    """Every group scored alike: row 0 alone scored (the parity figures have tokens), one
    stand-in row an update at weight 0, zero gradients, four optimizer steps, no token means."""
    exp, grads, stats, tokens = step("live", dead=(0, 1, 2, 3), micro=1)
    assert exp.scored_rows.tolist() == [True] + [False] * 7
    assert 0 <= step_metrics(exp, 0.0, Mesh())["rollout/logprob_abs_diff_mean"] < 1e-5
    assert len(grads) == 4 and len(tokens) == 1 + 4
    assert all(float(g.abs().max()) == 0 for gs in grads for g in gs.values())
    assert stats["actor/rows_skipped"] == 1.0
    assert "entropy" not in stats and "clipfrac" not in stats


def test_one_update_a_step_takes_the_old_log_probs_from_its_own_forward():
    """ppo_epochs = minibatches = 1: the update's forward precedes its one optimizer step, so only
    row 0 is scored (for the parity guard) and the live rows' old log-probs are the update's own:
    the gradient of ``all`` (whose scoring recomputes every row), a ratio of 1."""
    ref_exp, ref_grads, ref_stats, ref_tokens = step("all", updates=1)
    exp, grads, stats, tokens = step("live", updates=1)
    assert exp.old_from_update and not ref_exp.old_from_update
    assert exp.scored_rows.tolist() == [True] + [False] * (exp.rows - 1)
    same_gradients(grads, ref_grads, updates=1)
    assert stats["actor/loss"] == pytest.approx(ref_stats["actor/loss"], abs=1e-6)
    assert stats["clipfrac"] == 0 and stats["approx_kl"] == 0
    # scoring: row 0's forward alone (the live rows' went), then the update's over the live rows
    live = int((exp.advantages != 0).any(1).sum())
    assert len(tokens) == 1 + 1 and sum(tokens) < 0.6 * sum(ref_tokens), (tokens, ref_tokens)
    assert live == exp.rows - GROUP * len(DEAD)
    assert 0 <= step_metrics(exp, 0.0, Mesh())["rollout/logprob_abs_diff_mean"] < 1e-5
    # several updates a step: the live rows are scored as before
    assert not step("live")[0].old_from_update


def test_kl_in_the_loss_scores_and_runs_every_row():
    """GRPO's KL term at kl_coef > 0 has a gradient on every row: ``live`` runs them all."""
    want_exp, want, _, want_tokens = step("all", kl=0.1)
    got_exp, got, stats, tokens = step("live", kl=0.1)
    assert tokens == want_tokens and "actor/rows_skipped" not in stats
    assert got_exp.scored_rows is None
    assert torch.equal(got_exp.old_logprobs, want_exp.old_logprobs)
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(g[k], w[k]) for k in w)


class Peer(Mesh):
    """One process standing in for a rank whose peer holds 3 more groups' worth of live rows."""

    def max(self, x: int) -> int:
        return int(x) + 3


@pytest.mark.parametrize("live", [[], [1, 4, 5]])
def test_subset_groups_agree_with_a_peer(live):
    """A rank with fewer (or no) live rows runs as many scoring forwards as its peer: stand-ins."""
    rows, att = torch.tensor(live, dtype=torch.long), torch.ones(6, 5)
    groups = subset_groups(rows, att, 2, 0, Peer())
    own = -(-len(live) // 2)
    assert len(groups) == own + 3
    assert [int(i) for g, real in groups if real for i in g] == live
    assert all(g.tolist() == [0] for g, real in groups if not real)
    # the stand-ins' results dropped
    fill = torch.zeros(6, 1)
    out = in_subset(lambda r: torch.ones(len(r), 1), groups, fill)
    assert out[:, 0].tolist() == [float(i in live) for i in range(6)]
