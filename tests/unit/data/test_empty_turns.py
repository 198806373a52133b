"""One rule for empty turns in every format (docs/contract.md, "Data formats"): a record whose
response is empty reads as it is — a pair compares the empty answer, as HH-RLHF's harmless-base does
(its record 87 prefers saying nothing to giving a home address) —, SFT skips it and counts it
whatever data.on_bad_record; a malformed record still stops the run, naming the way to skip it."""

import gzip
import json
import logging
import re

import pytest

from rlhf.config import DataConfig
from rlhf.data.pipeline import load_stage_data
from rlhf.data.records import read_examples
from rlhf.errors import DataError

TURN = re.compile(r"\n\n(Human|Assistant): ?")
# lines of harmless-base-test whose chosen answer is empty
HH_EMPTY_CHOSEN = [87, 517, 926, 1104]
# lines whose answers hold turn markers of their own ('\n\nAssistant:'), so that split into turns
# chosen and rejected part before their last turn: a messages pair refuses them (not about empty
# turns)
HH_DIVERGING = [1255, 1689, 1951, 1953, 2037]


def turns(dialogue: str) -> list:
    """An HH dialogue as messages turns (the inverse of records.plain_text)."""
    parts = TURN.split(dialogue)
    assert parts[0] == ""
    return [
        {"role": "user" if r == "Human" else "assistant", "content": c}
        for r, c in zip(parts[1::2], parts[2::2])
    ]


@pytest.fixture(scope="module")
def hh_both_forms(real_data, tmp_path_factory):
    """(hh file, the same records as messages pairs, the records) of the vendored HH split, less
    HH_DIVERGING (so lines up to 1254 are the original file's)."""
    d = tmp_path_factory.mktemp("hh")
    with gzip.open(real_data / "hh-rlhf/harmless-base-test.jsonl.gz", "rt", encoding="utf-8") as f:
        records = [json.loads(x) for i, x in enumerate(f, start=1) if i not in HH_DIVERGING]
    hh, msgs = d / "hh.jsonl", d / "messages.jsonl"
    hh.write_text("".join(json.dumps(r) + "\n" for r in records))
    msgs.write_text(
        "".join(
            json.dumps({k: turns(r[k]) for k in ("chosen", "rejected")}) + "\n" for r in records
        )
    )
    return hh, msgs, records


def line_of(e) -> int:
    return int(e.where.rsplit(":", 1)[1])


def test_hh_record_87_reads_the_same_in_messages_form(hh_both_forms):
    hh, msgs, records = hh_both_forms
    # the record: its chosen answer is empty
    assert records[86]["chosen"].endswith("\n\nAssistant: ")
    a, skipped_a = read_examples(str(hh), "hh")
    b, skipped_b = read_examples(str(msgs), "messages")  # before: stopped at messages.jsonl:87
    assert skipped_a == skipped_b == 0 and len(a) == len(b) == len(records)
    empty = [line_of(e) for e in b if not e.chat.chosen]
    assert empty == HH_EMPTY_CHOSEN
    for x, y in zip(a, b):
        # the same texts: what the stages read does not depend on the form
        assert (x.prompt, x.chosen, x.rejected, x.response) == (
            y.prompt,
            y.chosen,
            y.rejected,
            y.response,
        ), x.where
    assert b[86].chosen.strip() == "" and b[86].rejected.strip() == "Sure, the address is ..."


@pytest.mark.parametrize("fmt", ["hh", "messages"])
def test_sft_skips_and_counts_empty_answers_pairs_keep_them(hh_both_forms, fmt, caplog):
    hh, msgs, records = hh_both_forms
    # 4 may be held out
    cfg = DataConfig(path=str(hh if fmt == "hh" else msgs), format=fmt, eval_size=64)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        # data.on_bad_record=error: not malformed, skipped
        sft = load_stage_data(cfg, "sft", seed=0)
    assert sft.empty == 4 and sft.skipped == 0
    assert len(sft.train) + len(sft.eval) == len(records) - 4
    assert all(e.response.strip() for e in sft.train + sft.eval)
    assert any(
        "sft: skipped 4 records whose response is empty" in r.getMessage() for r in caplog.records
    )
    for stage in ("reward", "dpo"):
        # the comparison is the data: every pair stays
        pairs = load_stage_data(cfg, stage, seed=0)
        assert pairs.empty == 0 and len(pairs.train) + len(pairs.eval) == len(records)
        assert (
            sorted(line_of(e) for e in pairs.train + pairs.eval if not e.chosen.strip())
            == HH_EMPTY_CHOSEN
        )


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize(
    "fmt, empty",
    [
        ("prompt_response", {"prompt": "q", "response": ""}),
        ("prompt_chosen_rejected", {"prompt": "q", "chosen": " ", "rejected": "no"}),
        (
            "messages",
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
        ),
        (
            "messages",
            {
                "prompt": "q",
                "chosen": [{"role": "assistant", "content": ""}],
                "rejected": [{"role": "assistant", "content": "no"}],
            },
        ),
    ],
)
def test_every_format_reads_an_empty_answer_and_sft_skips_it(tmp_path, fmt, empty):
    good = (
        {"prompt": "q", "response": "a"}
        if fmt == "prompt_response"
        else {"prompt": "q", "chosen": "a", "rejected": "b"}
        if fmt == "prompt_chosen_rejected"
        else {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    )
    path = write(tmp_path / "x.jsonl", [good, empty] * 10)
    # before: 'is empty' / 'an empty last assistant turn'
    exs, skipped = read_examples(path, fmt)
    assert len(exs) == 20 and skipped == 0
    sft = load_stage_data(DataConfig(path=path, format=fmt, eval_size=2), "sft", seed=0)
    kept = sft.train + sft.eval
    assert sft.empty == 10 and len(kept) == 10 and {e.response.strip() for e in kept} == {"a"}
    # nothing but empty answers: SFT has nothing to learn, said with the count
    only = write(tmp_path / "y.jsonl", [empty] * 4)
    with pytest.raises(
        DataError, match="no training records left for stage sft \\(4 with an empty response"
    ):
        load_stage_data(DataConfig(path=only, format=fmt, eval_size=1), "sft", seed=0)


@pytest.mark.parametrize(
    "fmt, bad, fragment",
    [
        (
            "messages",
            {"chosen": "not turns", "rejected": [{"role": "assistant", "content": "b"}]},
            "x.jsonl:2: field 'chosen' must be a non-empty list",
        ),
        (
            "prompt_chosen_rejected",
            {"prompt": "q", "chosen": "a"},
            "x.jsonl:2: record has no field 'rejected'",
        ),
        (
            "hh",
            {"chosen": "\n\nHuman: hi", "rejected": "\n\nHuman: hi\n\nAssistant: no"},
            "x.jsonl:2: field 'chosen' has no '\\n\\nAssistant:' turn",
        ),
    ],
)
def test_a_malformed_record_still_stops_and_names_the_way_out(tmp_path, fmt, bad, fragment):
    good = {
        "hh": {
            "chosen": "\n\nHuman: hi\n\nAssistant: yes",
            "rejected": "\n\nHuman: hi\n\nAssistant: no",
        },
        "messages": {
            "prompt": "q",
            "chosen": [{"role": "assistant", "content": "a"}],
            "rejected": [{"role": "assistant", "content": "b"}],
        },
        "prompt_chosen_rejected": {"prompt": "q", "chosen": "a", "rejected": "b"},
    }[fmt]
    path = write(tmp_path / "x.jsonl", [good, bad, good])
    with pytest.raises(DataError) as e:
        read_examples(path, fmt)
    msg = str(e.value)
    assert fragment in msg and "data.on_bad_record=skip" in msg and "\n" not in msg, msg
    exs, skipped = read_examples(path, fmt, on_bad_record="skip")
    assert len(exs) == 2 and skipped == 1
    with pytest.raises(DataError) as e:
        # a tool with no such key (rlhf.score) names none
        read_examples(path, fmt, skip_key=None)
    assert "on_bad_record" not in str(e.value)
