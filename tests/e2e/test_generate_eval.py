"""python -m rlhf.generate and python -m rlhf.eval on a tiny SFT run's exported policy."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ENV, ROOT, quick_sft_args, run_cli


def cli(module, *args, stdin=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=ROOT,
        env=ENV,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_error_line(proc, prog):
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    return (
        proc.returncode == 2
        and len(lines) == 1
        and lines[0].startswith(f"python -m {prog}: error: ")
        and "Traceback" not in proc.stderr
    )


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gen") / "run"
    proc = run_cli(*quick_sft_args(run_dir, steps=40), "train.save_every=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


def test_generate_prompts_file_and_chat(sft_run, tmp_path):
    model = sft_run / "sft" / "model"
    proc = cli(
        "rlhf.generate",
        model,
        "--prompt",
        "What is 03 + 45?",
        "--prompt",
        "What is 10 + 20?",
        "--n",
        "2",
        "--max-new-tokens",
        "12",
        "--seed",
        "3",
        "--top-k",
        "50",
        "--top-p",
        "0.95",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [(o["prompt"], o["sample"]) for o in out] == [
        ("What is 03 + 45?", 0),
        ("What is 03 + 45?", 1),
        ("What is 10 + 20?", 0),
        ("What is 10 + 20?", 1),
    ]
    assert all(set(o) == {"prompt", "sample", "response", "tokens", "finished"} for o in out)
    assert all(0 < o["tokens"] <= 12 for o in out)
    # the embedded template makes the user turn the task's own prompt: the policy answers in its
    # form
    assert sum(o["response"].startswith(" The answer is") for o in out) >= 2, out

    # greedy: a file of prompts (JSONL with a text prompt and a conversation; a text file) and the
    # interactive chat all give the same answer to the same question
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        json.dumps({"prompt": "What is 03 + 45?"})
        + "\n"
        + json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "What is 03 + 45?"},
                    {"role": "assistant", "content": "x"},
                ]
            }
        )
        + "\n"
    )
    txt = tmp_path / "p.txt"
    txt.write_text("What is 03 + 45?\n\n")
    greedy = ("--temperature", "0", "--max-new-tokens", "12")
    proc = cli("rlhf.generate", model, "--file", jsonl, *greedy)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = [json.loads(x) for x in proc.stdout.splitlines()]
    assert (
        b["prompt"] == [{"role": "user", "content": "What is 03 + 45?"}]
        and a["response"] == b["response"]
    )
    proc = cli("rlhf.generate", model, "--file", txt, "--text", *greedy)
    assert proc.returncode == 0 and proc.stdout.splitlines() == [a["response"]], proc.stderr[-2000:]
    proc = cli(
        "rlhf.generate",
        model,
        "--chat",
        *greedy,
        stdin="What is 03 + 45?\n/reset\nWhat is 03 + 45?\nWhat is 10 + 20?\n/exit\nnever read\n",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    replies = proc.stdout.splitlines()
    assert len(replies) == 3 and replies[0] == replies[1] == a["response"].strip()


@pytest.mark.slow  # ~23 s
def test_generate_bad_input_exits_2(sft_run, tmp_path):
    model = sft_run / "sft" / "model"
    critic = tmp_path / "critic"
    critic.mkdir()
    (critic / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]})
    )
    for args, fragment in (
        ((tmp_path / "nope", "--prompt", "x"), "no such directory"),
        ((sft_run, "--prompt", "x"), "no config.json"),
        ((critic, "--prompt", "x"), "(a reward model or critic), not a policy"),
        ((model, "--file", tmp_path / "none.jsonl"), "--file"),
        ((model, "--prompt", "x", "--top-p", "0"), "--top-p=0.0 is invalid"),
        ((model, "--prompt", "x", "--chat-template", tmp_path / "t.jinja"), "--chat-template="),
    ):
        proc = cli("rlhf.generate", *args)
        assert one_error_line(proc, "rlhf.generate") and fragment in proc.stderr, (
            args,
            proc.stderr[-2000:],
        )


def test_eval_reproduces_the_stage_gold_score(sft_run, tmp_path):
    final = [json.loads(x) for x in (sft_run / "sft" / "metrics.jsonl").read_text().splitlines()][
        -1
    ]
    proc = cli(
        "rlhf.eval",
        sft_run / "sft" / "model",
        "--run-dir",
        sft_run,
        "eval.gold_prompts=16",
        "eval.gold_samples=1",
        "engine.precision=fp32",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    # the same held-out prompts, decoding and seeds as the stage: the same numbers
    assert (
        res["gold/score"] == final["gold/score"]
        and res["gold/score_greedy"] == final["gold/score_greedy"]
    )
    assert (res["prompts"], res["samples"], res["max_new_tokens"]) == (16, 1, 16)
    hh = tmp_path / "hh.jsonl"
    hh.write_text(
        json.dumps(
            {
                "chosen": "\n\nHuman: hi\n\nAssistant: yo",
                "rejected": "\n\nHuman: hi\n\nAssistant: no",
            }
        )
        + "\n"
    )
    for args, fragment in (
        ((sft_run,), "no config.json"),
        ((sft_run / "sft" / "model", f"data.path={hh}", "data.format=hh"), "has no gold scorer"),
        ((sft_run / "sft" / "model", "--run-dir", tmp_path / "nope"), "--run-dir"),
        ((sft_run / "sft" / "model", "data.max_step=3"), "data.max_step"),
    ):
        proc = cli("rlhf.eval", *args)
        assert one_error_line(proc, "rlhf.eval") and fragment in proc.stderr, (
            args,
            proc.stderr[-2000:],
        )


# the embedded task's turns, and tool results as 'R: ...' (a --chat-template file that renders
# tools)
TOOL_TEMPLATE = (
    "{% if tools %}Tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{{ "
    "'\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}Q: {{ m['content'] }}\nA:"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}R: {{ m['content'] }}\nA:"
    "{% endif %}{% endfor %}"
)


def test_generate_with_tools_prints_each_conversation(sft_run, tmp_path):
    model = sft_run / "sft" / "model"
    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    args = ("--max-new-tokens", "12", "--seed", "3", "--tools", "calculator")
    prompt = ("--prompt", "What is 03 + 45?")
    proc = cli(
        "rlhf.generate",
        model,
        *prompt,
        "--n",
        "2",
        "--max-turns",
        "3",
        "--chat-template",
        template,
        *args,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [o["sample"] for o in out] == [0, 1], out
    for o in out:
        assert list(o) == [
            "prompt",
            "sample",
            "response",
            "tokens",
            "finished",
            "turns",
            "tool_calls",
        ], o
        turns = o["turns"]
        # the policy's turns, the tools' results between them (a random policy rarely calls one)
        assert (
            1 <= sum(m["role"] == "assistant" for m in turns) <= 3
            and turns[0]["role"] == "assistant"
        ), o
        assert all(
            m["role"] == "assistant" or (m["role"] == "tool" and "name" in m) for m in turns
        ), o
        assert (
            turns[-1] == {"role": "assistant", "content": o["response"]} and 0 < o["tokens"] <= 36
        ), o
        assert o["tool_calls"] >= sum(m["role"] == "tool" for m in turns), o
    proc = cli("rlhf.generate", model, *prompt, "--text", *args)
    assert proc.returncode == 0 and proc.stdout.startswith("assistant: "), proc.stderr[-2000:]
    assert all(x.startswith(("assistant: ", "tool[")) for x in proc.stdout.splitlines() if x), (
        proc.stdout
    )
    proc = cli(
        "rlhf.generate", model, "--chat", *args, stdin="What is 03 + 45?\nWhat is 10 + 20?\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sum(x.startswith("assistant: ") for x in proc.stdout.splitlines()) >= 2, proc.stdout


def test_generate_with_bad_tools_exits_2(sft_run, tmp_path):
    model = sft_run / "sft" / "model"
    # renders no tool message: results could not reach the policy
    drops_tools = tmp_path / "no_tools.jinja"
    drops_tools.write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\nA:"
        "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}{% endif "
        "%}{% endfor %}"
    )
    for args, fragment in (
        (("--tools", "nosuch"), "--tools: 'nosuch' is not a built-in tool (calculator or python)"),
        (("--max-turns", "2"), "--max-turns and --tool-parser go with --tools"),
        (
            ("--tools", "calculator", "--tool-parser", "nope"),
            "--tool-parser=nope: not a built-in parser",
        ),
        (
            ("--tools", "calculator", "--chat-template", drops_tools),
            "does not render 'tool' messages",
        ),
    ):
        proc = cli("rlhf.generate", model, "--prompt", "x", *args)
        assert one_error_line(proc, "rlhf.generate") and fragment in proc.stderr, (
            args,
            proc.stderr[-2000:],
        )


def test_eval_with_tools_plays_episodes(sft_run):
    model = sft_run / "sft" / "model"
    small = ("eval.gold_prompts=4", "eval.gold_samples=1", "engine.precision=fp32")
    proc = cli(
        "rlhf.eval",
        model,
        "--run-dir",
        sft_run,
        "env.tools=[calculator]",
        "env.max_turns=2",
        *small,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    assert 0 <= res["gold/tool_use"] <= 1 and 0 <= res["gold/tool_use_greedy"] <= 1, res
    assert (res["env"], res["tools"], res["max_turns"], res["prompts"]) == (
        "tools",
        ["calculator"],
        2,
        4,
    ), res
    proc = cli("rlhf.eval", model, "env.tools=[nosuch]", *small)
    assert (
        one_error_line(proc, "rlhf.eval")
        and "env.tools: 'nosuch' is not a built-in tool" in proc.stderr
    ), proc.stderr[-2000:]
