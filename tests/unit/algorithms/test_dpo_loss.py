"""DPO / cDPO / IPO against numbers worked out by hand, and which tokens the log-probs sum over."""

import math

import pytest
import torch

from rlhf.algorithms.preference import dpo_loss, response_mask, sequence_logprobs

# One pair, β = 0.5: log π(y_w) = −1, log π(y_l) = −3, log π_ref(y_w) = −2, log π_ref(y_l) = −2.5.
# h = (−1 − (−3)) − (−2 − (−2.5)) = 2 − 0.5 = 1.5, β h = 0.75.
PAIR = dict(policy_chosen=-1.0, policy_rejected=-3.0, ref_chosen=-2.0, ref_rejected=-2.5)
BETA = 0.5
# sigmoid: −log σ(0.75) = log(1 + e^−0.75) = log(1.4723665527) = 0.3868710061
SIGMOID = 0.3868710061
# cDPO, ε = 0.1: 0.9 log(1 + e^−0.75) + 0.1 log(1 + e^0.75) = 0.3868710061 + 0.1 × 0.75 =
# 0.4618710061
CDPO = 0.4618710061
# IPO: (h − 1/(2β))² = (1.5 − 1)² = 0.25
IPO = 0.25
# implicit rewards: β (log π − log π_ref): chosen 0.5 × (−1 + 2) = 0.5, rejected 0.5 × (−3 + 2.5) =
# −0.25
REWARDS = (0.5, -0.25)


def _loss(kind, smoothing=0.0, sft_coef=0.0, **pair):
    t = {
        k: torch.tensor([v], dtype=torch.float64, requires_grad=k == "policy_chosen")
        for k, v in {**PAIR, **pair}.items()
    }
    losses, chosen, rejected = dpo_loss(
        t["policy_chosen"],
        t["policy_rejected"],
        t["ref_chosen"],
        t["ref_rejected"],
        BETA,
        kind,
        smoothing,
        sft_coef,
        chosen_tokens=torch.tensor([4]),
    )  # y_w: 4 tokens
    losses.sum().backward()
    return losses.item(), chosen.item(), rejected.item(), t["policy_chosen"].grad.item()


@pytest.mark.parametrize(
    "kind, smoothing, want, grad",
    [
        # d/dπ_w of −log σ(β h) = −β σ(−β h) = −0.5 × 0.3208213008 = −0.1604106504
        ("sigmoid", 0.0, SIGMOID, -0.1604106504),
        # −(1 − ε) β σ(−β h) + ε β σ(β h)
        #   = −0.9 × 0.5 × 0.3208213008 + 0.1 × 0.5 × 0.6791786992 = −0.1104106504
        ("sigmoid", 0.1, CDPO, -0.1104106504),
        # 2 (h − 1/(2β)) = 2 × 0.5 = 1.0
        ("ipo", 0.0, IPO, 1.0),
    ],
)
def test_golden_values(kind, smoothing, want, grad):
    loss, chosen, rejected, g = _loss(kind, smoothing)
    assert loss == pytest.approx(want, abs=1e-9)
    assert (chosen, rejected) == pytest.approx(REWARDS, abs=1e-12)
    assert g == pytest.approx(grad, abs=1e-9)


def test_rpo_adds_the_chosen_nll_per_token():
    # α = 0.5, y_w of 4 tokens with log π(y_w) = −1: + 0.5 × 1/4 = 0.125 → 0.3868710061 + 0.125
    loss, chosen, rejected, g = _loss("sigmoid", sft_coef=0.5)
    assert loss == pytest.approx(0.5118710061, abs=1e-9)
    assert (chosen, rejected) == pytest.approx(REWARDS, abs=1e-12)  # the rewards do not change
    assert g == pytest.approx(-0.1604106504 - 0.125, abs=1e-9)  # d/dπ_w of −α π_w / 4 = −0.125
    assert _loss("ipo", sft_coef=0.5)[0] == pytest.approx(0.25 + 0.125, abs=1e-12)


def test_a_pair_the_policy_gets_wrong():
    # log π = (−4, −1), log π_ref = (−3, −1): h = −3 − (−2) = −1, β h = −0.5
    pair = dict(policy_chosen=-4.0, policy_rejected=-1.0, ref_chosen=-3.0, ref_rejected=-1.0)
    assert _loss("sigmoid", **pair)[0] == pytest.approx(0.9740769842, abs=1e-9)  # log(1 + e^0.5)
    assert _loss("ipo", **pair)[0] == pytest.approx(4.0, abs=1e-12)  # (−1 − 1)²
    assert _loss("sigmoid", **pair)[1:3] == pytest.approx((-0.5, 0.0), abs=1e-12)


def test_policy_equal_to_reference_is_log_2_with_zero_rewards():
    x = torch.tensor([-7.0, -2.0])
    y = torch.tensor([-3.0, -9.0])
    losses, chosen, rejected = dpo_loss(x, y, x, y, beta=0.1)
    assert torch.allclose(losses, torch.full((2,), math.log(2.0)))
    assert chosen.eq(0).all() and rejected.eq(0).all()


def test_bad_arguments():
    x = torch.zeros(1)
    with pytest.raises(ValueError, match="unknown DPO loss"):
        dpo_loss(x, x, x, x, 0.1, "hinge")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, 0.1, "ipo", 0.1)
    with pytest.raises(ValueError, match="chosen_tokens"):
        dpo_loss(x, x, x, x, 0.1, sft_coef=1.0)


def test_response_mask_skips_prompt_and_padding_and_keeps_eos():
    # tokens [p p r r EOS pad]: prompt_len 2; the targets are tokens 1..5 (shifted by one)
    attention = torch.tensor([[1, 1, 1, 1, 1, 0]])
    mask = response_mask(attention, torch.tensor([2]))
    assert mask.tolist() == [[False, True, True, True, False]]  # targets p, r, r, EOS, pad
    # prompt and pad must not count
    token_lp = torch.tensor([[-100.0, -1.0, -2.0, -0.5, float("-inf")]])
    assert sequence_logprobs(token_lp, mask).item() == -3.5


def test_pair_logprobs_sum_response_tokens_only():
    """The stage's log-probs of a collated pair: prompt tokens, and padding, change nothing; the EOS
    counts."""
    from stages.dpo import chosen_tokens, collate, pair_logprobs

    # prompt [1, 5]; chosen response [6, EOS=2]; rejected response [7, 8, EOS]; pad 0; vocabulary 10
    cols = {"chosen": [[1, 5, 6, 2]], "rejected": [[1, 5, 7, 8, 2]], "prompt_len": [2]}
    batch = collate(cols, [0], pad=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6, 2, 0], [1, 5, 7, 8, 2]]
    # 6 and EOS: what dpo.sft_coef's NLL is per token of
    assert chosen_tokens(batch).tolist() == [2]

    class Out:
        def __init__(self, logits):
            self.logits = logits

    def run(logits):
        c, r = pair_logprobs(lambda **kw: Out(logits[kw["logits_at"]]), batch, torch.device("cpu"))
        return c.item(), r.item()

    # every token: log(1/10) = −2.302585093 (fp32 log-softmax: 1e-6)
    logits = torch.zeros(2, 5, 10)
    # chosen: 2 response tokens (6, EOS) = −4.605170186; rejected: 3 (7, 8, EOS) = −6.907755279
    assert run(logits) == pytest.approx((-4.605170186, -6.907755279), abs=1e-6)
    # the prediction of prompt token 5: not summed
    logits[:, 0, 5] = 50.0
    # predicts the chosen row's padding: not summed
    logits[0, 3, :] = torch.linspace(-9, 9, 10)
    logits[0, 4, :] = float("nan")  # after the last token: predicts nothing
    assert run(logits) == pytest.approx((-4.605170186, -6.907755279), abs=1e-6)
    # the chosen row's EOS: 3 − log(9 + e^3) = −0.370241038
    logits[0, 2, 2] = 3.0
    assert run(logits)[0] == pytest.approx(-2.302585093 - 0.370241038, abs=1e-6)
