"""``python -m rlhf.score --jsonl`` reads pairs (and responses) in every format the stages read,
turns rendered through the model's chat template as the reward stage renders them."""

import json

import pytest
import torch

from rlhf import score

QUESTIONS = [("03 + 45", "48", "47"), ("10 + 20", "30", "31"), ("07 + 07", "14", "41")]


def user(q):
    return {"role": "user", "content": f"What is {q}?"}


def assistant(a):
    return {"role": "assistant", "content": f"The answer is {a}."}


FORMS = {  # the same pairs in each pair format
    "messages": [
        {"chosen": [user(q), assistant(c)], "rejected": [user(q), assistant(r)]}
        for q, c, r in QUESTIONS
    ],
    "messages_trl": [
        {"prompt": f"What is {q}?", "chosen": [assistant(c)], "rejected": [assistant(r)]}
        for q, c, r in QUESTIONS
    ],
    # the embedded template renders a user turn as the synthetic task's prompt ...
    "synthetic_text": [
        {
            "prompt": f"Q: What is {q}?\nA:",
            "chosen": f" The answer is {c}.",
            "rejected": f" The answer is {r}.",
        }
        for q, c, r in QUESTIONS
    ],
    # ... and no template as HH-RLHF's text
    "hh": [
        {
            "chosen": f"\n\nHuman: What is {q}?\n\nAssistant: The answer is {c}.",
            "rejected": f"\n\nHuman: What is {q}?\n\nAssistant: The answer is {r}.",
        }
        for q, c, r in QUESTIONS
    ],
}


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A tiny random reward model (one-label Llama classifier) saved with the embedded tokenizer and
    its chat template."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlhf.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("rm")
    tok = train_tokenizer([json.dumps(FORMS)] * 4, 300, 128)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        num_labels=1,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def run(capsys, model, records, tmp_path, *args):
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    score.main([str(model), "--jsonl", str(f), *args])
    return [json.loads(x) for x in capsys.readouterr().out.splitlines()]


def test_pairs_in_every_pair_format(reward_model, tmp_path, capsys):
    got = {form: run(capsys, reward_model, recs, tmp_path) for form, recs in FORMS.items()}
    plain = run(capsys, reward_model, FORMS["messages"], tmp_path, "--chat-template", "none")
    for form, lines in got.items():
        assert len(lines) == 4 and lines[-1]["pairs"] == 3, (form, lines)
    # before: messages pairs were read as hh (or prompt_chosen_rejected) text: exit 2
    # through the model's template
    assert got["messages"] == got["messages_trl"] == got["synthetic_text"]
    assert plain == got["hh"]  # no template: the plain (HH) rendering
    # the template counts
    assert [x["chosen"] for x in plain[:3]] != [x["chosen"] for x in got["messages"][:3]]


def test_responses_as_messages(reward_model, tmp_path, capsys):
    convs = [{"messages": [user(q), assistant(c)]} for q, c, _ in QUESTIONS]
    text = [
        {"prompt": f"Q: What is {q}?\nA:", "response": f" The answer is {c}."}
        for q, c, _ in QUESTIONS
    ]
    got = run(capsys, reward_model, convs, tmp_path)
    assert len(got) == 3 and got == run(capsys, reward_model, text, tmp_path)


@pytest.mark.parametrize(
    "records, fragment",
    [
        (
            [FORMS["messages"][0], {"messages": [user("1 + 1"), assistant("2")]}],
            "in.jsonl:2: not a preference pair",
        ),
        ([{"messages": [user("1 + 1")]}], "in.jsonl:1: no response to score"),
        (
            [{"chosen": [user("1 + 1"), assistant("2")], "rejected": "x"}],
            "in.jsonl:1: field 'rejected' must be a non-empty list",
        ),
    ],
)
def test_bad_files_exit_2_with_one_line(reward_model, tmp_path, capsys, records, fragment):
    with pytest.raises(SystemExit) as e:
        run(capsys, reward_model, records, tmp_path)
    err = capsys.readouterr().err
    assert e.value.code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
    assert "on_bad_record" not in err  # a stage's key: not this tool's
