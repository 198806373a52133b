"""``token_logits`` / ``token_logprobs`` (PPO's ``ppo.lm_head=response``): the logits of the chosen
response tokens alone, through a packed and a padded forward, equal ``response_logprobs`` there
(fp32, 1e-6), 0 elsewhere; a mask with no token still runs a forward whose graph reaches the
weights."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import EngineConfig, TrainConfig
from rlhf.engine.logprobs import response_logprobs, spread, token_logits, token_logprobs
from rlhf.engine.mesh import Mesh
from rlhf.engine.train import TrainEngine
from tests.distributed.parity_worker import tiny_model

P, N = 5, 6  # prompt and response columns


def batch():
    """Left-padded prompts, right-padded responses: rows of 5, 3 and 4 prompt tokens."""
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, 61, (3, P + N), generator=g)
    att = torch.ones_like(seq)
    att[1, :2] = 0
    att[2, :1] = 0
    att[0, P + 4 :] = 0  # response of 4 tokens
    att[2, P + 2 :] = 0  # response of 2
    seq[att == 0] = 0
    return seq, att


@pytest.mark.parametrize("packing, keep", [(True, False), (False, False), (False, True)])
def test_token_logprobs_are_the_full_forwards_at_the_chosen_tokens(packing, keep):
    """``keep``: the padded forward's LM head over the response columns (``logits_to_keep``)."""
    engine = TrainEngine(
        tiny_model(seed=0), Mesh(), EngineConfig(precision="fp32", packing=packing), TrainConfig()
    )
    seq, att = batch()
    tokens = att[:, P:].bool()
    tokens[1, 0] = False  # a token the loss does not read: not computed
    ref = response_logprobs(engine.forward, seq, att, P, temperature=0.7)
    got = token_logprobs(engine.forward, seq, att, P, tokens, temperature=0.7, keep_logits=keep)
    assert (got - ref)[tokens].abs().max() <= 1e-6
    assert (got[~tokens] == 0).all()
    logits, sel = token_logits(engine.forward, seq, att, P, tokens, keep)
    assert torch.equal(sel, tokens) and logits.shape == (int(tokens.sum()), 61)
    if not packing:
        # positions before the kept columns cannot be asked for
        at = torch.zeros_like(att, dtype=torch.bool)
        at[0, 0] = True
        with pytest.raises(ValueError, match="before the logits_to_keep"):
            engine.forward(input_ids=seq, attention_mask=att, logits_at=at, logits_to_keep=N)


def test_no_token_still_runs_a_forward_that_reaches_the_weights():
    engine = TrainEngine(tiny_model(seed=0), Mesh(), EngineConfig(precision="fp32"), TrainConfig())
    seq, att = batch()
    logits, sel = token_logits(engine.forward, seq, att, P, torch.zeros(3, N))
    assert int(sel.sum()) == 1 and sel[0, 0] and logits.shape == (1, 61)
    (logits.sum() * 0).backward()
    assert all(p.grad is not None for p in engine.module.parameters() if p.requires_grad)


def test_spread_fills_and_carries_gradients():
    sel = torch.tensor([[True, False], [False, True]])
    values = torch.tensor([1.0, 2.0], requires_grad=True)
    fill = torch.full((2, 2), -5.0, requires_grad=True)
    out = spread(values, sel, fill)
    assert out.tolist() == [[1.0, -5.0], [-5.0, 2.0]]
    out.sum().backward()
    assert values.grad.tolist() == [1.0, 1.0] and fill.grad is None
