"""A data format is one row of rlhf/data/formats.py: adding one touches that table and one parse
function.

The toy format below (records ``{"q": ..., "a": ...}``) is added with nothing but its parser, its
gold scorer and a row in ``FORMATS``; configuration, default lengths, reading, the stage pipeline
and ``rlhf.rewards.gold`` all take it from there.
"""

import json

import pytest

from rlhf import rewards
from rlhf.compose import compose_config
from rlhf.config import DataConfig, SourceConfig
from rlhf.data.formats import FORMATS, Format
from rlhf.data.pipeline import load_stage_data
from rlhf.data.records import Example, read_examples
from rlhf.errors import ConfigError, DataError


def parse_toy(rec: dict, where: str) -> Example:
    for name in ("q", "a"):
        if not isinstance(rec.get(name), str):
            raise DataError(f"{where}: record has no string field '{name}'")
    return Example(
        prompt=f"Q: {rec['q']}\nA:", response=" " + rec["a"], reference=rec["a"], where=where
    )


def toy_gold(response: str, reference: str) -> float:
    return 1.0 if response.strip() == reference else 0.0


@pytest.fixture
def toy(monkeypatch, tmp_path):
    monkeypatch.setitem(
        FORMATS,
        "toy",
        Format("toy", fields=("q", "a"), lengths=(32, 16), parse=parse_toy, gold=toy_gold),
    )
    path = tmp_path / "toy.jsonl"
    path.write_text(
        "".join(json.dumps({"q": f"{i} twice?", "a": str(2 * i)}) + "\n" for i in range(40))
    )
    return str(path)


def test_a_new_format_is_one_row_and_one_parser(toy, tmp_path):
    # configuration: validated, its fields are what data.columns may map, its lengths the defaults
    dc = DataConfig(format="toy", path=toy)
    assert (dc.max_prompt_len, dc.max_response_len) == (None, None)
    assert (dc.resolve().max_prompt_len, dc.max_response_len) == (32, 16)
    # no number of its own: data.max_response_len
    assert dc.default_new_tokens() == 16
    with pytest.raises(
        ConfigError,
        match=r"^data.columns.question='x' is invalid: 'question' is not a field of "
        r"data.format=toy \(keys of data.columns are the format's fields: "
        r"one of q, a\)$",
    ):
        DataConfig(format="toy", path=toy, columns={"question": "x"})
    with pytest.raises(
        ConfigError, match=r"expected a file, directory or hub id for data.format=toy"
    ):
        SourceConfig(format="toy")
    with pytest.raises(
        ConfigError, match=r"data.format='nope' is invalid: expected one of synthetic, .*, toy$"
    ):
        DataConfig(format="nope")
    cfg, _ = compose_config([f"data.path={toy}", "data.format=toy"])
    assert (cfg.data.max_prompt_len, cfg.data.max_response_len, cfg.eval.max_new_tokens) == (
        32,
        16,
        16,
    )

    # reading: its parser, with data.columns applied first
    exs, skipped = read_examples(toy, "toy")
    assert (
        skipped == 0
        and len(exs) == 40
        and (exs[3].prompt, exs[3].response) == ("Q: 3 twice?\nA:", " 6")
    )
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text(json.dumps({"question": "1 twice?", "a": "2"}) + "\n")
    (ex,), _ = read_examples(str(renamed), "toy", columns={"q": "question"})
    assert ex.prompt == "Q: 1 twice?\nA:"

    # a stage's data: read, held out, split, and its gold scorer found
    sd = load_stage_data(
        DataConfig(format="toy", path=toy, eval_size=4, split="1,1,1"), "sft", seed=0
    )
    assert len(sd.eval) == 4 and sd.gold is toy_gold and sd.description == f"toy:{toy}"
    assert rewards.gold([" 6", " 7"], [exs[3], exs[3]], "toy") == [1.0, 0.0]


def test_the_table_is_the_one_list_of_formats():
    assert list(FORMATS) == [
        "synthetic",
        "prompt_response",
        "prompt_chosen_rejected",
        "hh",
        "gsm8k",
        "messages",
        "tool_arith",
        "arith",
    ]
    assert [n for n, f in FORMATS.items() if f.generated] == ["synthetic", "tool_arith", "arith"]
    # a generated format brings its generator and its tokenizer corpus; a read one neither
    assert all(
        (f.generate is not None and f.corpus is not None) == f.generated for f in FORMATS.values()
    )
    assert [n for n, f in FORMATS.items() if f.gold is not None] == [
        "synthetic",
        "gsm8k",
        "tool_arith",
        "arith",
    ]
    with pytest.raises(
        ConfigError, match=r"no rule for data.format=hh \(synthetic, gsm8k, tool_arith, arith\)$"
    ):
        rewards.gold([" a"], [Example(prompt="p")], "hh")
    # messages: data.columns.role/content name the keys inside each turn (its parser built from
    # them)
    assert FORMATS["messages"].parser({}) is FORMATS["messages"].parse
    assert FORMATS["messages"].parser({"role": "from"}) is not FORMATS["messages"].parse
