"""data.format=arith (rlhf/data/arith.py): arithmetic in words for pretrained chat models, its
exact-answer rule, its records and split, and data.synthetic.min_operand."""

import pytest

from rlhf.config import SyntheticConfig
from rlhf.data import arith
from rlhf.data.formats import FORMATS
from rlhf.errors import ConfigError
from rlhf.rewards import gold


@pytest.mark.parametrize(
    "response,score",
    [
        ("70", 1.0),
        ("34 + 36 = 70", 1.0),
        ("The answer is 70.", 1.0),
        ("34 + 36 = 108", 0.0),
        ("70 is wrong, it is 71", 0.0),  # the last number is the answer
        ("", 0.0),
        ("seventy", 0.0),
        # a comma that is no thousands separator leaves two numbers
        ("7,0", 0.0),
    ],
)
def test_gold_rule_reads_the_last_integer(response, score):
    assert arith.gold_score(response, "70") == score


def test_gold_rule_ignores_thousands_separators():
    assert arith.gold_score("1,234", "1234") == 1.0
    assert arith.final_number("-5 and 12,345,678") == "12345678"


def test_records_split_and_determinism():
    cfg = SyntheticConfig(num_records=500, min_operand=10, max_operand=49)
    train, held = arith.generate(cfg, 64, seed=3)
    again, _ = arith.generate(cfg, 64, seed=3)
    other, _ = arith.generate(cfg, 64, seed=4)
    assert [e.prompt for e in train] == [e.prompt for e in again]
    assert [e.prompt for e in train] != [e.prompt for e in other]
    assert len(train) == 500 and len(held) == 64 and len({e.prompt for e in held}) == 64
    # held-out pairs never trained on
    assert not {e.prompt for e in held} & {e.prompt for e in train}
    for e in train + held:
        q = e.chat.prompt[0]["content"]
        a, b = (int(x) for x in q.split("?")[0].removeprefix("What is ").split(" + "))
        assert 10 <= a <= 49 and 10 <= b <= 49 and e.reference == str(a + b)
        # through the model's own template
        assert q.endswith(arith.INSTRUCTION) and e.chat.needs_template
        assert e.chat.response == e.chat.chosen == e.reference and e.chat.rejected != e.reference
        assert (
            arith.gold_score(e.response, e.reference) == 1.0
            and arith.gold_score(e.rejected, e.reference) == 0.0
        )


def test_format_row_and_reward_function():
    row = FORMATS["arith"]
    assert row.generated and row.gold is arith.gold_score and row.new_tokens == 64
    _, held = arith.generate(
        SyntheticConfig(num_records=10, min_operand=10, max_operand=20), 8, seed=0
    )
    responses = [f"{e.reference}" for e in held[:4]] + ["0"] * 4
    assert gold(responses, held, "arith") == [1.0] * 4 + [0.0] * 4


@pytest.mark.parametrize("lo,hi", [(-1, 49), (49, 49), (60, 49)])
def test_min_operand_is_checked(lo, hi):
    with pytest.raises(ConfigError, match=r"data\.synthetic\.min_operand"):
        SyntheticConfig(min_operand=lo, max_operand=hi)


def test_samples_show_the_turns_the_model_reads():
    """samples.jsonl and the console show a record that goes through a chat template as its turns,
    not as the HH-style text the model never sees; a plain-text record as its text."""
    from rlhf.data.chat import shown_prompt
    from rlhf.data.records import Example

    e = arith.generate(SyntheticConfig(num_records=10, min_operand=10, max_operand=49), 4, 0)[0][0]
    question = e.chat.prompt[0]["content"]
    assert "Human:" in e.prompt
    assert shown_prompt(e, None) == shown_prompt(e, "{{ messages }}") == f"user: {question}"
    plain = Example(prompt="\n\nHuman: hi\n\nAssistant:")
    assert shown_prompt(plain, "{{ messages }}") == plain.prompt
