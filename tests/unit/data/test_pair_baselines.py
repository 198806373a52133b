"""The reward model's text-only baselines (rlhf/data/pair_baselines.py) and PPO's held-out view by
the reward model (rlhf/runtime/evaluation.py: evaluate_reward's spread, lengths and kept
answers)."""

import math
import random

import torch

from rlhf.config import EvalConfig
from rlhf.data import pair_baselines
from rlhf.data.records import Example
from rlhf.engine.infer import Generation
from rlhf.engine.mesh import Mesh
from rlhf.runtime.evaluation import evaluate_reward


def _pair(chosen: str, rejected: str):
    return (chosen, rejected)


def test_longer_response_wins_with_ties_counted_half():
    pairs = [
        _pair(" long answer", " no"),
        _pair(" no", " long answer"),
        _pair(" same", " same"),
        _pair(" ab", " cd"),
    ]
    assert pair_baselines.length_accuracy(pairs) == (1 + 0 + 0.5 + 0.5) / 4
    assert math.isnan(pair_baselines.length_accuracy([]))


def test_bag_of_words_learns_the_words_that_decide_and_a_swap_flips_it():
    rng = random.Random(0)
    filler = ["the", "a", "cat", "dog", "runs", "sits", "here", "there", "now", "then"]

    def text(word):
        return " " + " ".join(rng.choices(filler, k=6) + [word] + rng.choices(filler, k=3))

    def pairs(n):
        # chosen says sorry, rejected says sure: words alone decide, length never
        return [_pair(text("sorry"), text("sure")) for _ in range(n)]

    train, held_out = pairs(80), pairs(40)
    assert pair_baselines.bag_of_words_accuracy(train, held_out) == 1.0
    swapped = [(r, c) for c, r in held_out]
    assert pair_baselines.bag_of_words_accuracy(train, swapped) == 0.0
    # no word it learnt: scores cancel
    unseen = [_pair(text("maybe"), text("perhaps")) for _ in range(10)]
    assert 0.0 < pair_baselines.bag_of_words_accuracy(train, unseen) < 1.0
    res = pair_baselines.baselines(train, held_out)
    assert list(res) == list(pair_baselines.KEYS) and res["eval/baseline_bag_of_words"] == 1.0
    assert "bag of words 1.0000" in pair_baselines.said(res) and pair_baselines.said({}) == ""


def test_the_pairs_are_the_tokenized_columns_decoded():
    """The baselines read the pairs the reward model reads: its columns' responses, special tokens
    out."""
    cols = {
        "chosen": [[1, 5, 6, 2], [1, 7, 2]],
        "rejected": [[1, 5, 7, 7, 2], [1, 6, 2]],
        "prompt_len": [2, 1],
    }
    assert pair_baselines.response_texts(cols, _Tok()) == [("w6", "w7 w7"), ("w7", "w6")]


class _Tok:
    pad_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[5] * len(t.split()) for t in texts]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids if not (skip_special_tokens and i in (1, 2)))


def test_held_out_reward_says_its_spread_and_lengths_and_keeps_the_first_answers():
    prompts = [Example(prompt=f"question {i}") for i in range(5)]
    lengths = [1, 2, 3, 4, 2]  # prompt i's answer: lengths[i] tokens

    def gen(encoded, sp):
        # one call (eval.batch_size 8 > 5 prompts): prompt i answers 7, 8, ... lengths[i] tokens
        assert len(encoded) == len(lengths)
        width = max(lengths)
        responses = torch.tensor([[7 + t for t in range(k)] + [0] * (width - k) for k in lengths])
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
        one = torch.ones(len(lengths), 1, dtype=torch.long)
        return Generation(torch.cat([one, responses], 1), torch.cat([one, mask], 1), mask, None, 1)

    def score(g):  # the reward: the answer's length
        return g.response_mask.sum(1).double()

    ecfg = EvalConfig(gold_prompts=5, batch_size=8, max_new_tokens=4)
    kept = []
    res, answers = evaluate_reward(gen, _Tok(), prompts, score, ecfg, Mesh(), kept=kept, show=2)
    mean = sum(lengths) / 5
    assert res["eval/reward_greedy"] == mean and res["eval/response_tokens_greedy"] == mean
    assert (
        abs(res["eval/reward_greedy_std"] - (sum((x - mean) ** 2 for x in lengths) / 5) ** 0.5)
        < 1e-12
    )
    assert [r for _, r in answers] == [float(x) for x in lengths]
    assert kept == [
        {
            "kind": "eval_reward",
            "index": 0,
            "prompt": "question 0",
            "response": "w7",
            "reward": 1.0,
            "tokens": 1,
        },
        {
            "kind": "eval_reward",
            "index": 1,
            "prompt": "question 1",
            "response": "w7 w8",
            "reward": 2.0,
            "tokens": 2,
        },
    ]
    # nothing kept: the same figures
    assert evaluate_reward(gen, _Tok(), prompts, score, ecfg, Mesh())[0] == res


def test_held_out_reward_of_samples_when_asked():
    """eval.reward_samples: the same prompts sampled that many times at eval.temperature, their
    reward's mean, spread and length beside the greedy view."""
    prompts = [Example(prompt=f"question {i}") for i in range(3)]
    seen = []

    def gen(encoded, sp, keys=None):
        seen.append((sp.temperature, sp.samples_per_prompt))
        rows = len(encoded) * sp.samples_per_prompt
        # row r answers r % 3 + 1 tokens
        lengths = [r % 3 + 1 for r in range(rows)]
        responses = torch.tensor([[7] * k + [0] * (3 - k) for k in lengths])
        mask = (torch.arange(3)[None] < torch.tensor(lengths)[:, None]).long()
        one = torch.ones(rows, 1, dtype=torch.long)
        return Generation(torch.cat([one, responses], 1), torch.cat([one, mask], 1), mask, None, 1)

    ecfg = EvalConfig(gold_prompts=3, batch_size=8, max_new_tokens=3, reward_samples=2)
    ecfg.temperature = 0.7
    res, _ = evaluate_reward(
        gen, _Tok(), prompts, lambda g: g.response_mask.sum(1).double(), ecfg, Mesh()
    )
    assert seen == [(0.0, 1), (0.7, 2)]
    # 6 rows: lengths 1, 2, 3, 1, 2, 3
    assert res["eval/reward_sampled"] == 2.0 and res["eval/response_tokens_sampled"] == 2.0
    assert abs(res["eval/reward_sampled_std"] - (2 / 3) ** 0.5) < 1e-12


def test_held_out_reward_even_rows_on_every_rank_when_asked():
    """``even`` (a micro-batched scorer's forwards are collective): a rank with fewer prompts in a
    batch generates stand-ins up to the longest rank's, and they are not counted."""
    prompts = [Example(prompt=f"question {i}") for i in range(3)]
    widths = []

    def gen(encoded, sp, keys=None):
        rows = len(encoded) * sp.samples_per_prompt
        widths.append(rows)
        mask = torch.ones(rows, 2, dtype=torch.long)
        one = torch.ones(rows, 1, dtype=torch.long)
        return Generation(torch.cat([one, mask * 7], 1), torch.cat([one, mask], 1), mask, None, 1)

    class Wider(Mesh):
        def max(self, x):  # (another rank holds 5 prompts of the batch)
            return max(x, 5)

    ecfg = EvalConfig(gold_prompts=3, batch_size=8, max_new_tokens=2, reward_samples=2)
    res, answers = evaluate_reward(
        gen, _Tok(), prompts, lambda g: g.response_mask.sum(1).double(), ecfg, Wider(), even=True
    )
    assert widths == [5, 10]  # greedy 5 prompts, sampled 5 × 2 rows
    assert len(answers) == 3 and res["eval/reward_greedy"] == 2.0
    assert res["eval/reward_sampled"] == 2.0 and res["eval/response_tokens_sampled"] == 2.0
