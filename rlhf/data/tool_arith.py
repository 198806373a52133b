"""The embedded tool-use task (``data.format=tool_arith``): products the tiny model cannot compute
in its head, and a calculator tool that can.

Every record carries the calculator's schema as its tools (``Chat.tools``); the embedded template
names it on a first line, so the opening a rollout starts from renders as

    Tools: calculator\\nQ: What is 347 * 86?\\nA:

With probability ``data.synthetic.p_tool`` an SFT record calls the tool (Hermes-style), reads its
result (a ``tool`` turn) and answers with it:

    A: <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 86"}}</tool_call></s>
    R: 29842\\nA: The answer is 29842.</s>

otherwise it answers at once, rightly, with a product the model cannot learn to compute:

    A: The answer is 29842.</s>

so an SFT policy calls the tool in about ``p_tool`` of its samples and RL has room to find that
calling pays. The tool turns are ``Chat.tool_turns``: SFT trains on the assistant's call and answer,
never on the tool's result; PPO and gold prompts are the opening (``Chat.prompt``: the question
alone). Gold = exact final answer (``synthetic.gold_score``: ' The answer is 29842.'), ``reference``
the product. Operands: 3 digits × 2 digits whose product has 5 (``A_RANGE``, ``B_RANGE``); held-out
records use operand pairs no training record contains. Deterministic per seed. It has no preference
pairs: the reward stage and DPO refuse it.

``SyntheticConfig`` (``data.synthetic``, rlhf/config.py) appears in string annotations only.
"""

from __future__ import annotations

import json
import random
from typing import List, Optional, Tuple

from rlhf.data.records import Chat, Example, Turn
from rlhf.data.synthetic import answer_text

# 3-digit × 2-digit products, every one of 5 digits (300 × 34 = 10200 to 999 × 99 = 98901): the
# model cannot learn them in its head within the SFT budget (greedy answers after a forced " The
# answer is" right on 1-3 of 256 held-out prompts after the agentic recipe's SFT), while it learns
# to copy 5 digits into the call and 5 from the result. With 100..999 × 10..99 the 19% of 4-digit
# results were copied wrong (0 of 48 on one seed: the policy had learnt to copy 5 digits by
# position) while the 5-digit ones were right (208 of 208); conf/recipe_stage/agentic/sft.yaml has
# the numbers.
A_RANGE = (300, 999)
B_RANGE = (34, 99)

# the calculator's JSON schema (the form apply_chat_template's tools= takes); rlhf/envs/tools.py's
# tool
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
}
TOOLS = [CALCULATOR]


def question_text(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def expression(a: int, b: int) -> str:
    return f"{a} * {b}"


def tool_call_text(a: int, b: int) -> str:
    """The assistant's call, Hermes-style (rlhf/envs/toolcalls.format_call's string: json.dumps with
    its default separators)."""
    call = {"name": "calculator", "arguments": {"expression": expression(a, b)}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def prompt_text(a: int, b: int) -> str:
    """The opening as the embedded template renders it with the tools (Example.prompt)."""
    return f"Tools: calculator\nQ: {question_text(a, b)}\nA:"


def tool_turns(a: int, b: int) -> List[Turn]:
    """The call and the tool's result, between the question and the final answer."""
    return [
        {"role": "assistant", "content": tool_call_text(a, b)},
        {"role": "tool", "content": str(a * b)},
    ]


def operand_pairs(eval_size: int, seed: int) -> Tuple[List[tuple], List[tuple]]:
    """(training pairs, held-out pairs): a seeded partition of all operand pairs."""
    pairs = [
        (a, b) for a in range(A_RANGE[0], A_RANGE[1] + 1) for b in range(B_RANGE[0], B_RANGE[1] + 1)
    ]
    random.Random(seed).shuffle(pairs)
    n_eval = min(eval_size, len(pairs) // 4)
    return pairs[n_eval:], pairs[:n_eval]


def example(a: int, b: int, use_tool: bool, where: str) -> Example:
    n = a * b
    answer = answer_text(n)  # " The answer is 29842."
    turns: Optional[List[Turn]] = tool_turns(a, b) if use_tool else None
    chat = Chat(
        prompt=[{"role": "user", "content": question_text(a, b)}],
        response=answer[1:],  # the template writes the leading space
        # tool turns and tools exist only as turns
        needs_template=True,
        tools=list(TOOLS),
        tool_turns=turns,
    )
    return Example(
        prompt=prompt_text(a, b), response=answer, reference=str(n), where=where, chat=chat
    )


def generate(
    cfg: "SyntheticConfig", eval_size: int, seed: int
) -> Tuple[List[Example], List[Example]]:
    """(training records, held-out records): ``cfg.num_records`` draws from the training pairs, each
    calling the tool with probability ``cfg.p_tool``; each held-out pair once, the same way."""
    train_pairs, eval_pairs = operand_pairs(eval_size, seed)
    rng = random.Random(seed + 1)
    train = []
    for i in range(cfg.num_records):
        a, b = train_pairs[rng.randrange(len(train_pairs))]
        train.append(example(a, b, rng.random() < cfg.p_tool, f"tool_arith[{i}]"))
    held_out = [
        example(a, b, rng.random() < cfg.p_tool, f"tool_arith-eval[{i}]")
        for i, (a, b) in enumerate(eval_pairs)
    ]
    return train, held_out


def tokenizer_corpus(cfg: "SyntheticConfig") -> List[str]:
    """The texts the embedded template renders for this task (openings, calls, results, answers)
    over a fixed spread of operands, so that BPE merges the markup into few tokens (digits stay one
    a token: the tokenizer's digit split). Independent of the run's seed (rlhf.eval rebuilds it to
    recognise a policy trained on the task)."""
    texts = []
    for i in range(400):
        a = A_RANGE[0] + (i * 37) % (A_RANGE[1] - A_RANGE[0] + 1)
        b = B_RANGE[0] + (i * 13) % (B_RANGE[1] - B_RANGE[0] + 1)
        texts += [
            prompt_text(a, b),
            " " + tool_call_text(a, b),
            f"R: {a * b}\nA:",
            answer_text(a * b),
        ]
    return texts
