"""Gold scorers: rules that say how good a response really is (never seen by the reward model)."""
from __future__ import annotations

from typing import Callable, Optional

from rlhf.data import synthetic
from rlhf.data.records import GSM8K_ANSWER



def _number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def gsm8k_score(response: str, reference: str) -> float:
    """Exact match of the final answer: the number after '####' equals the reference's (GSM8K's own
    answer format; a response that never writes '####' scores 0, as it gives no final answer)."""
    m = GSM8K_ANSWER.search(response)
    if m is None:
        return 0.0
    found = m.group(1)
    a, b = _number(found), _number(reference)
    return 1.0 if a is not None and b is not None and abs(a - b) < 1e-6 else 0.0


SCORERS = {"synthetic": synthetic.gold_score, "gsm8k": gsm8k_score}


def scorer_for(fmt: str) -> Optional[Callable[[str, str], float]]:
    return SCORERS.get(fmt)
