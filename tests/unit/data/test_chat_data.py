"""The messages format and chat templates: parsing, rendering, the assistant-token mask."""

import json
import re

import pytest

from rlhf.config import DataConfig, SyntheticConfig
from rlhf.data import synthetic
from rlhf.data.chat import FALLBACK_TEMPLATE, Renderer, resolve_template
from rlhf.data.pipeline import load_stage_data
from rlhf.data.records import Example, plain_text, read_examples
from rlhf.data.tokenize import encode_prompts, tokenize_pairs, tokenize_prompts, tokenize_sft
from rlhf.data.tokenizer import train_tokenizer
from rlhf.errors import ConfigError, DataError

# A ChatML template (Qwen's form) for a tokenizer that has <|im_start|>/<|im_end|> as special
# tokens.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 03 + 45?"},
    {"role": "assistant", "content": "The answer is 48."},
    {"role": "user", "content": "And 10 + 20?"},
    {"role": "assistant", "content": "The answer is 30."},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok():
    texts = synthetic.tokenizer_corpus(SyntheticConfig()) + [
        json.dumps(MULTI),
        "Human: Assistant: Be brief.",
    ]
    return train_tokenizer(texts, 400, 128)


@pytest.fixture(scope="module")
def chatml_tok():
    t = train_tokenizer(
        synthetic.tokenizer_corpus(SyntheticConfig()) + [json.dumps(MULTI)], 400, 128
    )
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.eos_token = "<|im_end|>"
    t.chat_template = CHATML
    return t


def assistant_runs(tok, ids, mask):
    """The decoded text of each run of masked-in tokens."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=True).strip() for r in runs]


def test_messages_records_parse(tmp_path):
    f = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"messages": MULTI},
            {
                "chosen": MULTI[:4] + [{"role": "assistant", "content": "30."}],
                "rejected": MULTI[:4] + [{"role": "assistant", "content": "31."}],
            },
            {
                "prompt": "Hi?",
                "chosen": [{"role": "assistant", "content": "Hello."}],
                "rejected": [{"role": "assistant", "content": "Go away."}],
            },
            {"messages": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]},
        ][:3],
    )
    sft, pair, trl = read_examples(str(f), "messages")[0]
    assert sft.chat.prompt == MULTI[:4] and sft.chat.response == "The answer is 30."
    assert sft.prompt == plain_text(MULTI[:4]) and sft.response == " The answer is 30."
    assert sft.prompt.endswith("\n\nHuman: And 10 + 20?\n\nAssistant:") and sft.prompt.startswith(
        "Be brief."
    )
    assert pair.chat.prompt == MULTI[:4] and (pair.chat.chosen, pair.chat.rejected) == (
        "30.",
        "31.",
    )
    assert (pair.chosen, pair.rejected, pair.response) == (" 30.", " 31.", " 30.")
    assert (
        trl.chat.prompt == [{"role": "user", "content": "Hi?"}] and trl.chat.rejected == "Go away."
    )
    # ShareGPT's keys and role names through data.columns
    g = write_jsonl(
        tmp_path / "g.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": "Hi?"},
                    {"from": "gpt", "value": "Hello."},
                ]
            }
        ],
    )
    (ex,), _ = read_examples(
        str(g),
        "messages",
        columns={"messages": "conversations", "role": "from", "content": "value"},
    )
    assert ex.chat.prompt == [{"role": "user", "content": "Hi?"}] and ex.chat.response == "Hello."


@pytest.mark.parametrize(
    "record, fragment",
    [
        ({"messages": "hi"}, "field 'messages' must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, "field 'messages'[0] has no string 'content'"),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            "role='robot': expected system, user or assistant",
        ),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "no user turn"),
        # an empty answer is a record (tests/unit/data/test_empty_turns.py); a dropped last turn is
        # not
        (
            {
                "chosen": [{"role": "user", "content": "q"}],
                "rejected": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "b"},
                ],
            },
            "field 'chosen' has no last assistant turn",
        ),
        (
            {
                "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "rejected": [
                    {"role": "user", "content": "Q"},
                    {"role": "assistant", "content": "b"},
                ],
            },
            "must differ only in their last turn",
        ),
        (
            {
                "chosen": [{"role": "assistant", "content": "a"}],
                "rejected": [{"role": "assistant", "content": "b"}],
            },
            "share no turns and the record has no field 'prompt'",
        ),
        (
            {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "but no field 'rejected'",
        ),
        ({"text": "x"}, "record has no field 'messages'"),
    ],
)
def test_bad_messages_name_file_line_and_field(tmp_path, record, fragment):
    f = write_jsonl(tmp_path / "x.jsonl", [{"messages": MULTI}, record])
    with pytest.raises(DataError) as e:
        read_examples(str(f), "messages")
    assert "x.jsonl:2: " in str(e.value) and fragment in str(e.value), str(e.value)


def test_a_mapped_column_that_is_missing_is_named(tmp_path):
    f = write_jsonl(tmp_path / "x.jsonl", [{"msgs": MULTI}])
    with pytest.raises(
        DataError, match=r"x.jsonl:1: record has no field 'conversations' \(data.columns.messages\)"
    ):
        read_examples(str(f), "messages", columns={"messages": "conversations"})


def test_synthetic_task_through_the_embedded_template_is_token_identical(tok):
    """The default run goes through the chat-template path and must not change its numbers: the
    embedded template renders the synthetic record exactly as the plain text (ids, masks, pairs,
    prompts, truncation included)."""
    cfg = DataConfig(synthetic=SyntheticConfig(num_records=600))
    data = load_stage_data(cfg, "sft", seed=3)
    template = resolve_template(tok, "auto")
    assert template and tok("Q: x")["input_ids"][0] == tok.bos_token_id
    for lens in ((64, 64), (7, 8)):
        a, b = (
            tokenize_sft(data.train, tok, *lens, chat=template),
            tokenize_sft(data.train, tok, *lens),
        )
        assert (
            a["ids"] == b["ids"] and a["prompt_len"] == b["prompt_len"] and a["mask"] == b["mask"]
        )
        assert tokenize_pairs(data.train, tok, *lens, chat=template) == tokenize_pairs(
            data.train, tok, *lens
        )
    ids = encode_prompts(data.eval, tok, template)
    assert (
        ids
        == encode_prompts(data.eval, tok, None)
        == tok([e.prompt for e in data.eval])["input_ids"]
    )
    sft = tokenize_sft(data.train[:1], tok, 64, 64, chat=template)
    assert sft["ids"][0][-1] == tok.eos_token_id and sft["mask"][0] == [0] * sft["prompt_len"][
        0
    ] + [1] * (len(sft["ids"][0]) - sft["prompt_len"][0])


@pytest.mark.parametrize("which", ["embedded", "chatml", "fallback"])
def test_multi_turn_mask_covers_exactly_the_assistant_turns(tok, chatml_tok, which):
    t, template = {
        "embedded": (tok, tok.chat_template),
        "chatml": (chatml_tok, CHATML),
        "fallback": (tok, None),
    }[which]
    ex = Example(
        prompt=plain_text(MULTI[:4]),
        response=" " + MULTI[4]["content"],
        where="m:1",
        chat=read_examples.__globals__["Chat"](prompt=MULTI[:4], response=MULTI[4]["content"]),
    )
    cols = tokenize_sft([ex], t, 512, 512, chat=template)
    ids, mask = cols["ids"][0], cols["mask"][0]
    assert assistant_runs(t, ids, mask) == ["The answer is 48.", "The answer is 30."]
    # the whole sequence is the template's rendering of the conversation (the fallback: HH's text),
    # after the tokenizer's own BOS (the template writes none)
    text = t.decode(ids, skip_special_tokens=False)
    if which == "chatml":
        assert text == t.bos_token + t.apply_chat_template(MULTI, tokenize=False)
    elif which == "fallback":
        assert text == t.bos_token + plain_text(MULTI, generation_prompt=False) + t.eos_token
    else:
        assert (
            text
            == t.bos_token
            + "Be brief.\nQ: What is 03 + 45?\nA: The answer is 48.</s>Q: And 10 + 20?\nA: "
            "The answer is 30.</s>"
        )
    # the masked-out tokens are exactly the rest: system, user turns, markup
    # and the last turn ends with EOS (ChatML: <|im_end|> then a newline), learnt
    last = ids[cols["prompt_len"][0] :]
    assert t.eos_token_id in last and mask[-len(last) :] == [1] * len(last)
    # the prompt part is the PPO/gold prompt: the same tokens with the generation prompt
    prompt = encode_prompts([ex], t, template)[0]
    assert ids[: cols["prompt_len"][0]] == prompt
    # collate: labels only where the mask is 1
    from rlhf.data.tokenize import collate_sft

    b = collate_sft(cols["ids"], cols["prompt_len"], t.pad_token_id, True, cols["mask"])
    learnt = [i for i, lab in zip(ids, b["labels"][0].tolist()) if lab != -100]
    assert learnt == [i for i, m in zip(ids, mask) if m]
    assert (
        collate_sft(cols["ids"], cols["prompt_len"], t.pad_token_id, False, cols["mask"])["labels"][
            0
        ]
        != -100
    ).all()


def test_pairs_and_prompts_through_a_template(chatml_tok):
    ex = read_examples.__globals__["_message_pair"](
        {
            "chosen": MULTI[:4] + [{"role": "assistant", "content": "30."}],
            "rejected": MULTI[:4] + [{"role": "assistant", "content": "It is 31."}],
        },
        "p:1",
        ("role", "content"),
    )
    cols = tokenize_pairs([ex], chatml_tok, 512, 512, chat=CHATML)
    p = cols["prompt_len"][0]
    assert (
        cols["chosen"][0][:p]
        == cols["rejected"][0][:p]
        == encode_prompts([ex], chatml_tok, CHATML)[0]
    )
    tail = chatml_tok.decode(cols["rejected"][0][p:], skip_special_tokens=False)
    assert tail == "It is 31.<|im_end|>\n"
    prompt_text = chatml_tok.decode(tokenize_prompts([ex], chatml_tok, 512, CHATML)["prompt"][0])
    assert prompt_text.endswith("<|im_start|>user\nAnd 10 + 20?<|im_end|>\n<|im_start|>assistant\n")


def test_fallback_template_is_the_plain_text(tok):
    for turns in (MULTI[:2], MULTI[:4], MULTI[1:2]):
        assert tok.apply_chat_template(
            turns, chat_template=FALLBACK_TEMPLATE, tokenize=False, add_generation_prompt=True
        ) == plain_text(turns)


def test_template_setting(tok, tmp_path):
    import copy

    t = copy.deepcopy(tok)
    assert resolve_template(t, "none") is None and resolve_template(t, "auto") == t.chat_template
    f = tmp_path / "chatml.jinja"
    f.write_text(CHATML)
    # exported with the model
    assert resolve_template(t, str(f)) == CHATML and t.chat_template == CHATML
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(
        ConfigError, match=r"data.chat_template=.*bad.jinja: not a usable chat template"
    ):
        resolve_template(t, str(bad))
    with pytest.raises(ConfigError, match=r"data.chat_template=/no/such.jinja: no such file"):
        DataConfig(chat_template="/no/such.jinja")


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    # drops every assistant turn but the last one (as reasoning templates drop old thinking)
    rewriting = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    )
    with pytest.raises(
        DataError, match="m:1: the chat template does not render this conversation turn by turn"
    ):
        Renderer(tok, rewriting).encode([MULTI], ["m:1"])


def test_messages_pipeline_lengths_and_chat_view(tmp_path):
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": MULTI}] * 40)
    dc = DataConfig(path=str(f), format="messages")
    assert (dc.max_prompt_len, dc.max_response_len) == (None, None)
    assert (dc.resolve().max_prompt_len, dc.max_response_len) == (448, 192)
    data = load_stage_data(dc, "sft", seed=0)
    assert len(data.eval) == 4 and all(e.chat is not None for e in data.train)
    assert re.search(r"Human: And 10 \+ 20\?\n\nAssistant:$", data.train[0].prompt)


def test_conversations_without_a_template_are_said_to_become_plain_text(caplog):
    import logging
    from types import SimpleNamespace

    from rlhf.data.chat import resolve_template

    no_template = SimpleNamespace(chat_template=None)
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        assert (
            resolve_template(no_template, "auto", records=[SimpleNamespace(chat=None, prompt="x")])
            is None
        )
        assert not caplog.records  # plain-text records: nothing to say
        assert (
            resolve_template(
                no_template, "auto", records=[SimpleNamespace(chat=[{"role": "user"}])]
            )
            is None
        )
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(
        "data.chat_template=auto and the tokenizer has no chat template: the records' conversations"
    )
