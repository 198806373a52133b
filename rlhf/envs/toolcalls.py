"""Tool calls in the policy's text: parsing them (``env.tool_parser``), writing them, running them.

The default format is Hermes / Qwen's: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
any number per turn; ``format_call`` writes it (the embedded tool-use task's SFT data is written
with it, rlhf/data/tool_arith.py). A parser is any ``(text) -> Parsed``: the calls, one readable
error per malformed call (the policy reads it as the call's result), and the text outside the calls.
``execute`` runs a turn's calls and returns the ``tool`` messages that answer them with its counts.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Tuple, Union

from rlhf.errors import ConfigError, first_line, one_of

if TYPE_CHECKING:
    from rlhf.envs.tools import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
COUNT_KEYS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_limits")


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


@dataclass
class Parsed:
    """What a parser found in one turn."""

    calls: List[ToolCall] = field(default_factory=list)
    # one observation per malformed call: "error: tool call 2 ..."
    errors: List[str] = field(default_factory=list)
    content: str = ""  # the text outside the calls, stripped
    # the calls and errors in the text's order (execute answers them so); a parser may leave it
    # empty: the calls are then answered first, then the errors
    sequence: List[Union[ToolCall, str]] = field(default_factory=list)

    def add(self, item: Union[ToolCall, str]) -> None:
        if isinstance(item, ToolCall):
            self.calls.append(item)
        else:
            self.errors.append(item)
        self.sequence.append(item)


def parse_hermes(text: str) -> Parsed:
    """``<tool_call>{json}</tool_call>`` blocks. ``arguments`` may be an object or a JSON string
    holding one (missing or null: no arguments); a last block without its closing tag (generation
    stopped) counts if what follows the tag parses."""
    parsed = Parsed()
    outside: List[str] = []
    pos, number = 0, 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        number += 1
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        if end < 0:
            parsed.add(_call_of(text[body_start:], number, closed=False))
            break
        parsed.add(_call_of(text[body_start:end], number, closed=True))
        pos = end + len(CLOSE)
    parsed.content = "".join(outside).strip()
    return parsed


def _call_of(body: str, number: int, closed: bool) -> Union[ToolCall, str]:
    """The call in one block's JSON, or the error message the policy reads."""
    what = f"tool call {number}"
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        unclosed = ""
        if not closed:
            unclosed = f" (and has no closing {CLOSE})"
        return f"error: {what} is not valid JSON{unclosed}: {_json_error(e)}"
    if not isinstance(obj, dict):
        return (
            f'error: {what} must be a JSON object {{"name": ..., "arguments": {{...}}}}, got '
            f"{_kind(obj)}"
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f'error: {what} needs a "name": the tool\'s name as a non-empty string'
    name = name.strip()
    arguments = obj.get("arguments")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as e:
            return (
                f"error: {what} ({name}): its arguments are a string that is not valid JSON: "
                f"{_json_error(e)}"
            )
    if not isinstance(arguments, dict):
        return (
            f"error: {what} ({name}): its arguments must be a JSON object, got {_kind(arguments)}"
        )
    return ToolCall(name, arguments)


def _json_error(e: BaseException) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at char {e.pos}"
    return f"{type(e).__name__}: {first_line(e)}"


def _kind(value) -> str:
    """A JSON value's type name for a message."""
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
    }
    return names.get(type(value), "a number")


def format_call(call: ToolCall) -> str:
    """The Hermes text of a call (json.dumps' default separators, non-ASCII kept): ``parse_hermes``
    reads it back as ``call``."""
    payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{OPEN}{payload}{CLOSE}"


PARSERS: Dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes}


def resolve_parser(spec: str) -> Callable[[str], Parsed]:
    """``env.tool_parser``: a name of PARSERS or a dotted path to a function ``(text) ->
    Parsed``."""
    if spec in PARSERS:
        return PARSERS[spec]
    module, _, attr = str(spec).rpartition(".")
    if not module:
        raise ConfigError(
            f"env.tool_parser={spec}: not a built-in parser ({one_of(sorted(PARSERS))}) "
            f"nor a dotted path module.function"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as e:
        # ImportError, AttributeError, or the module raising on import
        raise ConfigError(
            f"env.tool_parser={spec}: cannot import it: {type(e).__name__}: {first_line(e)}"
        ) from None
    if not callable(fn):
        raise ConfigError(
            f"env.tool_parser={spec}: a {type(fn).__name__} is not callable (text -> Parsed)"
        )
    return fn


def execute(
    text: str, tools: Dict[str, "Tool"], parser: Callable[[str], Parsed] = parse_hermes
) -> Tuple[List[dict], Dict[str, int]]:
    """Runs the calls in ``text``: (the ``tool`` messages answering them — one per call and one per
    malformed call, in order —, counts). ``tool_calls`` counts every call, malformed ones included;
    ``tool_errors`` the malformed ones, unknown tools, bad arguments and exceptions in a tool;
    ``tool_timeouts`` and ``tool_limits`` the calls a sandbox stopped. No call: ([], zeros)."""
    parsed = parser(text)
    counts = dict.fromkeys(COUNT_KEYS, 0)
    messages: List[dict] = []
    items = parsed.sequence or [*parsed.calls, *parsed.errors]
    for item in items:
        counts["tool_calls"] += 1
        if isinstance(item, str):
            messages.append({"role": "tool", "name": "error", "content": item})
            counts["tool_errors"] += 1
            continue
        tool = tools.get(item.name)
        if tool is None:
            available = "none"
            if tools:
                available = one_of(sorted(tools))
            content = f"error: unknown tool {item.name!r} (available: {available})"
            messages.append({"role": "tool", "name": "error", "content": content})
            counts["tool_errors"] += 1
            continue
        content, kind = tool.call(item.arguments)
        messages.append({"role": "tool", "name": tool.name, "content": content})
        if kind == "timeout":
            counts["tool_timeouts"] += 1
        elif kind == "limit":
            counts["tool_limits"] += 1
        elif kind is not None:
            counts["tool_errors"] += 1
    return messages, counts
