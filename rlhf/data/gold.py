"""Gold scorers: rules that say how good a response really is (never seen by the reward model)."""
from __future__ import annotations

import re
from typing import Callable, Optional

from rlhf.data import synthetic
from rlhf.data.records import GSM8K_ANSWER

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def _number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def gsm8k_score(response: str, reference: str) -> float:
    """Exact match of the final answer: the number after '####', else the last number given."""
    m = GSM8K_ANSWER.search(response)
    found = m.group(1) if m else (_NUMBER.findall(response) or [None])[-1]
    if found is None:
        return 0.0
    a, b = _number(found), _number(reference)
    return 1.0 if a is not None and b is not None and abs(a - b) < 1e-6 else 0.0


SCORERS = {"synthetic": synthetic.gold_score, "gsm8k": gsm8k_score}


def scorer_for(fmt: str) -> Optional[Callable[[str, str], float]]:
    return SCORERS.get(fmt)
