"""ppo.max_tokens_per_micro_batch: the scoring forwards (actor and reference log-probs, critic
values, reward-model scores) and the update's micro-batches grouped by real tokens give the scored
tensors and the actor's and critic's gradients of the row-count path (fp32, one process; the loss
denominators are the global minibatch's, computed before the split)."""

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
from tests.infer_helpers import BOS, EOS, PAD, mixed_prompts

VOCAB = 61
TOL = 1e-6
SCORED = ("old_logprobs", "ref_logprobs", "values", "scores", "kl", "advantages", "returns")


class Tok:
    pad_token_id, eos_token_id, bos_token_id = PAD, EOS, BOS

    def __len__(self):
        return VOCAB

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


def ppo_cfg(max_tokens: int = 0, micro: int = 0, lm_head: str = "all") -> PPOConfig:
    return PPOConfig(
        lm_head=lm_head,
        prompts_per_step=4,
        samples_per_prompt=2,
        ppo_epochs=2,
        minibatches_per_epoch=2,
        max_new_tokens=10,
        micro_batch_per_rank=micro,
        max_tokens_per_micro_batch=max_tokens,
    )


def models(mesh: Mesh):
    ecfg = EngineConfig(precision="fp32")
    tcfg = TrainConfig(lr=1e-3, warmup_steps=0)
    actor = TrainEngine(tiny_model(seed=0), mesh, ecfg, tcfg, total_steps=4)
    critic = TrainEngine(reward_model(mesh), mesh, ecfg, tcfg, total_steps=4)
    scorers = Scorers(
        ref=FrozenModel(tiny_model(seed=1), mesh, ecfg),
        critic=critic,
        reward_model=FrozenModel(reward_model(mesh), mesh, ecfg),
        normalise=RewardNormaliser("none", {}),
        rule=None,
        rule_weight=1.0,
        data_format="prompt_response",
    )
    return actor, critic, scorers, HybridEngine(actor, Tok(), ecfg)


class BusierPeer(Mesh):
    """One process standing in for a rank of a job whose other rank needs 4 micro-batches more than
    it: more than its 4 rows of a minibatch, so it runs stand-in rows at weight 0."""

    def max(self, x: int) -> int:
        return int(x) + 4


def run(
    max_tokens: int,
    micro: int = 0,
    update_mesh: Mesh | None = None,
    mesh: Mesh | None = None,
    lm_head: str = "all",
    gkd: bool = False,
):
    """(experience, [actor gradients per update], [critic gradients per update]) of one GAE step:
    the updates' gradients at the scoring weights (each captured, then dropped). ``gkd``: GKD's
    divergence to a teacher in the actor's loss too."""
    torch.manual_seed(1)
    mesh, alg, ppo = (
        mesh or Mesh(),
        AlgorithmConfig(estimator="gae", kl_coef=0.1, gkd_coef=1.0 if gkd else 0.0),
        ppo_cfg(max_tokens, micro, lm_head),
    )
    actor, critic, scorers, hybrid = models(mesh)
    prompts = PromptSource(
        mixed_prompts(4, vocab=VOCAB),
        [None] * 4,
        ppo.prompts_per_step,
        seed=0,
        mesh=mesh,
        max_rounds=0,
    )
    exp = Collector(hybrid, actor, scorers, prompts, alg, ppo, Tok(), mesh, seed=3).collect(
        0, alg.kl_coef
    )
    actor_grads, critic_grads = [], []
    capture_grads(actor, actor_grads)
    capture_grads(critic, critic_grads)
    actor.train()
    teacher = FrozenModel(tiny_model(seed=2), mesh, EngineConfig(precision="fp32")) if gkd else None
    Updater(actor, critic, alg, ppo, update_mesh or mesh, seed=0, teacher=teacher).update(
        exp, 0, alg.kl_coef
    )
    return exp, actor_grads, critic_grads


def rel(got: dict, ref: dict) -> float:
    err = sum(float((got[k] - ref[k]).double().norm() ** 2) for k in ref) ** 0.5
    return err / sum(float(ref[k].double().norm() ** 2) for k in ref) ** 0.5


@pytest.fixture(scope="module")
def reference():
    return run(0)


@pytest.mark.parametrize("max_tokens", [8, 30, 10_000])
def test_token_budget_scores_and_updates_like_rows(reference, max_tokens):
    ref_exp, ref_actor, ref_critic = reference
    exp, actor_grads, critic_grads = run(max_tokens)
    assert torch.equal(exp.sequences, ref_exp.sequences)  # the same rollouts
    for key in SCORED:
        got, want = getattr(exp, key), getattr(ref_exp, key)
        # within 1e-6 of the tensor's scale (at least 1: the KL is a difference of log-probs near 4)
        scale = max(1.0, float(want.abs().max()))
        assert float((got - want).abs().max()) <= TOL * scale, (key, max_tokens)
    assert len(actor_grads) == len(ref_actor) == 4 and len(critic_grads) == 4
    for got, want in zip(actor_grads + critic_grads, ref_actor + ref_critic):
        assert got.keys() == want.keys()
        assert rel(got, want) <= TOL, (max_tokens, rel(got, want))


def test_row_count_micro_batches_still_match(reference):
    ref_exp, ref_actor, _ = reference
    exp, actor_grads, _ = run(0, micro=3)
    assert float((exp.old_logprobs - ref_exp.old_logprobs).abs().max()) <= TOL * 5
    assert all(rel(g, w) <= TOL for g, w in zip(actor_grads, ref_actor))


def test_extra_agreed_micro_batches_run_as_zero_weight_rows(reference):
    _, ref_actor, ref_critic = reference
    _, actor_grads, critic_grads = run(30, update_mesh=BusierPeer())
    for got, want in zip(actor_grads + critic_grads, ref_actor + ref_critic, strict=True):
        assert rel(got, want) <= TOL


def same_step(a, b) -> None:
    """Two runs' experience and gradients of one step agree within ``TOL`` (log-probs on the
    response tokens: ``ppo.lm_head=response`` leaves 0 at the padding)."""
    a_exp, a_actor, a_critic = a
    b_exp, b_actor, b_critic = b
    assert torch.equal(a_exp.sequences, b_exp.sequences)
    on = a_exp.mask.bool()
    for key in SCORED:
        got, want = getattr(b_exp, key), getattr(a_exp, key)
        if key.endswith("logprobs"):
            got, want = got[on], want[on]
        scale = max(1.0, float(want.abs().max()))
        assert float((got - want).abs().max()) <= TOL * scale, key
    assert len(b_actor) == len(a_actor) == 4
    for got, want in zip(b_actor + b_critic, a_actor + a_critic, strict=True):
        assert got.keys() == want.keys()
        assert rel(got, want) <= TOL, rel(got, want)


@pytest.mark.parametrize("max_tokens, busier", [(0, False), (8, True)])
def test_lm_head_over_the_response_alone_scores_and_updates_alike(reference, max_tokens, busier):
    """ppo.lm_head=response (the logits of the response tokens alone, in the scoring and update
    forwards) gives ``all``'s numbers: row-count and token-budget micro-batches, stand-in rows."""
    mesh = BusierPeer() if busier else None
    same_step(reference, run(max_tokens, update_mesh=mesh, lm_head="response"))


def test_lm_head_over_the_response_alone_with_gkd():
    """GKD's divergence to the teacher over the response tokens alone: the gradients of ``all``."""
    same_step(run(0, gkd=True), run(0, gkd=True, lm_head="response"))
