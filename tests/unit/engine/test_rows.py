"""rlhf/engine/rows.py: taking and joining a step's rows from the containers' fields."""

import torch

from rlhf.engine.infer import Generation
from rlhf.engine.rows import join, take
from rlhf.rl.episodes import Episodes, concat_episodes
from rlhf.rl.experience import Rollouts, concat_groups

PAD = 9


def generation(rows: int, prompt: int, response: int, seed: int, logprobs: bool = True):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(10, 50, (rows, prompt + response), generator=g)
    att = torch.ones(rows, prompt + response, dtype=torch.long)
    att[0, 0] = 0  # a left-padded prompt
    mask = torch.ones(rows, response)
    mask[-1, -1] = 0
    logp = -torch.rand(rows, response, generator=g) if logprobs else None
    versions = torch.full((rows, response), seed)
    return Generation(seq, att, mask, logp, prompt, {"generate_s": 1.0}, versions)


def episodes(gen: Generation, seed: int, turn_rewards: bool = True) -> Episodes:
    B, N = gen.response_mask.shape
    return Episodes(
        gen,
        [f"text {seed} {i}" for i in range(B)],
        torch.arange(B, dtype=torch.float32) + seed,
        torch.full((B, N), float(seed)) if turn_rewards else None,
        torch.zeros(B, dtype=torch.bool),
        {"rows": float(B), "env_s": float(seed)},
        [f"error {seed}"],
        [[{"role": "assistant", "content": str(i)}] for i in range(B)],
        [{"tool_calls": float(i)} for i in range(B)],
    )


def test_join_pads_prompts_left_and_responses_right():
    a, b = generation(2, 3, 4, seed=1), generation(3, 5, 2, seed=2, logprobs=False)
    out = join([a, b], pad_id=PAD)
    assert out.prompt_len == 5 and out.sequences.shape == (5, 9)
    # a's prompt moved right by 2 pad tokens, its response in place
    assert torch.equal(out.sequences[:2, :2], torch.full((2, 2), PAD))
    assert torch.equal(out.sequences[:2, 2:9], a.sequences)
    assert torch.equal(out.attention_mask[:2, :2], torch.zeros(2, 2, dtype=torch.long))
    # b's responses padded on the right
    assert torch.equal(out.sequences[2:, :7], b.sequences)
    assert torch.equal(out.sequences[2:, 7:], torch.full((3, 2), PAD))
    assert torch.equal(out.response_mask[2:, 2:], torch.zeros(3, 2))
    assert torch.equal(out.versions[2:, 2:], torch.full((3, 2), -1))
    assert out.logprobs is None  # not every batch has them
    assert out.timings == {"generate_s": 2.0}


def test_episodes_join_fills_missing_turn_rewards_and_keeps_each_rows_fields():
    a = episodes(generation(2, 3, 4, seed=1), seed=1)
    b = episodes(generation(2, 3, 2, seed=2), seed=2, turn_rewards=False)
    out = concat_episodes([a, b], PAD)
    assert torch.equal(out.turn_rewards[2:], torch.zeros(2, 4))
    assert torch.equal(out.turn_rewards[:2], a.turn_rewards)
    assert out.texts == a.texts + b.texts and out.row_counts == a.row_counts + b.row_counts
    assert out.errors == ["error 1", "error 2"]
    assert out.stats == {"rows": 4.0, "env_s": 2.0}  # summed; the longest time in the environment
    assert concat_episodes([a], PAD) is a
    none = concat_episodes([episodes(a.gen, 1, False), episodes(b.gen, 2, False)], PAD)
    assert none.turn_rewards is None


def test_taking_every_prompt_group_and_joining_them_is_the_batch():
    ep = episodes(generation(6, 3, 4, seed=3), seed=3)
    ro = Rollouts(ep, list("abcdef"), torch.arange(6.0), {"model": torch.arange(6.0) * 2})
    groups = [(ro, 2), (ro, 0), (ro, 1)]
    out = concat_groups(groups, samples_per_prompt=2, pad_id=PAD)
    order = torch.tensor([4, 5, 0, 1, 2, 3])
    assert torch.equal(out.gen.sequences, ep.gen.sequences[order])
    assert torch.equal(out.ep.turn_rewards, ep.turn_rewards[order])
    assert torch.equal(out.parts["model"], ro.parts["model"][order])
    assert out.examples == [ro.examples[int(i)] for i in order]
    assert out.gold is None and out.gen.timings == {} and out.ep.stats == {}
    picked = take(ro, torch.tensor([5, 0]))
    assert picked.examples == ["f", "a"] and torch.equal(picked.scores, torch.tensor([5.0, 0.0]))
    assert picked.ep.conversations == [ep.conversations[5], ep.conversations[0]]
    assert picked.ep.stats == ep.stats  # not per row: as it is
