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


SCORE_WORDS = WORDS + ["Score:", "7", "3", "12", "</s>", "maybe"]


class ScoreTokenizer(WordTokenizer):
    """WordTokenizer over SCORE_WORDS, '</s>' its EOS."""

    eos_token_id = SCORE_WORDS.index("</s>")

    def encode(self, text, add_special_tokens=False):
        return [SCORE_WORDS.index(w) for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(SCORE_WORDS[i] for i in ids)


# each row's answer, told apart by its prompt's first word
SCRIPTS = {"x": ("Score:", "7", "</s>"), "y": ("maybe", "</s>"), "z": ("Score:", "12", "maybe") * 2}


class Writer:
    """Writes each row's script, a token a forward: the row is told apart by its first real token
    (x, y or z), its script read at the step its length says."""

    def __init__(self, prompt_len: int):
        self.prompt_len, self.steps = prompt_len, 0

    def forward(self, input_ids, attention_mask, position_ids, logits_at):
        self.steps += 1
        # logits asked for real tokens only (a packed forward refuses padding), finished rows' too
        assert attention_mask[logits_at].all(), attention_mask
        logits = torch.zeros(input_ids.shape[0], len(SCORE_WORDS))
        for b in range(input_ids.shape[0]):
            row = input_ids[b][attention_mask[b].bool()].tolist()
            script = SCRIPTS[SCORE_WORDS[row[0]]]
            step = len(row) - self.prompt_len
            word = script[step] if step < len(script) else "</s>"
            logits[b, SCORE_WORDS.index(word)] = 1.0
        return SimpleNamespace(logits=logits)


def test_the_score_form_parses_the_answer_and_counts_what_it_cannot_read():
    """x answers 'Score: 7' (0.7 of 0..10), y 'maybe' (no score: the failure reward, counted), z
    'Score: 12' (clipped to 1); the decoding stops once every row wrote its EOS or ran out."""
    model = Writer(prompt_len=2)
    judge = Judge(
        model,
        ScoreTokenizer(),
        "{prompt} {response}",
        ["Yes", "No"],
        16,
        "j",
        score=r"Score: (\d+)",
        score_range=[0, 10],
        max_new_tokens=4,
        failure_reward=-1.0,
    )
    examples = [Example(prompt=p) for p in ("x", "y", "z")]
    got = judge(["ok?", "ok?", "ok?"], examples, micro=0, device="cpu")
    assert torch.allclose(got, torch.tensor([0.7, -1.0, 1.0]))
    assert judge.failed.tolist() == [False, True, False]
    # z never writes its EOS: the 4-token answer length ends it
    assert model.steps == 4
    # verdicts are not read in the score form (none of them need be one token)
    Judge(model, ScoreTokenizer(), "{response}", ["two words", "No"], 16, "j", score=r"(\d)")


def test_a_score_pattern_without_a_group_is_one_line():
    from rlhf.config import PPOConfig

    with pytest.raises(
        ConfigError, match=r"ppo.judge_score_pattern='Score: .*needs a group around"
    ):
        PPOConfig(judge_score_pattern=r"Score: \d")
    with pytest.raises(ConfigError, match=r"ppo.judge_score_pattern='\(': not a regular"):
        PPOConfig(judge_score_pattern="(")
    with pytest.raises(ConfigError, match=r"ppo.judge_score_range"):
        PPOConfig(judge_score_range=[5, 5])
