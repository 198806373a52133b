"""Rule-based rewards for PPO (``ppo.reward_fn=rlhf.rewards.gold``), alone or with the reward model.

A reward function is any importable callable

    def my_reward(responses: list[str], examples: list[Example], fmt: str) -> list[float]

``responses``: the decoded responses of a batch (special tokens removed); ``examples``: the record
of each response (``.prompt``, ``.reference`` — the gold answer where the format has one —, ...);
``fmt``: ``data.format``. It returns one float per response. Example (a file ``myrewards.py`` on
PYTHONPATH, used as ``ppo.reward_fn=myrewards.short``)::

    def short(responses, examples, fmt):
        return [1.0 if len(r) < 40 else 0.0 for r in responses]

The stage checks it before any model is loaded: it must import, and a call on one record must
return one number.
"""
from __future__ import annotations

import inspect
from typing import Callable, List

from hydra.utils import get_method

from rlhf.data.gold import scorer_for
from rlhf.data.records import Example
from rlhf.errors import ConfigError, one_line


def gold(responses: List[str], examples: List[Example], fmt: str) -> List[float]:
    """Exact match against the record's reference: the synthetic task's rule or GSM8K's answer."""
    scorer = scorer_for(fmt)
    if scorer is None:
        raise ConfigError(f"rlhf.rewards.gold has no rule for data.format={fmt} (synthetic, gsm8k)")
    return [scorer(r, e.reference) for r, e in zip(responses, examples)]


def resolve(path: str) -> Callable:
    try:
        return get_method(path)
    except Exception as e:  # hydra raises ImportError/ValueError variants, their cause chained
        why = one_line(" ".join(x.strip() for x in str(e).splitlines() if x.strip()))
        cause = e.__cause__ or e.__context__
        if cause is not None and str(cause) not in why:
            why += f" ({type(cause).__name__}: {one_line(str(cause))})"
        raise ConfigError(f"ppo.reward_fn={path}: cannot import it: {why}") from None


def check(fn: Callable, path: str, example: Example, fmt: str) -> None:
    """Calls the reward function once, on an empty response to one record, before any work: a wrong
    signature or return type fails here with one line instead of after the models are loaded."""
    try:
        inspect.signature(fn).bind([""], [example], fmt)
    except TypeError as e:
        raise ConfigError(f"ppo.reward_fn={path}: it must take (responses, examples, fmt): {e}") from None
    except ValueError:  # no signature to inspect (a builtin): the call below decides
        pass
    try:
        out = fn([""], [example], fmt)
    except Exception as e:  # the user's code: any error is a configuration error here
        raise ConfigError(f"ppo.reward_fn={path}: calling it on one record failed: "
                          f"{type(e).__name__}: {one_line(str(e))}") from None
    try:
        ok = len(out) == 1 and isinstance(float(out[0]), float)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"ppo.reward_fn={path}: it must return one number per response (got {out!r:.80})")
