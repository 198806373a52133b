"""The environment API: what a multi-turn rollout talks to (docs/agents.md).

An environment is a class; the PPO stage makes one instance per trajectory (``env.args`` as
keyword arguments) and calls

- ``reset(example) -> list of messages or None``: the opening conversation of the trajectory, from
  the record it is given (``Example``: ``.prompt``, ``.reference``, ``.chat``, ...). None opens with
  the record's own prompt as every stage renders it (chat template, and the environment's tools).
- ``step(text) -> StepResult``: the policy's turn as text (special tokens removed); the answer is
  the
  observation (messages: a tool's result ``{"role": "tool", ...}``, a user's reply), this turn's
  reward, and whether the episode is over. The episode also ends at ``env.max_turns``, at the
  trajectory's token budget, or when the policy stops without EOS.
- ``tools``: the ``Tool``s (rlhf/envs/tools.py) rendered into the prompt by the chat template.
- ``close()``: called once the trajectory is over (release what ``reset`` took).

Its steps run in a thread pool, several trajectories at a time, each bounded by
``env.timeout_s``; an exception or a timeout drops the trajectory (no loss on it), counted in
``env/failed``, and a step in which more than ``env.max_failed_share`` of the trajectories fail
stops the run (exit 2) naming the environment and the error. The class is checked before any model
loads (``check``): it must import, construct, and reset on a record.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from rlhf.data.records import Example, Turn
from rlhf.errors import ConfigError, first_line


@dataclass
class StepResult:
    """An environment's answer to one policy turn."""

    # the observation, appended to the conversation
    messages: List[Turn] = field(default_factory=list)
    # this turn's reward (at the turn's last token; the episode's return adds them up)
    reward: float = 0.0
    # the episode is over: no observation is appended
    done: bool = False
    # counts summed into the step's metrics (env/<key>)
    info: Dict[str, float] = field(default_factory=dict)


class Environment:
    """The base class (subclassing it is optional: any class with ``reset`` and ``step`` works)."""

    tools: Sequence = ()

    def reset(self, example: Example) -> Optional[List[Turn]]:
        return None

    def step(self, text: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _import(path: str, key: str):
    module, _, name = path.rpartition(".")
    if not module:
        raise ConfigError(f"{key}={path}: not a built-in name and not a dotted path module.Class")
    try:
        obj = importlib.import_module(module)
    except Exception as e:
        # ImportError, or the user's module raising on import
        raise ConfigError(
            f"{key}={path}: cannot import {module}: {type(e).__name__}: {first_line(e)}"
        ) from None
    if not hasattr(obj, name):
        raise ConfigError(f"{key}={path}: module {module} has no attribute {name}")
    return getattr(obj, name)


def resolve(spec: str, table: Dict[str, type], key: str = "env.name") -> type:
    """The environment class ``spec`` names: a row of ``table`` (the built-ins) or a dotted path."""
    cls = table.get(spec) or _import(spec, key)
    if not callable(cls):
        raise ConfigError(f"{key}={spec}: {type(cls).__name__} is not a class")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise ConfigError(
                f"{key}={spec}: it has no {method}() method (docs/agents.md: "
                "reset(example), step(text))"
            )
    return cls


def make(cls: type, args: Optional[dict], key: str = "env.name"):
    """One instance of ``cls`` with ``args`` (env.args) as keyword arguments."""
    args = dict(args or {})
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as e:
        raise ConfigError(
            f"{key}={name_of(cls)}: env.args {sorted(args)} do not fit its constructor: {e}"
        ) from None
    except ValueError:  # no signature to inspect
        pass
    return cls(**args)


def name_of(cls) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"


def check_opening(turns, where: str) -> None:
    """What ``reset`` returns: None or a non-empty list of {"role", "content"} messages."""
    if turns is None:
        return
    if not isinstance(turns, list) or not turns:
        raise TypeError(
            f"{where}: reset() must return None or a non-empty list of messages, got "
            f"{type(turns).__name__}"
        )
    check_messages(turns, where)


def check_messages(messages, where: str) -> None:
    if not isinstance(messages, list):
        raise TypeError(f"{where}: messages must be a list, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise TypeError(
                f"{where}: message {i} must be a dict with string 'role' and 'content', "
                f"got {m!r:.80}"
            )


def check_step(result, where: str) -> StepResult:
    """A ``step`` return checked: a StepResult (or anything with its fields) with a finite
    reward."""
    if not all(hasattr(result, k) for k in ("messages", "reward", "done")):
        raise TypeError(
            f"{where}: step() must return a StepResult (messages, reward, done), got "
            f"{type(result).__name__}"
        )
    check_messages(result.messages, where)
    try:
        float(result.reward)
    except (TypeError, ValueError):
        raise TypeError(
            f"{where}: step() reward must be a number, got {result.reward!r:.40}"
        ) from None
    check_info(getattr(result, "info", None), where)
    return result


def check_info(info, where: str) -> None:
    """``StepResult.info``: None or {name: number}; each key's sums become the metric
    ``env/<name>``."""
    if info is None:
        return
    if not isinstance(info, dict):
        raise TypeError(
            f"{where}: step() info must be a dict of numbers, got {type(info).__name__}"
        )
    for k, v in info.items():
        if not isinstance(k, str) or not k or "/" in k or ":" in k:
            raise TypeError(
                f"{where}: step() info key {k!r} must be a name (it becomes the metric env/<name>)"
            )
        try:
            # a number of any kind (numpy's, a 0-d tensor), not text
            ok = not isinstance(v, (str, bytes)) and math.isfinite(float(v))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise TypeError(
                f"{where}: step() info[{k!r}] must be a finite number (summed into "
                f"env/{k}), got {v!r:.40}"
            )


def check(make_env, example: Example, spec: str, key: str = "env.name") -> None:
    """Before any model loads: an environment made by ``make_env`` resets on a record (one line,
    exit 2, if not)."""
    try:
        env = make_env()
        check_opening(env.reset(example), "reset")
        env.close()
    except ConfigError:
        raise
    except Exception as e:  # the user's code: named
        where = example.where or "a record"
        raise ConfigError(
            f"{key}={spec}: checking it on {where} failed: {type(e).__name__}: {first_line(e)}"
        ) from None
