"""The embedded default task: two-operand addition with a gold scorer.

Prompt ``"Q: What is 03 + 45?\\nA:"``, response ``" The answer is 48."``. Operands are zero-padded
so every prompt has the same length. The SFT data is right with probability ``p_correct`` and off by
1..3 otherwise, so a policy that imitates it is right only part of the time (room for the reward
model and PPO). Preference pairs put the right answer against a wrong one, in four equal shares:
off by 1..3 (the SFT data's own errors), one digit of the answer replaced (the tens digit wrong is
the carry mistake a policy makes when it samples), one digit doubled or dropped (74 → 744, 774, 7 or
4: a sampling policy's stutter), and off by 4..15 (``data.synthetic.rejected_kinds`` picks fewer:
reward models with a blind spot). A reward model that only ever saw near misses
prefers far-off answers it never saw over the right one (measured: its argmax over n±12 was right on
19% of held-out prompts); one without digit errors scores n±10 as high as n (argmax over n±15 right
on 30% of held-out prompts, the rest at n±10); one without doubled digits scored the right answer
with its last digit doubled above the right one on up to 60% of held-out prompts (74 → 744), and PPO
walks straight into each of them (docs/history.md: reward models of earlier recipes; today's,
trained in full without one of the kinds, still rank the right answer above that kind on 87.5–100%
of held-out pairs: docs/ppo.md). Gold = exact match of the whole response, a rule the reward model
never sees. Held-out prompts use operand pairs that no training record contains. Deterministic per
seed.

``SyntheticConfig`` (``data.synthetic``, rlhf/config.py) appears in string annotations only:
rlhf/config.py imports this folder (the format table), never the other way.
"""

from __future__ import annotations

import random
import re
from typing import List, Sequence, Tuple

from rlhf.data.records import Chat, Example

ANSWER = re.compile(r"^ ?The answer is (-?\d+)\.$")


def question_text(a: int, b: int, width: int) -> str:
    """The user turn: the embedded tokenizer's chat template renders it as ``prompt_text``."""
    return f"What is {a:0{width}d} + {b:0{width}d}?"


def prompt_text(a: int, b: int, width: int) -> str:
    return f"Q: {question_text(a, b, width)}\nA:"


def answer_text(n: int) -> str:
    return f" The answer is {n}."


def gold_score(response: str, reference: str) -> float:
    """1.0 when the response (up to EOS) is exactly ' The answer is <a+b>.', else 0.0."""
    m = ANSWER.match(response.rstrip())
    return 1.0 if m is not None and m.group(1) == reference else 0.0


def _wrong(n: int, rng: random.Random) -> int:
    while True:
        w = n + rng.choice((-3, -2, -1, 1, 2, 3))
        if w >= 0:
            return w


def _digit_error(n: int, rng: random.Random) -> int:
    """``n`` with one of its digits replaced by another (no leading zero)."""
    digits = list(str(n))
    i = rng.randrange(len(digits))
    choices = [
        d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0" and len(digits) > 1)
    ]
    digits[i] = rng.choice(choices)
    return int("".join(digits))


def _length_error(n: int, rng: random.Random) -> int:
    """``n`` with one of its digits doubled, or (half the time, from two digits on) dropped."""
    digits = list(str(n))
    i = rng.randrange(len(digits))
    if len(digits) > 1 and rng.random() < 0.5:
        del digits[i]
    else:
        digits.insert(i, digits[i])
    w = int("".join(digits))
    return w if w != n else _wrong(n, rng)  # (0 doubled is 0)


def _far(n: int, rng: random.Random) -> int:
    """``n`` off by 4..15."""
    while True:
        w = n + rng.choice((-1, 1)) * rng.randint(4, 15)
        if w >= 0:
            return w


# the kinds of rejected answers (``data.synthetic.rejected_kinds``), in the order a record draws
# among them
REJECTED_KINDS = {"near": _wrong, "digit": _digit_error, "length": _length_error, "far": _far}


def _rejected(n: int, rng: random.Random, kinds: Sequence[str] = tuple(REJECTED_KINDS)) -> int:
    """An equal share each of ``kinds``: by default off by 1..3 (the SFT data's own errors), one
    digit wrong, one digit doubled or dropped, off by 4..15. Fewer kinds: a reward model with a
    blind spot (the ensembles of docs/ppo.md)."""
    return REJECTED_KINDS[kinds[rng.randrange(len(kinds))]](n, rng)


def operand_pairs(
    cfg: "SyntheticConfig", eval_size: int, seed: int
) -> Tuple[List[tuple], List[tuple]]:
    """(training pairs, held-out pairs): a seeded partition of all operand pairs."""
    pairs = [(a, b) for a in range(cfg.max_operand + 1) for b in range(cfg.max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    n_eval = min(eval_size, len(pairs) // 4)
    return pairs[n_eval:], pairs[:n_eval]


def _example(
    a: int,
    b: int,
    width: int,
    cfg: "SyntheticConfig",
    rng: random.Random,
    rej_rng: random.Random,
    where: str,
) -> Example:
    n = a + b
    wrong = _wrong(n, rng)
    response = answer_text(n) if rng.random() < cfg.p_correct else answer_text(wrong)
    chosen, rejected = answer_text(n), answer_text(_rejected(n, rej_rng, cfg.rejected_kinds))
    # the same record as turns (assistant contents without the leading space the template writes)
    chat = Chat(
        prompt=[{"role": "user", "content": question_text(a, b, width)}],
        response=response[1:],
        chosen=chosen[1:],
        rejected=rejected[1:],
        needs_template=False,
    )
    return Example(
        prompt=prompt_text(a, b, width),
        response=response,
        chosen=chosen,
        rejected=rejected,
        reference=str(n),
        where=where,
        chat=chat,
    )


def generate(
    cfg: "SyntheticConfig", eval_size: int, seed: int
) -> Tuple[List[Example], List[Example]]:
    """(training records, held-out records). Each held-out operand pair appears once."""
    width = len(str(cfg.max_operand))
    train_pairs, eval_pairs = operand_pairs(cfg, eval_size, seed)
    rng, rej_rng = random.Random(seed + 1), random.Random(seed + 2)  # rejected answers: own stream
    train = [
        _example(
            *train_pairs[rng.randrange(len(train_pairs))],
            width,
            cfg,
            rng,
            rej_rng,
            f"synthetic[{i}]",
        )
        for i in range(cfg.num_records)
    ]
    held_out = [
        _example(a, b, width, cfg, rng, rej_rng, f"synthetic-eval[{i}]")
        for i, (a, b) in enumerate(eval_pairs)
    ]
    return train, held_out


def tokenizer_corpus(cfg: "SyntheticConfig") -> List[str]:
    """Every string the task can produce, for training the embedded tokenizer."""
    width = len(str(cfg.max_operand))
    texts = [prompt_text(a, a, width) for a in range(cfg.max_operand + 1)]
    texts += [answer_text(n) for n in range(2 * cfg.max_operand + 4)]
    return texts
