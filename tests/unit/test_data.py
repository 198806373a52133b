import gzip
import json

import pytest

from rlhf.config import DataConfig, SourceConfig, SyntheticConfig
from rlhf.data import synthetic
from rlhf.data.gold import gsm8k_score
from rlhf.data.pipeline import blend, load_stage_data, split_share
from rlhf.data.records import Example, read_examples
from rlhf.data.tokenize import cached, collate_sft, tokenize_sft
from rlhf.data.tokenizer import train_tokenizer
from rlhf.engine.mesh import Mesh
from rlhf.errors import DataError


def write_jsonl(path, records, raw_lines=()):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return path


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(synthetic.tokenizer_corpus(SyntheticConfig()) + ["Question: hello\nAnswer: 42"],
                           400, 128)


def test_formats_parse(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "response": "r"}])
    (ex,), skipped = read_examples(str(f), "prompt_response")
    assert (ex.prompt, ex.response, skipped) == ("p", "r", 0)
    assert ex.where.endswith("a.jsonl:1")
    f = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "x"}])
    (ex,), _ = read_examples(str(f), "prompt_chosen_rejected")
    assert (ex.prompt, ex.chosen, ex.rejected, ex.response) == ("p", "c", "x", "c")
    hh = {"chosen": "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: ok?\n\nAssistant: sure",
          "rejected": "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: ok?\n\nAssistant: no"}
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
    datasets.Dataset.from_list([{"prompt": "p", "response": "r"}] * 3).to_parquet(str(tmp_path / "x.parquet"))
    exs, _ = read_examples(str(tmp_path / "x.parquet"), "prompt_response")
    assert len(exs) == 3 and exs[2].where.endswith("[row 2]")


@pytest.mark.parametrize("lines, fmt, fragment", [
    (['{"prompt": "a", "response": "b"}', '{"prompt": "a", "resp'], "prompt_response", "x.jsonl:2: malformed JSON"),
    (['{"prompt": "a"}'], "prompt_response", "x.jsonl:1: record has no field 'response'"),
    (['{"prompt": "a", "response": 3}'], "prompt_response", "field 'response' must be a string"),
    (['{"prompt": "  ", "response": "b"}'], "prompt_response", "field 'prompt' is empty"),
    (['[1, 2]'], "prompt_response", "expected a JSON object"),
    (['{"question": "q", "answer": "no number"}'], "gsm8k", "does not end in '#### <number>'"),
    (['{"chosen": "no turns", "rejected": "x"}'], "hh", "no '\\n\\nAssistant:' turn"),
    ([], "prompt_response", "no records"),
])
def test_bad_records_name_file_and_line(tmp_path, lines, fmt, fragment):
    f = write_jsonl(tmp_path / "x.jsonl", [], lines)
    with pytest.raises(DataError) as e:
        read_examples(str(f), fmt)
    assert fragment in str(e.value)


def test_non_utf8_and_skip_mode(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff", "response": "b"}\nnot json\n'
                  b'{"prompt": "c", "response": "d"}\n')
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
    assert len(held) == 50 and held == {e.prompt for e in parts[2].eval} and not (held & set.union(*sets))
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
    fa = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "response": "r"} for i in range(40)])
    fb = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "chosen": "c", "rejected": "x"} for i in range(40)])
    dc = DataConfig(sources=[SourceConfig(path=str(fa), format="prompt_response", weight=1),
                             SourceConfig(path=str(fb), format="prompt_chosen_rejected", weight=3)], eval_size=4)
    sd = load_stage_data(dc, "sft", seed=0)
    assert len(sd.train) == 72 and sum(e.prompt.startswith("b") for e in sd.train) == 54
    assert sd.gold is None and len(sd.eval) == 8


def test_synthetic_task_is_deterministic_with_disjoint_held_out():
    cfg = SyntheticConfig(num_records=3000)
    tr1, ev1 = synthetic.generate(cfg, 256, seed=5)
    tr2, ev2 = synthetic.generate(cfg, 256, seed=5)
    assert [(e.prompt, e.response) for e in tr1] == [(e.prompt, e.response) for e in tr2]
    assert len(ev1) == 256 and len({e.prompt for e in ev1}) == 256
    assert not ({e.prompt for e in ev1} & {e.prompt for e in tr1})
    right = sum(synthetic.gold_score(e.response, e.reference) for e in tr1) / len(tr1)
    assert abs(right - cfg.p_correct) < 0.03
    assert all(synthetic.gold_score(e.chosen, e.reference) == 1.0 for e in tr1[:100])
    assert all(synthetic.gold_score(e.rejected, e.reference) == 0.0 for e in tr1[:100])
    assert len({len(e.prompt) for e in tr1}) == 1  # zero-padded operands: equal-length prompts


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
    assert tok.apply_chat_template([{"role": "user", "content": "What is 03 + 45?"}], tokenize=False) == p
    assert tok.decode(tok(p, add_special_tokens=False)["input_ids"]) == p
    text = "héllo — 😀 \u4e2d"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # byte-level: no unknowns
    digits = tok.tokenize(" 1234")
    assert [d for d in digits if d.strip("Ġ")] == ["1", "2", "3", "4"]


def test_truncation_and_prompt_masking(tok):
    ex = Example(prompt="Q: What is 03 + 45?\nA:", response=" The answer is 48.")
    full = tokenize_sft([ex], tok, max_prompt=64, max_response=64)
    ids, plen = full["ids"][0], full["prompt_len"][0]
    assert ids[-1] == tok.eos_token_id and ids[0] == tok.bos_token_id
    cut = tokenize_sft([ex], tok, max_prompt=4, max_response=3)
    assert cut["prompt_len"][0] == 4 and cut["ids"][0][:4] == ids[plen - 4:plen]  # the prompt's end survives
    assert cut["ids"][0][4:] == ids[plen:plen + 3]
    b = collate_sft([ids, ids[:plen + 2]], [plen, plen], tok.pad_token_id, mask_prompt=True)
    assert (b["labels"][0, :plen] == -100).all() and (b["labels"][0, plen:] == b["input_ids"][0, plen:]).all()
    assert (b["labels"][1, plen + 2:] == -100).all() and b["attention_mask"][1].sum() == plen + 2
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
    """Files saved by Windows editors start with a UTF-8 BOM: the first record must still parse (and,
    with data.on_bad_record=skip, must not be silently lost)."""
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
