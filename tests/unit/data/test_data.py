import gzip
import json

import pytest

from rlhf.config import DataConfig, SourceConfig, SyntheticConfig
from rlhf.data import synthetic
from rlhf.data.pipeline import blend, load_stage_data, split_share
from rlhf.data.records import Example, gsm8k_score, read_examples
from rlhf.data.tokenize import cached, collate_sft, tokenize_sft
from rlhf.data.tokenizer import train_tokenizer
from rlhf.engine.mesh import Mesh
from rlhf.errors import ConfigError, DataError


def write_jsonl(path, records, raw_lines=()):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return path


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(
        synthetic.tokenizer_corpus(SyntheticConfig()) + ["Question: hello\nAnswer: 42"], 400, 128
    )


def test_formats_parse(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "response": "r"}])
    (ex,), skipped = read_examples(str(f), "prompt_response")
    assert (ex.prompt, ex.response, skipped) == ("p", "r", 0)
    assert ex.where.endswith("a.jsonl:1")
    f = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "x"}])
    (ex,), _ = read_examples(str(f), "prompt_chosen_rejected")
    assert (ex.prompt, ex.chosen, ex.rejected, ex.response) == ("p", "c", "x", "c")
    hh = {
        "chosen": "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: ok?\n\nAssistant: sure",
        "rejected": "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: ok?\n\nAssistant: no",
    }
    f = write_jsonl(tmp_path / "c.jsonl", [hh])
    (ex,), _ = read_examples(str(f), "hh")
    assert ex.prompt == "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: ok?\n\nAssistant:"
    assert (ex.chosen, ex.rejected) == (" sure", " no")
    f = write_jsonl(tmp_path / "d.jsonl", [{"question": "2+2?", "answer": "It is 4.\n#### 4"}])
    (ex,), _ = read_examples(str(f), "gsm8k")
    assert ex.reference == "4" and ex.prompt.startswith("Question: 2+2?")


def test_gzip_and_json_array_and_directory(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    with gzip.open(d / "x.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    (d / "y.json").write_text(json.dumps([{"prompt": "c", "response": "d"}]))
    exs, _ = read_examples(str(d), "prompt_response")
    assert [e.prompt for e in exs] == ["a", "c"]


def test_parquet(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"prompt": "p", "response": "r"}] * 3).to_parquet(
        str(tmp_path / "x.parquet")
    )
    exs, _ = read_examples(str(tmp_path / "x.parquet"), "prompt_response")
    assert len(exs) == 3 and exs[2].where.endswith("[row 2]")


@pytest.mark.parametrize(
    "lines, fmt, fragment",
    [
        (
            ['{"prompt": "a", "response": "b"}', '{"prompt": "a", "resp'],
            "prompt_response",
            "x.jsonl:2: malformed JSON",
        ),
        (['{"prompt": "a"}'], "prompt_response", "x.jsonl:1: record has no field 'response'"),
        (
            ['{"prompt": "a", "response": 3}'],
            "prompt_response",
            "field 'response' must be a string",
        ),
        (['{"prompt": "  ", "response": "b"}'], "prompt_response", "field 'prompt' is empty"),
        (["[1, 2]"], "prompt_response", "expected a JSON object"),
        (['{"question": "q", "answer": "no number"}'], "gsm8k", "does not end in '#### <number>'"),
        (['{"chosen": "no turns", "rejected": "x"}'], "hh", "no '\\n\\nAssistant:' turn"),
        ([], "prompt_response", "no records"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, lines, fmt, fragment):
    f = write_jsonl(tmp_path / "x.jsonl", [], lines)
    with pytest.raises(DataError) as e:
        read_examples(str(f), fmt)
    assert fragment in str(e.value)


def test_non_utf8_and_skip_mode(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_bytes(
        b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff", "response": "b"}\nnot json\n'
        b'{"prompt": "c", "response": "d"}\n'
    )
    with pytest.raises(DataError, match=r"x.jsonl:2: not valid UTF-8"):
        read_examples(str(f), "prompt_response")
    exs, skipped = read_examples(str(f), "prompt_response", on_bad_record="skip")
    assert [e.prompt for e in exs] == ["a", "c"] and skipped == 2


def test_missing_path():
    with pytest.raises(DataError, match="no such file"):
        read_examples("./does/not/exist.jsonl", "prompt_response")


def test_split_shares_are_disjoint_and_cover(tmp_path):
    recs = [{"prompt": f"p{i}", "response": "r"} for i in range(1000)]
    f = write_jsonl(tmp_path / "x.jsonl", recs)
    dc = DataConfig(path=str(f), format="prompt_response", split="2,4,4", eval_size=50)
    parts = [load_stage_data(dc, s, seed=3) for s in ("sft", "reward", "ppo")]
    sets = [{e.prompt for e in p.train} for p in parts]
    assert [len(s) for s in sets] == [190, 380, 380]
    assert not (sets[0] & sets[1]) and not (sets[1] & sets[2]) and not (sets[0] & sets[2])
    held = {e.prompt for e in parts[0].eval}
    assert (
        len(held) == 50
        and held == {e.prompt for e in parts[2].eval}
        and not (held & set.union(*sets))
    )
    again = load_stage_data(dc, "sft", seed=3)
    assert [e.prompt for e in again.train] == [e.prompt for e in parts[0].train]
    assert split_share(10, [1, 1], 1) == slice(5, 10)


def test_blend_weights():
    a = [Example(prompt=f"a{i}") for i in range(100)]
    b = [Example(prompt=f"b{i}") for i in range(10)]
    out = blend([a, b], [1.0, 1.0], seed=0)
    assert len(out) == 110
    assert sum(e.prompt.startswith("b") for e in out) == 55  # the small source repeats to its share
    out = blend([a, b], [3.0, 1.0], seed=0)
    assert sum(e.prompt.startswith("a") for e in out) == 82


def test_blend_via_config(tmp_path):
    fa = write_jsonl(
        tmp_path / "a.jsonl", [{"prompt": f"a{i}", "response": "r"} for i in range(40)]
    )
    fb = write_jsonl(
        tmp_path / "b.jsonl",
        [{"prompt": f"b{i}", "chosen": "c", "rejected": "x"} for i in range(40)],
    )
    dc = DataConfig(
        sources=[
            SourceConfig(path=str(fa), format="prompt_response", weight=1),
            SourceConfig(path=str(fb), format="prompt_chosen_rejected", weight=3),
        ],
        eval_size=4,
    )
    sd = load_stage_data(dc, "sft", seed=0)
    assert len(sd.train) == 72 and sum(e.prompt.startswith("b") for e in sd.train) == 54
    assert sd.gold is None and len(sd.eval) == 8


def test_synthetic_task_is_deterministic_with_disjoint_held_out():
    cfg = SyntheticConfig(num_records=3000)
    tr1, ev1 = synthetic.generate(cfg, 256, seed=5)
    tr2, _ev2 = synthetic.generate(cfg, 256, seed=5)
    assert [(e.prompt, e.response) for e in tr1] == [(e.prompt, e.response) for e in tr2]
    assert len(ev1) == 256 and len({e.prompt for e in ev1}) == 256
    assert not ({e.prompt for e in ev1} & {e.prompt for e in tr1})
    right = sum(synthetic.gold_score(e.response, e.reference) for e in tr1) / len(tr1)
    assert abs(right - cfg.p_correct) < 0.03
    assert all(synthetic.gold_score(e.chosen, e.reference) == 1.0 for e in tr1[:100])
    assert all(synthetic.gold_score(e.rejected, e.reference) == 0.0 for e in tr1[:100])
    # zero-padded operands: equal-length prompts
    assert len({len(e.prompt) for e in tr1}) == 1


def test_synthetic_rejected_answers_cover_near_misses_digit_errors_doubled_digits_and_far_misses():
    """A quarter each: the reward model must see the carry mistakes (a tens digit wrong) and the
    stutters (a digit doubled or dropped) a sampling policy makes, not only near misses
    (docs/history.md: without them it scored n±10 like n, and 744 above 74)."""
    tr, _ = synthetic.generate(SyntheticConfig(num_records=8000), 256, seed=3)

    def indel(w: str, n: str) -> bool:  # one digit more or fewer
        long, short = (w, n) if len(w) > len(n) else (n, w)
        return len(long) == len(short) + 1 and any(
            long[:i] + long[i + 1 :] == short for i in range(len(long))
        )

    kinds = {"near": 0, "digit": 0, "length": 0, "far": 0}
    for e in tr:
        n, w = int(e.reference), int(synthetic.ANSWER.match(e.rejected).group(1))
        assert w != n and w >= 0
        same_len = len(str(w)) == len(str(n))
        if abs(w - n) <= 3:
            kinds["near"] += 1
        elif same_len and sum(a != b for a, b in zip(str(w), str(n))) == 1:
            kinds["digit"] += 1
        elif indel(str(w), str(n)):
            kinds["length"] += 1
        else:
            assert 4 <= abs(w - n) <= 15, (n, w)
            kinds["far"] += 1
    share = {k: v / len(tr) for k, v in kinds.items()}
    # an answer of two kinds counts once, in the first (e.g. 10 → 1 is a dropped digit and off by 9)
    assert (
        share["near"] > 0.25
        and share["digit"] > 0.15
        and share["length"] > 0.15
        and share["far"] > 0.08
    ), share
    doubled = sum(str(e.reference) + str(e.reference)[-1] in e.rejected for e in tr) / len(tr)
    # 74 → 744: the hack PPO found (docs/history.md)
    assert doubled > 0.03, doubled
    tens = sum(
        abs(int(synthetic.ANSWER.match(e.rejected).group(1)) - int(e.reference)) % 10 == 0
        for e in tr
    ) / len(tr)
    assert tens > 0.1, tens  # n ± 10, 20, …: the carry mistakes


def test_synthetic_rejected_kinds_leave_a_blind_spot_and_refuse_unknown_ones():
    """data.synthetic.rejected_kinds: the pairs of a reward model with a blind spot (docs/ppo.md);
    the prompts, SFT responses and chosen answers stay the default's, and the default draws every
    kind."""
    full, _ = synthetic.generate(SyntheticConfig(num_records=4000), 64, seed=3)
    no_digit = SyntheticConfig(num_records=4000, rejected_kinds=["near", "length", "far"])
    blind, _ = synthetic.generate(no_digit, 64, seed=3)
    assert [(e.prompt, e.response, e.chosen) for e in blind] == [
        (e.prompt, e.response, e.chosen) for e in full
    ]

    def digit_errors(tr) -> float:
        # same length, more than 15 off: only a replaced digit does that
        pairs = [(int(e.reference), int(synthetic.ANSWER.match(e.rejected).group(1))) for e in tr]
        return sum(len(str(w)) == len(str(n)) and abs(w - n) > 15 for n, w in pairs) / len(pairs)

    assert digit_errors(full) > 0.05 and digit_errors(blind) == 0.0
    assert SyntheticConfig().rejected_kinds == ["near", "digit", "length", "far"]
    # the default's draws pinned (they are the code's before the kinds became a table: every figure
    # stands)
    first = [e.rejected for e in full[:8]]
    assert first == [f" The answer is {n}." for n in (911, 42, 38, 18, 42, 37, 3, 61)]
    for bad in ([], ["near", "near"], ["near", "carry"]):
        with pytest.raises(ConfigError, match=r"data\.synthetic\.rejected_kinds"):
            SyntheticConfig(rejected_kinds=bad)


def test_the_data_digest_is_what_the_stage_reads_of_its_records():
    """A run's fingerprint (rlhf/runtime/stage.py) holds StageData.digest: another seed or generator
    setting that changes what a stage reads is other data (its checkpoints are not resumed); one
    that changes only fields the stage does not read (the rejected answers, for SFT and PPO) is
    not."""

    def digests(run_seed=0, **synth):
        dc = DataConfig(synthetic=SyntheticConfig(num_records=600, **synth), eval_size=32)
        return {
            stage: load_stage_data(dc, stage, run_seed).digest()
            for stage in ("sft", "reward", "dpo", "ppo")
        }

    base = digests()
    # dpo reads what the reward stage reads
    assert base == digests() and len(set(base.values())) == 3
    blind = digests(rejected_kinds=["near", "far"])
    assert [blind[s] == base[s] for s in ("sft", "reward", "dpo", "ppo")] == [
        True,
        False,
        False,
        True,
    ]
    assert (
        digests(p_correct=0.5)["sft"] != base["sft"]
        and digests(p_correct=0.5)["ppo"] == base["ppo"]
    )
    other_seed = digests(run_seed=1)
    assert all(other_seed[s] != base[s] for s in base)
    # data.synthetic.seed fixes them
    assert digests(run_seed=1, seed=0) == digests(run_seed=2, seed=0)
    # the tool-use task: how many SFT answers call the calculator is what SFT reads, not PPO's
    # prompts
    tools = DataConfig(
        format="tool_arith", synthetic=SyntheticConfig(num_records=300), eval_size=16
    )
    more_calls = DataConfig(
        format="tool_arith", synthetic=SyntheticConfig(num_records=300, p_tool=0.9), eval_size=16
    )
    for stage, same in (("sft", False), ("ppo", True)):
        assert (
            load_stage_data(tools, stage, 0).digest()
            == load_stage_data(more_calls, stage, 0).digest()
        ) is same


def test_gold_scorers():
    assert synthetic.gold_score(" The answer is 48.", "48") == 1.0
    assert synthetic.gold_score(" The answer is 48. extra", "48") == 0.0
    assert synthetic.gold_score(" The answer is 47.", "48") == 0.0
    assert gsm8k_score("so 3 + 4 = 7\n#### 7", "7") == 1.0
    assert gsm8k_score("the result is\n#### 1,234", "1234") == 1.0
    assert gsm8k_score("the result is 1,234", "1234") == 0.0  # no '####': no final answer given
    assert gsm8k_score("#### 8", "7") == 0.0 and gsm8k_score("no number", "7") == 0.0


def test_tokenizer_properties(tok, tmp_path):
    assert tok.pad_token_id != tok.eos_token_id
    p = synthetic.prompt_text(3, 45, 2)
    assert (
        tok.apply_chat_template([{"role": "user", "content": "What is 03 + 45?"}], tokenize=False)
        == p
    )
    assert tok.decode(tok(p, add_special_tokens=False)["input_ids"]) == p
    text = "héllo — 😀 \u4e2d"
    # byte-level: no unknowns
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    digits = tok.tokenize(" 1234")
    assert [d for d in digits if d.strip("Ġ")] == ["1", "2", "3", "4"]


def test_truncation_and_prompt_masking(tok):
    ex = Example(prompt="Q: What is 03 + 45?\nA:", response=" The answer is 48.")
    full = tokenize_sft([ex], tok, max_prompt=64, max_response=64)
    ids, plen = full["ids"][0], full["prompt_len"][0]
    assert ids[-1] == tok.eos_token_id and ids[0] == tok.bos_token_id
    cut = tokenize_sft([ex], tok, max_prompt=4, max_response=3)
    # the prompt's end survives
    assert cut["prompt_len"][0] == 4 and cut["ids"][0][:4] == ids[plen - 4 : plen]
    assert cut["ids"][0][4:] == ids[plen : plen + 3]
    b = collate_sft([ids, ids[: plen + 2]], [plen, plen], tok.pad_token_id, mask_prompt=True)
    assert (b["labels"][0, :plen] == -100).all() and (
        b["labels"][0, plen:] == b["input_ids"][0, plen:]
    ).all()
    assert (b["labels"][1, plen + 2 :] == -100).all() and b["attention_mask"][1].sum() == plen + 2
    nomask = collate_sft([ids], [plen], tok.pad_token_id, mask_prompt=False)
    assert (nomask["labels"][0] == nomask["input_ids"][0]).all()


def test_cache_round_trip_and_key(tok, tmp_path):
    exs = [Example(prompt=f"Q: {i}", response=f" {i * 2}") for i in range(20)]
    calls = []

    def build():
        calls.append(1)
        return tokenize_sft(exs, tok, 64, 64)

    a = cached("sft", exs, tok, {"n": 1}, tmp_path, Mesh(), build)
    b = cached("sft", exs, tok, {"n": 1}, tmp_path, Mesh(), build)
    assert a == b == tokenize_sft(exs, tok, 64, 64) and len(calls) == 1
    cached("sft", exs[:-1], tok, {"n": 1}, tmp_path, Mesh(), build)  # content changed: rebuilt
    cached("sft", exs, tok, {"n": 2}, tmp_path, Mesh(), build)  # parameters changed: rebuilt
    assert len(calls) == 3


def test_a_byte_order_mark_is_not_data(tmp_path):
    """Files saved by Windows editors start with a UTF-8 BOM: the first record must still parse
    (and, with data.on_bad_record=skip, must not be silently lost)."""
    import json as _json

    recs = [{"prompt": "p1", "response": "r1"}, {"prompt": "p2", "response": "r2"}]
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + "\n".join(_json.dumps(r) for r in recs).encode())
    exs, skipped = read_examples(str(jsonl), "prompt_response")
    assert [e.prompt for e in exs] == ["p1", "p2"] and skipped == 0
    arr = tmp_path / "bom.json"
    arr.write_bytes(b"\xef\xbb\xbf" + _json.dumps(recs).encode())
    exs, _ = read_examples(str(arr), "prompt_response")
    assert [e.prompt for e in exs] == ["p1", "p2"]


# ---- issue 19: columns, save_to_disk folders, hub config/split, data.eval_path, lengths ----


def test_columns_map_a_dataset_onto_a_format(tmp_path):
    f = write_jsonl(
        tmp_path / "alpaca.jsonl",
        [{"instruction": f"i{k}", "output": f"o{k}", "input": ""} for k in range(3)],
    )
    exs, _ = read_examples(
        str(f), "prompt_response", columns={"prompt": "instruction", "response": "output"}
    )
    assert [(e.prompt, e.response) for e in exs] == [("i0", "o0"), ("i1", "o1"), ("i2", "o2")]
    with pytest.raises(
        DataError, match=r"alpaca.jsonl:1: record has no field 'text' \(data.columns.response\)"
    ):
        read_examples(
            str(f), "prompt_response", columns={"prompt": "instruction", "response": "text"}
        )
    from rlhf.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"data.columns.question='instruction' is invalid: 'question' is not a "
        r"field of data.format=prompt_response",
    ):
        DataConfig(path=str(f), format="prompt_response", columns={"question": "instruction"})
    with pytest.raises(ConfigError, match=r"data.sources\[\].columns.x="):
        DataConfig(sources=[SourceConfig(path=str(f), format="hh", columns={"x": "y"})])
    dc = DataConfig(
        path=str(f),
        format="prompt_response",
        columns={"prompt": "instruction", "response": "output"},
    )
    assert dc.source_list()[0].columns == {"prompt": "instruction", "response": "output"}


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    import datasets

    rows = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    exs, _ = read_examples(str(tmp_path / "ds"), "prompt_response")
    assert [e.prompt for e in exs] == [f"p{i}" for i in range(5)] and exs[4].where.endswith(
        "ds[row 4]"
    )
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:2])}
    ).save_to_disk(str(tmp_path / "dd"))
    assert len(read_examples(str(tmp_path / "dd"), "prompt_response")[0]) == 5
    exs, _ = read_examples(str(tmp_path / "dd"), "prompt_response", split="test")
    assert [e.prompt for e in exs] == ["p0", "p1"] and exs[1].where.endswith("dd[test][row 1]")
    with pytest.raises(
        DataError,
        match=r"data.path=.*dd: the DatasetDict has no split 'validation' \(it has "
        r"test, train\): set data.hf_split",
    ):
        read_examples(str(tmp_path / "dd"), "prompt_response", split="validation")
    # as a run sees them: the DatasetDict's test split as the held-out set
    dc = DataConfig(
        path=str(tmp_path / "dd"),
        format="prompt_response",
        eval_path=str(tmp_path / "dd"),
        eval_hf_split="test",
    )
    sd = load_stage_data(dc, "sft", seed=0)
    assert len(sd.train) == 5 and sorted(e.prompt for e in sd.eval) == ["p0", "p1"]
    assert "held out" in sd.description


def test_hub_ids_take_a_config_and_a_split(monkeypatch):
    import datasets

    # online: the library's own error is passed on
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    calls = []

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_list([{"question": "q", "answer": "a\n#### 3"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    exs, _ = read_examples("openai/gsm8k", "gsm8k", config="main", split="test")
    assert calls == [("openai/gsm8k", "main", "test")] and exs[0].reference == "3"
    assert exs[0].where == "openai/gsm8k[test][row 0]"
    dc = DataConfig(
        path="openai/gsm8k",
        format="gsm8k",
        hf_config="main",
        eval_path="openai/gsm8k",
        eval_hf_split="test",
    )
    load_stage_data(dc, "sft", seed=0)
    assert calls[1:] == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]

    def offline(name, config=None, split=None):
        raise ConnectionError("no network\nmore")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        DataError,
        match=r"^data.path=org/x \(data.hf_config=c\): not a local file or directory, "
        r"and loading it as a hub dataset \(split 'train'\) failed: no network$",
    ):
        read_examples("org/x", "gsm8k", config="c")


def test_eval_path_gives_the_held_out_set(tmp_path):
    train = write_jsonl(
        tmp_path / "train.jsonl",
        [{"question": f"q{i}", "answer": f"a\n#### {i}"} for i in range(50)],
    )
    test = write_jsonl(
        tmp_path / "test.jsonl",
        [{"question": f"t{i}", "answer": f"b\n#### {i}"} for i in range(30)],
    )
    dc = DataConfig(path=str(train), format="gsm8k", eval_path=str(test), eval_size=20)
    sd = load_stage_data(dc, "sft", seed=1)
    # nothing carved out of the training file
    assert len(sd.train) == 50 and len(sd.eval) == 20
    assert all(e.prompt.startswith("Question: t") for e in sd.eval) and sd.gold is not None
    assert [e.prompt for e in load_stage_data(dc, "ppo", seed=1).eval] == [
        e.prompt for e in sd.eval
    ]
    from rlhf.config import ConfigError

    with pytest.raises(ConfigError, match=r"data.eval_path=.* needs data.eval_format"):
        DataConfig(eval_path=str(test))
    with pytest.raises(
        ConfigError, match=r"data.eval_hf_split=test is set but data.eval_path is not"
    ):
        DataConfig(path=str(train), format="gsm8k", eval_hf_split="test")
    with pytest.raises(DataError, match=r"data.eval_path=.*nope.jsonl: no such file"):
        load_stage_data(
            DataConfig(path=str(train), format="gsm8k", eval_path=str(tmp_path / "nope.jsonl")),
            "sft",
            seed=1,
        )
    # a held-out file of another format: no shared gold scorer
    pairs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "response": "r"}] * 3)
    sd = load_stage_data(
        DataConfig(
            path=str(train), format="gsm8k", eval_path=str(pairs), eval_format="prompt_response"
        ),
        "sft",
        seed=1,
    )
    assert sd.gold is None and len(sd.eval) == 3


def test_default_lengths_per_format(tmp_path):
    from rlhf.compose import compose_config
    from rlhf.data.formats import FORMATS

    assert (DataConfig().resolve().max_prompt_len, DataConfig().resolve().max_response_len) == (
        64,
        64,
    )
    f = str(tmp_path / "x.jsonl")
    gsm = DataConfig(path=f, format="gsm8k").resolve()
    assert (gsm.max_prompt_len, gsm.max_response_len) == FORMATS["gsm8k"].lengths == (128, 192)
    assert DataConfig(path=f, format="hh", max_response_len=77).resolve().max_response_len == 77
    blend = DataConfig(
        sources=[SourceConfig(path=f, format="gsm8k"), SourceConfig(path=f, format="hh")]
    ).resolve()
    assert (blend.max_prompt_len, blend.max_response_len) == (384, 192)
    cfg, _ = compose_config([])
    assert (cfg.data.max_prompt_len, cfg.data.max_response_len, cfg.eval.max_new_tokens) == (
        64,
        64,
        16,
    )
    cfg, _ = compose_config([f"data.path={f}", "data.format=gsm8k"])
    assert (cfg.data.max_prompt_len, cfg.data.max_response_len) == (128, 192)
    assert cfg.eval.max_new_tokens == 192  # room to reach '####'
    cfg, _ = compose_config([f"data.path={f}", "data.format=gsm8k", "eval.max_new_tokens=8"])
    assert cfg.eval.max_new_tokens == 8


def test_length_warnings_and_nothing_to_learn(tok, tmp_path, caplog):
    import logging

    from rlhf.config import ConfigError
    from rlhf.data.tokenize import check_answer_budget, report_lengths, tokenize_pairs

    answers = [
        Example(
            prompt=f"Question: {'long ' * 10}{i}?\nAnswer:",
            response=f" so {i} + {i} is {2 * i}\n#### {2 * i}",
            answer=f"#### {2 * i}",
            reference=str(2 * i),
        )
        for i in range(10)
    ]
    params = {"max_prompt": 8, "max_response": 64}
    cols = tokenize_sft(answers, tok, 8, 64)
    n, prompt_cut, response_cut, with_answer, lost, p_p95, _ = cols["stats"]
    assert (n, prompt_cut, response_cut, with_answer, lost) == (10, 10, 0, 10, 0) and p_p95 > 8
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        report_lengths("sft", cols, params)
    assert (
        "of 10 records, 100% have their prompt cut to data.max_prompt_len=8 (95% fit in"
        in caplog.text
    )
    short = tokenize_sft(answers, tok, 64, 6)
    assert short["stats"][2:5] == [10, 10, 10]
    with pytest.raises(
        DataError,
        match=r"data.max_response_len=6 cuts the answer \('#### <number>'\) off every one "
        r"of the 10 responses that have one",
    ):
        report_lengths("sft", short, {"max_prompt": 64, "max_response": 6})
    with pytest.raises(
        ConfigError,
        match=r"ppo.max_new_tokens=4 is too short to reach an answer: the shortest of "
        r"the 10 reference responses needs \d+ tokens",
    ):
        check_answer_budget(answers, tok, 4, "ppo.max_new_tokens")
    check_answer_budget(answers, tok, 64, "ppo.max_new_tokens")
    pairs = tokenize_pairs(
        [
            Example(prompt="Q: 1", chosen=" a" * 10, rejected=" b"),
            Example(prompt="Q: 2", chosen=" a", rejected=" b"),
        ],
        tok,
        64,
        5,
    )
    assert pairs["stats"][:3] == [2, 0, 1] and len(pairs["chosen"]) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        report_lengths("pairs", pairs, {"max_prompt": 64, "max_response": 5})
    assert "50% are dropped, their response longer than data.max_response_len=5" in caplog.text
