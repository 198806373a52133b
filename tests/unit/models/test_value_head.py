"""Reward/critic head: padding invariance, head init, pairwise loss."""

import math

import torch

from rlhf.algorithms.preference import pairwise_loss
from rlhf.algorithms.tokens import last_index
from rlhf.models.value import ScalarHeadModel, init_head, sequence_scores


def tiny_rm(num_labels: int = 1):
    """A tiny random Llama sequence classifier, head initialised as the reward stage does (k labels:
    an ensemble of k members)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=num_labels,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    m = LlamaForSequenceClassification(cfg).eval()
    init_head(m)
    return m


def score(model, rows, left: bool):
    n = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(n - len(r), n) if left else slice(0, len(r))
        ids[i, sl], mask[i, sl] = torch.tensor(r), 1
    with torch.no_grad():
        return sequence_scores(ScalarHeadModel(model)(ids, mask), mask)


def test_scores_do_not_depend_on_padding():
    m = tiny_rm()
    chosen, rejected = [5, 6, 7, 8, 9, 2], [5, 6, 7, 11, 2]
    alone = torch.stack([score(m, [chosen], False)[0], score(m, [rejected], False)[0]])
    others = [[3] * 12, [4, 4, 4]]
    for left in (False, True):
        batch = score(m, [chosen, *others, rejected], left)
        assert torch.allclose(batch[[0, 3]], alone, atol=1e-5), (left, batch, alone)


def test_last_index_left_and_right():
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    # an empty row (a response of no token): 0
    assert last_index(mask).tolist() == [1, 3, 3, 0]


def test_head_init_statistics():
    m = tiny_rm()
    w = m.score.weight
    assert abs(w.std().item() - 1 / math.sqrt(33)) < 0.08
    assert getattr(m.score, "bias", None) is None or (m.score.bias == 0).all()


def test_pairwise_loss_values():
    c, r = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    assert torch.allclose(
        pairwise_loss(c, r), torch.tensor([math.log1p(math.exp(-2.0)), math.log(2.0)])
    )
    assert torch.allclose(pairwise_loss(c, r, margin=2.0)[0], torch.tensor(math.log(2.0)))


def test_values_are_a_new_tensor_not_a_view_and_their_gradient_is_right():
    """FSDP2 warns that a module returning a view can break backward (it did on 2 ranks): the head's
    output is its own tensor, with the gradient of the plain computation."""
    m = tiny_rm().train()
    ids = torch.randint(
        1, 50, (3, 7), generator=torch.Generator(device="cpu").manual_seed(0), device="cpu"
    )
    mask = torch.ones_like(ids)
    values = ScalarHeadModel(m)(ids, mask)
    assert values._base is None and values.shape == (3, 7)
    values.pow(2).sum().backward()
    head = m.score.weight
    got = head.grad.clone()
    head.grad = None
    hidden = m.model(input_ids=ids, attention_mask=mask).last_hidden_state
    (hidden @ head.t()).squeeze(-1).pow(2).sum().backward()  # the plain formula, as a reference
    assert torch.allclose(got, head.grad, atol=1e-6)
