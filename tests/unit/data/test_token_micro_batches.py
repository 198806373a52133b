"""Token-budget micro-batches (train.max_tokens_per_micro_batch, rlhf/data/sampler.py): every row
once, within the budget (a longer row alone), the agreed count on every rank, tokens spread
evenly."""

import random

import pytest

from rlhf.data import sampler
from rlhf.data.sampler import GlobalBatches, step_micro_batches, token_micro_batches
from rlhf.engine.mesh import Mesh


def _check(rows, lengths, budget, bins):
    tokens = dict(zip(rows, lengths))
    assert sorted(r for b in bins for r in b) == sorted(rows)  # every row exactly once
    for b in bins:
        assert len(b) <= 1 or sum(tokens[r] for r in b) <= budget, (b, budget)
        assert b == sorted(b, key=rows.index)  # a micro-batch keeps its rows' order


def test_random_lengths_fit_the_budget_in_the_fewest_longest_first_bins():
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(0, 24)
        rows = rng.sample(range(1000), n)
        lengths = [rng.randint(1, 80) for _ in rows]
        budget = rng.randint(10, 160)
        calls = []
        bins = token_micro_batches(
            rows, lengths, budget, lambda k, calls=calls: calls.append(k) or k
        )
        assert len(calls) == 1 and len(bins) == calls[0]  # one agreement, its count
        _check(rows, lengths, budget, bins)
        assert len(bins) >= max(-(-sum(x for x in lengths if x <= budget) // budget), 1)
        assert all(bins) or not rows


def test_agreed_count_above_a_ranks_own_is_kept_and_balanced():
    rng = random.Random(1)
    for _ in range(2000):
        n = rng.randint(1, 24)
        rows = list(range(n))
        lengths = [rng.randint(1, 60) for _ in rows]
        budget = rng.randint(20, 120)
        own = len(token_micro_batches(rows, lengths, budget, lambda k: k))
        count = rng.randint(own, n + 3)  # another rank needs more
        bins = token_micro_batches(rows, lengths, budget, lambda k, c=count: max(k, c))
        assert len(bins) == count
        _check(rows, lengths, budget, bins)
        # empty only when the rank has fewer rows
        assert sum(1 for b in bins if b) == min(n, count)
        loads = [sum(lengths[r] for r in b) for b in bins if b]
        if all(x <= budget for x in lengths) and count <= n:
            assert max(loads) - min(loads) <= max(lengths)  # longest first into the least filled


def test_a_row_over_the_budget_runs_alone():
    bins = token_micro_batches([7, 8, 9, 10], [50, 3, 4, 5], 10, lambda k: k)
    assert [7] in bins and len(bins) == 3
    _check([7, 8, 9, 10], [50, 3, 4, 5], 10, bins)


def test_even_spread_example():
    # 55 tokens, budget 20: 3 micro-batches of 19/18/18 tokens (longest first into the least filled)
    lengths = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    bins = token_micro_batches(list(range(10)), lengths, 20, lambda k: k)
    assert sorted(sum(lengths[r] for r in b) for b in bins) == [18, 18, 19]


def test_split_fallback_keeps_the_budget():
    lengths = [9, 8, 7, 3, 2, 1]
    bins = sampler._split([[0, 5], [1, 4], [2, 3]], lengths, 5)
    assert len(bins) == 5 and sorted(j for b in bins for j in b) == list(range(6))
    assert max(sum(lengths[j] for j in b) for b in bins) <= 10
    assert sampler._split([[0], [1]], lengths, 3)[-1] == []


@pytest.mark.parametrize("micro", [4, 2, 1])
def test_off_is_the_row_count_split_and_on_covers_the_step(micro):
    batches = GlobalBatches(40, 8, seed=3)
    tokens = [random.Random(i).randint(5, 30) for i in range(40)]
    for step in range(6):
        assert step_micro_batches(batches, step, Mesh(), micro, 0, tokens) == batches.micro_batches(
            step, 0, 1, micro
        )
        got = step_micro_batches(batches, step, Mesh(), micro, 50, tokens)
        assert sorted(r for b in got for r in b) == sorted(batches.global_indices(step))
        shares = [batches.rank_rows(step, r, 2) for r in range(2)]
        assert shares[0] + shares[1] == batches.global_indices(step)


def test_scoring_groups_come_back_in_row_order():
    import torch

    from rlhf.rl.minibatch import in_micro_batches, row_groups

    att = torch.tensor([[1] * n + [0] * (9 - n) for n in (9, 2, 7, 3, 5, 1)], device="cpu")
    values = torch.arange(6.0, device="cpu") * 10
    slices = row_groups(att, 4, 0, Mesh())
    assert slices == [slice(0, 4), slice(4, 8)]
    groups = row_groups(att, 4, 10, Mesh())
    assert [g.tolist() for g in groups] != [[0, 1, 2], [3, 4, 5]]  # not consecutive: reordered back
    assert sorted(i for g in groups for i in g.tolist()) == list(range(6))
    for gs in (slices, groups):
        assert torch.equal(in_micro_batches(lambda r: values[r], gs), values)
