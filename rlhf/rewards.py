"""Rule-based rewards for PPO (``ppo.reward_fn=rlhf.rewards.gold``), alone or with the reward model.

A reward function is any importable callable

    def my_reward(responses: list[str], examples: list[Example], fmt: str) -> list[float]

``responses``: the decoded responses of a batch (special tokens removed); ``examples``: the record
of each response (``.prompt``, ``.reference`` — the gold answer where the format has one —, ...);
``fmt``: ``data.format``. It returns one float per response. Example (a file ``myrewards.py`` on
PYTHONPATH, used as ``ppo.reward_fn=myrewards.short``)::

    def short(responses, examples, fmt):
        return [1.0 if len(r) < 40 else 0.0 for r in responses]

The stage checks it before any model is loaded: it must import, and a call on two responses to one
record must return two numbers. Every later call is checked the same way (``call``): a wrong
count, a value that is not a number, or an exception inside it stops the run (exit 2) with one line
naming it. NaN is a number: the PPO update skips a step it makes non-finite
(``ppo.max_nonfinite_in_a_row``).
"""

from __future__ import annotations

import inspect
import logging
import traceback
from typing import Callable, List, Optional, Sequence

from hydra.utils import get_method

from rlhf.data.formats import FORMATS, gold_formats
from rlhf.data.records import Example
from rlhf.errors import ConfigError, one_line


def gold(responses: List[str], examples: List[Example], fmt: str) -> List[float]:
    """Exact match against the record's reference: the format's gold scorer (rlhf/data/formats.py:
    the synthetic task's rule, GSM8K's final answer)."""
    scorer = FORMATS[fmt].gold if fmt in FORMATS else None
    if scorer is None:
        raise ConfigError(
            f"rlhf.rewards.gold has no rule for data.format={fmt} ({', '.join(gold_formats())})"
        )
    return [scorer(r, e.reference) for r, e in zip(responses, examples)]


def resolve(path: str) -> Callable:
    # get_method logs the error it raises: ours is the one line
    hydra_log = logging.getLogger("hydra.utils")
    was_disabled, hydra_log.disabled = hydra_log.disabled, True
    try:
        return get_method(path)
    except Exception as e:
        # hydra raises ImportError/ValueError variants, their cause chained
        why = one_line(" ".join(x.strip() for x in str(e).splitlines() if x.strip()))
        cause = e.__cause__ or e.__context__
        if cause is not None and str(cause) not in why:
            why += f" ({type(cause).__name__}: {one_line(str(cause))})"
        raise ConfigError(f"ppo.reward_fn={path}: cannot import it: {why}") from None
    finally:
        hydra_log.disabled = was_disabled


def name_of(fn: Callable) -> str:
    """The dotted path a reward function was given by (``ppo.reward_fn``): module and qualified
    name."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(fn)


def _raised_at(e: BaseException) -> str:
    """' at file:line' of the innermost frame of ``e``'s traceback (where the user's code
    raised)."""
    frames = traceback.extract_tb(e.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def call(
    fn: Callable,
    responses: Sequence[str],
    examples: Sequence[Example],
    fmt: str,
    path: Optional[str] = None,
    what: Optional[str] = None,
) -> List[float]:
    """``fn(responses, examples, fmt)`` checked: one number per response (NaN and inf included: the
    update handles non-finite steps), as floats. Anything else — an exception inside ``fn``, a
    count that differs (one number for a whole batch), a value that is not a number — is a
    ConfigError naming ``ppo.reward_fn`` (``path``; default the function's own dotted name).
    ``what`` says what it was called on (default: a batch of N responses)."""
    path = path or name_of(fn)
    n = len(responses)
    what = what or f"a batch of {n} responses"
    try:
        out = fn(list(responses), list(examples), fmt)
    except Exception as e:
        # the user's code: named, with where it raised
        raise ConfigError(
            f"ppo.reward_fn={path}: calling it on {what} failed: {type(e).__name__}: "
            f"{one_line(str(e))}{_raised_at(e)}"
        ) from None
    try:
        got = len(out)
    except TypeError:
        got = None
    if got != n or isinstance(out, (str, bytes, dict)):
        if got is None or isinstance(out, (str, bytes, dict)):
            count = f"a {type(out).__name__}"
        else:
            count = f"{got} value{'s' * (got != 1)}"
        raise ConfigError(
            f"ppo.reward_fn={path}: it returned {count} for {n} responses; it must return one "
            f"number per response (got {out!r:.80})"
        )
    values = []
    for i, x in enumerate(out):
        try:
            if isinstance(x, (str, bytes)):
                raise TypeError("a string")
            values.append(float(x))
        except (TypeError, ValueError) as e:
            # None, a string, a tensor of several numbers, ...
            raise ConfigError(
                f"ppo.reward_fn={path}: value {i} of the {n} it returned is not a number "
                f"({type(x).__name__} {x!r:.40}: {one_line(str(e))}); it must return one number "
                f"per response"
            ) from None
    return values


def check(fn: Callable, path: str, example: Example, fmt: str) -> None:
    """Calls the reward function once, on two empty responses to one record, before any work: a
    wrong signature or return (one number for the whole batch among them) fails here with one line
    instead of after the models are loaded."""
    try:
        inspect.signature(fn).bind([""], [example], fmt)
    except TypeError as e:
        raise ConfigError(
            f"ppo.reward_fn={path}: it must take (responses, examples, fmt): {e}"
        ) from None
    except ValueError:
        # no signature to inspect (a builtin): the call below decides
        pass
    call(fn, ["", ""], [example, example], fmt, path=path, what="one record")
