"""The built-in environments (``env.name``): one table, ``ENVS``.

- ``single_turn``: one response to the record's prompt, nothing answered: PPO as it always was (the
  reward comes from the reward model and ``ppo.reward_fn``).
- ``tools``: the policy may call the tools of ``env.tools`` (rendered into the prompt by the chat
  template); each turn's calls (Hermes ``<tool_call>{json}</tool_call>`` by default,
  ``env.tool_parser``) run and their results come back as ``tool`` messages; a malformed call, an
  unknown tool or bad arguments come back as an error message the policy reads. A turn without a
  call is the answer: the episode ends, and ``ppo.reward_fn`` / the reward model score that final
  answer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Sequence, Tuple

from rlhf.envs.base import Environment, StepResult, make, resolve
from rlhf.envs.toolcalls import execute
from rlhf.errors import ConfigError


class SingleTurn(Environment):
    """One turn: the record's prompt, the policy's response, done."""

    def step(self, text: str) -> StepResult:
        return StepResult(done=True)


class ToolEnv(Environment):
    """Tool calls answered until the policy answers without one (``tools``: Tool objects;
    ``parser``: text -> Parsed, rlhf/envs/toolcalls.py)."""

    def __init__(self, tools: Sequence = (), parser: Optional[Callable] = None):
        from rlhf.envs.toolcalls import PARSERS

        self.tools = list(tools)
        self.by_name: Dict[str, object] = {t.name: t for t in self.tools}
        self.parser = parser or PARSERS["hermes"]

    def step(self, text: str) -> StepResult:
        messages, counts = execute(text, self.by_name, self.parser)
        return StepResult(messages=messages, done=not messages, info=dict(counts))


ENVS: Dict[str, type] = {"single_turn": SingleTurn, "tools": ToolEnv}


def environment(env) -> Tuple[Callable[[], object], type]:
    """(a maker of one environment per trajectory, its class) from the ``env`` group (``env.name``,
    ``args``, ``tools``, ``tool_parser``, ``sandbox``). Everything is resolved here, before any
    model loads: a name or path that does not import, a tool or parser that is not one, arguments
    that do not fit the constructor are a ConfigError naming the key."""
    from rlhf.envs.toolcalls import resolve_parser
    from rlhf.envs.tools import resolve_tools

    cls = resolve(env.name, ENVS)
    tools = []
    if env.tools:
        tools = resolve_tools(list(env.tools), sandbox_of(env) if "python" in env.tools else None)
    if cls is ToolEnv:
        parser = resolve_parser(env.tool_parser)
        return (lambda: ToolEnv(tools, parser)), cls
    args = dict(env.args or {})
    if tools:
        # a class of the user's that takes the tools
        args["tools"] = tools
    # constructs once: arguments that do not fit fail here
    make(cls, args)
    return (lambda: make(cls, args)), cls


def sandbox_of(env):
    """The Python tool's sandbox from ``env.sandbox``: its limits, and its isolation settled here
    (the kernel probed once, the mode said in the log); ``namespaces`` where the kernel allows none
    is a ConfigError saying what it refused."""
    from rlhf.envs.sandbox import Limits, Sandbox

    fields = dataclasses.asdict(env.sandbox)
    found = settled(fields.pop("isolation"))
    # the other env.sandbox.* are Limits' own fields
    return Sandbox(Limits(**fields), mode=found.mode)


def settled(choice: str):
    """``env.sandbox.isolation`` settled (modes.py ``settle``); ``namespaces`` where the kernel
    allows none is a ConfigError saying what it refused."""
    from rlhf.envs.sandbox.run import settle

    try:
        return settle(choice)
    except ValueError as e:
        raise ConfigError(
            f"env.sandbox.isolation=namespaces, but the kernel allows none here: {e}"
        ) from None


def say_sandbox(env, log) -> None:
    """The Python tool's isolation in the stage's log, once its logging is set up (a warning where
    it is the guard alone); nothing without the tool."""
    if "python" in (env.tools or ()):
        found = settled(env.sandbox.isolation)
        (log.warning if found.weak else log.info)("%s", found.line())
