"""``python -m rlhf.generate --tools``' episodes, scripted: a fake policy that calls the calculator
and then answers drives the stage's EpisodeRunner and ToolEnv (through ``environment``, as the stage
builds them), and the conversation rlhf.generate prints is the one the policy saw. (A random model
rarely writes a valid call; the CLI tests are in test_generate_eval.py.)"""

import contextlib
import json
from types import SimpleNamespace

import torch

from rlhf.engine.infer import finish, left_pad
from rlhf.engine.mesh import Mesh
from rlhf.envs.toolcalls import ToolCall, format_call
from rlhf.generate import as_example, play_episodes, print_episodes, tool_environment
from rlhf.ops import SamplingParams
from rlhf.rl.episodes import EpisodeRunner

PAD, BOS, EOS = 0, 1, 2
CALL = format_call(ToolCall("calculator", {"expression": "6*7"}))
ANSWER = "The answer is 42."


class ByteTok:
    """Characters as ids (round trip), with the embedded task's kind of template: tools 'Tools:
    names\\n', user 'Q: ..\\nA:', assistant ' ..</s>', tool 'R: ..\\nA:'."""

    eos_token, pad_token_id, eos_token_id, bos_token_id = "</s>", PAD, EOS, BOS

    def __call__(self, text, add_special_tokens=True):
        def enc(t):
            ids = [BOS] if add_special_tokens else []
            for k, part in enumerate(t.split(self.eos_token)):
                if k:
                    ids.append(EOS)
                ids += [3 + ord(c) for c in part]
            return ids

        if isinstance(text, list):
            return {"input_ids": [enc(t) for t in text]}
        return {"input_ids": enc(text)}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 3) for i in ids if i > EOS)

    def batch_decode(self, rows, skip_special_tokens=True):
        return [self.decode(r) for r in rows]

    def apply_chat_template(
        self, turns, chat_template=None, tools=None, tokenize=False, add_generation_prompt=False
    ):
        head = ""
        if tools:
            head = "Tools: " + ", ".join(t["function"]["name"] for t in tools) + "\n"
        roles = {"user": "Q: {}\nA:", "assistant": " {}</s>", "tool": "R: {}\nA:"}
        return head + "".join(
            roles[m["role"]].format(m["content"]) for m in turns if m["role"] in roles
        )


class ScriptedPolicy:
    """A hybrid engine whose policy calls the calculator on a question and answers after a result;
    it records the prompts it is given."""

    positions = 0  # rotary: no position table to fit

    def __init__(self, tok):
        self.tok, self.prompts = tok, []

    @contextlib.contextmanager
    def holding(self):
        yield

    def generate(self, prompts, sp, keys=None):
        rows = [p for p in prompts for _ in range(sp.samples_per_prompt)]
        self.prompts += [self.tok.decode(p) for p in prompts]
        ids, mask = left_pad(rows, PAD)
        tokens = torch.full((len(rows), sp.max_new_tokens), PAD)
        for i, p in enumerate(rows):
            text = ANSWER if "R: " in self.tok.decode(p) else CALL
            out = self.tok(text, add_special_tokens=False)["input_ids"] + [EOS]
            tokens[i, : len(out)] = torch.tensor(out)
        return finish(ids, mask, tokens, torch.full(tokens.shape, -0.5), EOS, PAD)


def test_a_tool_call_runs_and_the_conversation_is_printed(capsys):
    tok = ByteTok()
    # the stage's environment: ToolEnv
    env_cfg, env = tool_environment("calculator", None, None, 128)
    runner = EpisodeRunner.of(env_cfg, env, tok, "template", Mesh())
    assert runner.multi_turn and env_cfg.max_turns == 4
    policy = ScriptedPolicy(tok)
    sp = SamplingParams(temperature=1.0, max_new_tokens=128, samples_per_prompt=2, seed=0)
    rows = play_episodes(policy, runner, tok, [as_example("What is 6 * 7?")], sp)

    # the prompt rendered with the tools; the second turn sees the call and the tool's result
    assert policy.prompts[0] == "Tools: calculator\nQ: What is 6 * 7?\nA:"
    assert policy.prompts[-1] == f"Tools: calculator\nQ: What is 6 * 7?\nA:{CALL}R: 42\nA:"
    turns = [
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "calculator", "content": "42"},
        {"role": "assistant", "content": ANSWER},
    ]
    expected = {
        "response": ANSWER,
        "tokens": len(CALL) + len(ANSWER) + 2,
        "finished": True,
        "turns": turns,
    }
    assert rows == [{**expected, "tool_calls": 1}] * 2

    print_episodes(["What is 6 * 7?"], rows, SimpleNamespace(n=2, text=False))
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert (
        [o["sample"] for o in out] == [0, 1]
        and out[0]["turns"] == turns
        and out[0]["prompt"] == "What is 6 * 7?"
    )
    print_episodes(["What is 6 * 7?"], rows[:1], SimpleNamespace(n=1, text=True))
    assert (
        capsys.readouterr().out == f"assistant: {CALL}\ntool[calculator]: 42\nassistant: {ANSWER}\n"
    )


def test_the_last_turn_ends_the_episode_with_its_call_unanswered():
    tok = ByteTok()
    env_cfg, env = tool_environment("calculator", 1, "hermes", 128)
    runner = EpisodeRunner.of(env_cfg, env, tok, "template", Mesh())
    # one turn: the call is the episode's last word
    assert not runner.multi_turn
    sp = SamplingParams(max_new_tokens=128)
    (row,) = play_episodes(ScriptedPolicy(tok), runner, tok, [as_example("What is 6 * 7?")], sp)
    assert row["turns"] == [{"role": "assistant", "content": CALL}] and row["response"] == CALL
