"""Arithmetic in natural language for pretrained chat models (``data.format=arith``), with an
exact-answer rule: the RL-with-verifiable-reward task of ``recipe=smollm2_arith``.

A record is one user turn, rendered by the model's own chat template (``Chat.needs_template``):

    What is 34 + 36? Answer with the number only.

Operands are drawn from ``data.synthetic.min_operand..max_operand`` (no zero padding: the words a
user would write). Gold = the last integer of the response (thousands separators ignored) equals the
sum: ``"70"``, ``"34 + 36 = 70"`` and ``"The answer is 70."`` all score 1, ``"34 + 36 = 108"`` 0.
The rule is the reward (``rlhf.rewards.gold``) and the held-out score (``gold/score``,
``gold/score_greedy``).

For SFT and preference stages the records also carry the right sum as the response and chosen
answer, and a wrong one as the rejected answer (``data.synthetic.rejected_kinds``, the embedded
task's kinds of mistake). Held-out prompts use operand pairs that no training record contains;
deterministic per seed. ``SyntheticConfig`` (``data.synthetic``, rlhf/config.py) appears in string
annotations only.
"""

from __future__ import annotations

import random
import re
from typing import List, Tuple

from rlhf.data.records import Chat, Example
from rlhf.data.synthetic import _rejected

INSTRUCTION = "Answer with the number only."
_INT = re.compile(r"-?\d+")


def question_text(a: int, b: int) -> str:
    return f"What is {a} + {b}? {INSTRUCTION}"


def final_number(response: str) -> str | None:
    """The last integer of ``response`` (thousands separators dropped), or None."""
    found = _INT.findall(re.sub(r"(?<=\d),(?=\d{3})", "", response))
    return found[-1] if found else None


def gold_score(response: str, reference: str) -> float:
    """1.0 when the response's last integer is the sum, else 0.0."""
    return 1.0 if final_number(response) == reference else 0.0


def operand_pairs(
    cfg: "SyntheticConfig", eval_size: int, seed: int
) -> Tuple[List[tuple], List[tuple]]:
    """(training pairs, held-out pairs): a seeded partition of the operand pairs of the range."""
    span = range(cfg.min_operand, cfg.max_operand + 1)
    pairs = [(a, b) for a in span for b in span]
    random.Random(seed).shuffle(pairs)
    n_eval = min(eval_size, len(pairs) // 4)
    return pairs[n_eval:], pairs[:n_eval]


def _example(a: int, b: int, cfg: "SyntheticConfig", rej_rng: random.Random, where: str) -> Example:
    n = a + b
    question = question_text(a, b)
    rejected = str(_rejected(n, rej_rng, cfg.rejected_kinds))
    chat = Chat(
        prompt=[{"role": "user", "content": question}],
        response=str(n),
        chosen=str(n),
        rejected=rejected,
    )
    # the plain text (no chat template): HH-RLHF's form, as the messages format writes it
    prompt = f"\n\nHuman: {question}\n\nAssistant:"
    return Example(
        prompt=prompt,
        response=f" {n}",
        chosen=f" {n}",
        rejected=f" {rejected}",
        reference=str(n),
        where=where,
        chat=chat,
    )


def generate(
    cfg: "SyntheticConfig", eval_size: int, seed: int
) -> Tuple[List[Example], List[Example]]:
    """(training records, held-out records). Each held-out operand pair appears once."""
    train_pairs, eval_pairs = operand_pairs(cfg, eval_size, seed)
    rng, rej_rng = random.Random(seed + 1), random.Random(seed + 2)
    train = [
        _example(*train_pairs[rng.randrange(len(train_pairs))], cfg, rej_rng, f"arith[{i}]")
        for i in range(cfg.num_records)
    ]
    held_out = [
        _example(a, b, cfg, rej_rng, f"arith-eval[{i}]") for i, (a, b) in enumerate(eval_pairs)
    ]
    return train, held_out


def tokenizer_corpus(cfg: "SyntheticConfig") -> List[str]:
    """The task's texts, should a run build the embedded tokenizer for it (no model.path)."""
    span = range(cfg.min_operand, cfg.max_operand + 1)
    return [question_text(a, a) for a in span] + [str(n) for n in range(2 * cfg.max_operand + 1)]
