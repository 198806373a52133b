"""The generative judge (rlhf/rl/judge.py): the template filled and rendered, rows left-padded and
cut from the left, the reward = P(first verdict) against the second from the next token's logits,
and the one-line refusals (a template without {response}, a verdict that is not one token)."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlhf.data.records import Example
from rlhf.errors import ConfigError
from rlhf.rl.judge import Judge, read_template, verdict_ids

WORDS = ["<pad>", "Yes", "No", "Q:", "A:", "ok?", "two", "words", "x", "y", "z", "[u]", "[a]"]


class WordTokenizer:
    """A word-level tokenizer (whitespace) with a chat template of its own when ``chat``."""

    pad_token_id = 0

    def __init__(self, chat: bool = False):
        self.chat_template = "{user}" if chat else None

    def encode(self, text, add_special_tokens=False):
        return [WORDS.index(w) for w in text.split()]

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [self.encode(t) for t in texts]}

    def apply_chat_template(self, turns, add_generation_prompt, tokenize):
        assert (
            add_generation_prompt
            and not tokenize
            and len(turns) == 1
            and turns[0]["role"] == "user"
        )
        return "[u] " + turns[0]["content"] + " [a]"


class LastTokenModel:
    """Logits at the asked positions: 'Yes' gets the row's last token id, 'No' 2.0 (the rest
    −inf)."""

    def __init__(self):
        self.calls = []

    def forward(self, input_ids, attention_mask, position_ids, logits_at):
        self.calls.append((input_ids, attention_mask, position_ids, logits_at))
        logits = torch.full((input_ids.shape[0], len(WORDS)), -float("inf"))
        logits[:, 1] = input_ids[:, -1].float()
        logits[:, 2] = 2.0
        return SimpleNamespace(logits=logits)


def test_the_reward_is_the_first_verdicts_probability_against_the_second(tmp_path):
    model = LastTokenModel()
    judge = Judge(model, WordTokenizer(), "Q: {prompt} A: {response} ok?", ["Yes", "No"], 4, "j")
    examples = [Example(prompt="x"), Example(prompt="y z")]
    got = judge(["two", "x words"], examples, micro=1, device="cpu")
    p = 1 / (1 + math.exp(2.0 - WORDS.index("ok?")))  # softmax over (Yes: 5, No: 2)
    assert torch.allclose(got, torch.tensor([p, p])) and judge.seconds > 0
    (ids1, _, pos1, at1), (ids2, _, _, _) = model.calls  # one forward a row (micro=1)
    # "Q: x A: two ok?": its last 4 tokens (judge_max_tokens)
    assert ids1.tolist() == [[8, 4, 6, 5]]
    assert ids2.tolist() == [[4, 8, 7, 5]]  # "Q: y z A: x words ok?"
    assert at1.tolist() == [[False] * (ids1.shape[1] - 1) + [True]] and pos1.tolist() == [
        list(range(ids1.shape[1]))
    ]
    # one forward: rows left-padded
    both = judge(["two", "x words"], examples, micro=0, device="cpu")
    assert model.calls[-1][0].tolist() == [[8, 4, 6, 5], [4, 8, 7, 5]]
    assert torch.equal(both, got)


def test_left_padding_and_the_chat_template():
    model = LastTokenModel()
    judge = Judge(model, WordTokenizer(chat=True), "{response} ok?", ["No", "Yes"], 16, "j")
    assert judge.text(Example(prompt="x"), "two words") == "[u] two words ok? [a]"
    judge(["two words", "x"], [Example(prompt="p")] * 2, micro=0, device="cpu")
    ids, mask, pos, _ = model.calls[-1]
    # pad: 0
    assert ids.tolist() == [[11, 6, 7, 5, 12], [0, 11, 8, 5, 12]] and mask[1].tolist() == [
        0,
        1,
        1,
        1,
        1,
    ]
    assert pos[1].tolist() == [0, 0, 1, 2, 3]  # positions counted over the real tokens
    assert judge.text(Example(prompt="x", reference=None), "y") == "[u] y ok? [a]"


def test_refusals_are_one_line(tmp_path):
    bad = tmp_path / "t.txt"
    bad.write_text("Is this good? {prompt}")
    with pytest.raises(
        ConfigError, match=r"ppo.judge_template=.*t.txt: the template has no \{response\}"
    ):
        read_template(str(bad))
    with pytest.raises(
        ConfigError, match=r"ppo.judge_template=.*nope.txt: cannot read the template"
    ):
        read_template(str(tmp_path / "nope.txt"))
    with pytest.raises(
        ConfigError,
        match=r"ppo.judge_verdicts: 'two words' is 2 tokens for the tokenizer of ppo.judge_path=j",
    ):
        verdict_ids(WordTokenizer(), ["Yes", "two words"], "j")
    assert verdict_ids(WordTokenizer(), ["Yes", "No"], "j") == [1, 2]
