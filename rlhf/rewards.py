"""Rule-based rewards for PPO (``ppo.reward_fn=rlhf.rewards.gold``), alone or with the reward model.

A reward function takes the decoded responses and their records and returns one score each.
"""
from __future__ import annotations

from typing import Callable, List

from rlhf.data.gold import scorer_for
from rlhf.data.records import Example
from rlhf.errors import ConfigError


def gold(responses: List[str], examples: List[Example], fmt: str) -> List[float]:
    """Exact match against the record's reference: the synthetic task's rule or GSM8K's answer."""
    scorer = scorer_for(fmt)
    if scorer is None:
        raise ConfigError(f"rlhf.rewards.gold has no rule for data.format={fmt} (synthetic, gsm8k)")
    return [scorer(r, e.reference) for r, e in zip(responses, examples)]


def resolve(path: str) -> Callable:
    from hydra.utils import get_method
    try:
        return get_method(path)
    except Exception as e:  # hydra raises ImportError/ValueError variants
        raise ConfigError(f"ppo.reward_fn={path}: cannot import it ({str(e).splitlines()[0]})") from None
