"""rlhf/rl/sft_records.py: the SFT records inside PPO. PPO-ptx and GKD's dataset share draw batches
of their own seeded orders (one record table); GKD's divergence on the records is the token mean of
the generalised JSD at the response tokens alone, differentiable in the actor; the share keys are
checked."""

from types import SimpleNamespace

import pytest
import torch

from rlhf import seeding
from rlhf.config import AlgorithmConfig, Config, PPOConfig
from rlhf.engine.mesh import Mesh
from rlhf.errors import ConfigError
from rlhf.rl.sft_records import SftRecords
from rlhf.rl.update import Updater

V = 11


class TinyLM(torch.nn.Module):
    """Logits from the token and its position: enough to make every position's distribution
    differ."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(V, 8, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(32, 8, generator=g))
        self.out = torch.nn.Parameter(torch.randn(8, V, generator=g))

    def forward(self, input_ids, attention_mask, position_ids):
        h = torch.tanh(self.emb[input_ids] + self.pos[position_ids])
        return SimpleNamespace(logits=h @ self.out)


def records() -> SftRecords:
    # prompts of 2-4 tokens, responses of 1-5: 20 records
    g = torch.Generator().manual_seed(0)
    ids, prompt_lens = [], []
    for _ in range(20):
        p, r = (
            int(torch.randint(2, 5, (1,), generator=g)),
            int(torch.randint(1, 6, (1,), generator=g)),
        )
        ids.append(torch.randint(1, V, (p + r,), generator=g).tolist())
        prompt_lens.append(p)
    tok = SimpleNamespace(pad_token_id=0)
    return SftRecords({"ids": ids, "prompt_len": prompt_lens}, seed=3, tokenizer=tok, mesh=Mesh())


def test_ptx_and_gkd_draw_orders_of_their_own():
    recs = records()
    ptx, gkd = recs.batch(0, 6, seeding.PTX), recs.batch(0, 6, seeding.GKD_DATA)
    assert ptx["input_ids"].shape[0] == gkd["input_ids"].shape[0] == 6
    assert not torch.equal(ptx["labels"], gkd["labels"])
    # the same update draws the same records
    assert torch.equal(ptx["input_ids"], recs.batch(0, 6, seeding.PTX)["input_ids"])
    # labels: the responses alone
    row, plen = ptx["labels"][0], recs.cols["prompt_len"]
    assert (row[: min(plen)] == -100).all()


def jsd(p_logits, q_logits, beta):
    """GKD's generalised JSD between teacher P and student Q, directly (float64); at the ends
    the limits TRL names by β: 0 the forward KL(P ‖ Q), 1 the reverse KL(Q ‖ P)."""
    p, q = p_logits.double().softmax(-1), q_logits.double().softmax(-1)
    kl = lambda a, b: (a * (a.log() - b.log())).sum(-1)  # noqa: E731
    if beta in (0.0, 1.0):
        return kl(p, q) if beta == 0.0 else kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_dataset_divergence_is_the_token_mean_over_responses(beta):
    recs, actor, teacher = records(), TinyLM(1), TinyLM(2)
    alg = AlgorithmConfig(gkd_coef=1.0, gkd_beta=beta, gkd_data_share=0.5)
    up = Updater(
        SimpleNamespace(forward=actor, module=actor),
        None,
        alg,
        PPOConfig(),
        Mesh(),
        3,
        recs,
        None,
        teacher,
    )
    got = up.data_divergence(update=2, size=8)
    b = recs.batch(2, 8, seeding.GKD_DATA)
    pos = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = actor(b["input_ids"], b["attention_mask"], pos).logits[:, :-1]
        t = teacher(b["input_ids"], b["attention_mask"], pos).logits[:, :-1]
    targets = b["labels"][:, 1:] != -100
    want = jsd(t, a, beta)[targets].mean()
    assert float(got.detach()) == pytest.approx(float(want), rel=1e-5)
    # prompt and padding positions do not count: a different teacher there changes nothing
    got.backward()
    assert actor.out.grad.abs().sum() > 0 and teacher.out.grad is None


def test_the_share_needs_gkd_and_a_range():
    with pytest.raises(ConfigError, match=r"algorithm.gkd_data_share=0.5 .*algorithm.gkd_coef > 0"):
        Config(stage="ppo", algorithm=AlgorithmConfig(gkd_data_share=0.5))
    with pytest.raises(ConfigError, match=r"algorithm.gkd_data_share"):
        AlgorithmConfig(gkd_coef=1.0, gkd_data_share=1.5)
