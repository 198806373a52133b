"""Data the way users have it, through the CLI: messages with a chat template (SFT → reward → PPO),
save_to_disk folders, column mapping, a BOM file, a separate held-out file; bad input exits 2."""

import gzip
import json

import pytest

from tests.conftest import run_cli

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def short_sft(run_dir, *extra):
    return [
        "stage=sft",
        f"run.dir={run_dir}",
        "train.max_steps=3",
        "train.global_batch=4",
        "train.save_every=0",
        "train.warmup_steps=0",
        "logger.progress=false",
        "data.eval_size=4",
        "eval.gold_prompts=4",
        "eval.gold_samples=1",
        "engine.precision=fp32",
        *extra,
    ]


def hh_turns(dialogue: str):
    """'\\n\\nHuman: …\\n\\nAssistant: …' as a list of {role, content} turns."""
    turns = []
    for part in dialogue.split("\n\nHuman: ")[1:]:
        human, *assistant = part.split("\n\nAssistant: ")
        turns.append({"role": "user", "content": human.strip()})
        turns += [{"role": "assistant", "content": a.strip()} for a in assistant]
    return turns


def messages_file(real_data, path, n=120):
    """HH-RLHF pairs as messages: chosen/rejected message lists sharing their turns but the last."""
    out = []
    with gzip.open(
        real_data / "hh-rlhf" / "harmless-base-test.jsonl.gz", "rt", encoding="utf-8"
    ) as f:
        for line in f:
            rec = json.loads(line)
            c, r = hh_turns(rec["chosen"]), hh_turns(rec["rejected"])
            ok = (
                len(c) == len(r)
                and c[:-1] == r[:-1]
                and c[-1]["role"] == "assistant"
                and c[-1] != r[-1]
                and all(t["content"] for t in c + r)
                and len(json.dumps(c)) < 600
            )
            if ok:
                out.append({"chosen": c, "rejected": r})
            if len(out) == n:
                break
    path.write_text("".join(json.dumps(x) + "\n" for x in out), encoding="utf-8")
    return path


def test_messages_sft_reward_ppo_with_a_chat_template(real_data, tmp_path):
    """HH-RLHF as messages, the embedded model given a ChatML template by data.chat_template: SFT
    exports the template with the tokenizer, reward and PPO pick it up (data.chat_template=auto)."""
    data = messages_file(real_data, tmp_path / "hh_messages.jsonl")
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    run = tmp_path / "run"
    common = [
        f"run.dir={run}",
        f"data.path={data}",
        "data.format=messages",
        "data.max_prompt_len=192",
        "data.max_response_len=128",
        "data.eval_size=8",
        "logger.progress=false",
        "train.save_every=0",
        "engine.precision=fp32",
    ]
    proc = run_cli(
        "stage=sft",
        *common,
        f"data.chat_template={template}",
        "train.max_steps=4",
        "train.global_batch=8",
        "train.warmup_steps=0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run / "sft" / "model")
    assert tok.chat_template == CHATML
    assert "eval/loss" in rows(run / "sft" / "metrics.jsonl")[-1]
    proc = run_cli("stage=reward", *common, "train.max_steps=3", "train.global_batch=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval/accuracy" in rows(run / "reward" / "metrics.jsonl")[-1]
    proc = run_cli(
        "stage=ppo",
        *common,
        "ppo.min_rm_accuracy=0",
        "train.max_steps=2",
        "ppo.prompts_per_step=4",
        "ppo.samples_per_prompt=2",
        "ppo.ppo_epochs=1",
        "ppo.minibatches_per_epoch=1",
        "ppo.max_new_tokens=8",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ppo_rows = rows(run / "ppo" / "metrics.jsonl")
    last = [r for r in ppo_rows if "reward/mean" in r][-1]
    assert last["step"] == 2
    # no gold rule on this data: the reward model's view of the held-out answers, at the start and
    # the end
    assert [r["step"] for r in ppo_rows if "eval/reward_greedy" in r] == [0, 2]
    assert AutoTokenizer.from_pretrained(run / "ppo" / "actor").chat_template == CHATML


def test_save_to_disk_folders_columns_and_bom(tmp_path):
    import datasets

    recs = [
        {
            "prompt": f"Q: What is {i:02d} + {i + 1:02d}?\nA:",
            "response": f" The answer is {2 * i + 1}.",
        }
        for i in range(40)
    ]
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(recs), "test": datasets.Dataset.from_list(recs[:8])}
    ).save_to_disk(str(tmp_path / "dd"))
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(
        json.dumps(
            [{"instruction": r["prompt"], "input": "", "output": r["response"]} for r in recs]
        )
    )
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in recs).encode())
    cases = {
        "dataset": [f"data.path={tmp_path / 'ds'}", "data.format=prompt_response"],
        "dataset_dict": [
            f"data.path={tmp_path / 'dd'}",
            "data.format=prompt_response",
            f"data.eval_path={tmp_path / 'dd'}",
            "data.eval_hf_split=test",
        ],
        "alpaca": [
            f"data.path={alpaca}",
            "data.format=prompt_response",
            "data.columns={prompt: instruction, response: output}",
        ],
        "bom": [f"data.path={bom}", "data.format=prompt_response"],
    }
    for name, extra in cases.items():
        proc = run_cli(*short_sft(tmp_path / name, *extra))
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        final = rows(tmp_path / name / "sft" / "metrics.jsonl")[-1]
        assert final["step"] == 3 and "eval/loss" in final, name
        assert "malformed" not in proc.stderr and "dataset_info.json" not in proc.stderr, name


@pytest.mark.slow  # ~17 s
def test_gsm8k_with_a_held_out_file(real_data, tmp_path):
    proc = run_cli(
        *short_sft(
            tmp_path,
            f"data.path={real_data / 'gsm8k/train.jsonl.gz'}",
            "data.format=gsm8k",
            f"data.eval_path={real_data / 'gsm8k/test.jsonl'}",
            "eval.max_new_tokens=8",
            "data.eval_size=8",
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "gsm8k:" in proc.stderr
        and "held out: gsm8k:" in proc.stderr
        and "test.jsonl" in proc.stderr
    )
    final = rows(tmp_path / "sft" / "metrics.jsonl")[-1]
    assert "gold/score" in final and "eval/loss" in final
    # the defaults fit GSM8K's answers with a real tokenizer; the embedded 512-token vocabulary
    # needs more, and the run says how many are cut and which key to raise
    assert "data.max_response_len=192" in proc.stderr and "raise those keys" in proc.stderr


@pytest.mark.parametrize(
    "case, extra, fragment",
    [
        (
            "unknown column",
            ["data.format=prompt_response", "data.columns={prompt: instruction, response: text}"],
            "alpaca.json[0]: record has no field 'text' (data.columns.response)",
        ),
        (
            "not a field",
            ["data.format=prompt_response", "data.columns={answer: output}"],
            "data.columns.answer='output' is invalid: 'answer' is not a field of "
            "data.format=prompt_response",
        ),
        (
            "missing split",
            ["data.format=prompt_response", "data.hf_split=validation"],
            "the DatasetDict has no split 'validation' (it has test, train): set data.hf_split",
        ),
        (
            "template file missing",
            ["data.format=prompt_response", "data.chat_template=no/such/template.jinja"],
            "data.chat_template=no/such/template.jinja: no such file",
        ),
        (
            "answers cut",
            ["data.format=gsm8k", "data.max_response_len=4"],
            "data.max_response_len=4 cuts the answer ('#### <number>') off every one of the",
        ),
    ],
)
def test_bad_data_settings_exit_2_with_one_line(tmp_path, case, extra, fragment):
    import datasets

    recs = [
        {
            "prompt": "p",
            "response": "r",
            "instruction": "i",
            "output": "o",
            "question": "How many?",
            "answer": "Two and two make four.\n#### 4",
        }
    ] * 20
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps(recs))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(recs), "test": datasets.Dataset.from_list(recs[:4])}
    ).save_to_disk(str(tmp_path / "dd"))
    path = tmp_path / "dd" if case == "missing split" else alpaca
    proc = run_cli(*short_sft(tmp_path / "run", f"data.path={path}", *extra), timeout=300)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("rlhf: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and fragment in lines[0], (
        case,
        proc.stderr[-2000:],
    )
    # stopped before writing anything
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
