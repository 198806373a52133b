"""Tools as JSON-schema functions (``env.tools``): the ``Tool`` type, the built-ins and their table.

A tool is a name, a description, the JSON schema of its arguments (what the chat template renders
through ``tokenizer.apply_chat_template(..., tools=[t.schema() for t in tools])``) and a function
called with the arguments as keywords that returns the observation text — or ``(text, kind)``, where
kind says how the call went wrong (``KINDS``). ``Tool.call`` never raises: bad arguments and
exceptions become an ``error: <tool>: ...`` observation the policy reads.

Built-ins (``TOOLS``): ``calculator`` (arithmetic through ``ast``, bounded) and ``python`` (code run
in a ``Sandbox``, rlhf/envs/sandbox/). A user's tool is a dotted path ``module.attr`` to a ``Tool``
or to a function of no arguments returning one (``resolve_tools``).
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from rlhf.envs.sandbox import Executor, Limits, Sandbox
from rlhf.errors import ConfigError, first_line, one_of

# how a call went wrong (None: it did not): the counts of rlhf/envs/toolcalls.execute
KINDS = ("bad_arguments", "tool_error", "timeout", "limit")
# characters of an exception's message in an error observation
_MAX_ERROR = 200

# JSON-schema types and the Python values that are them (bool is not a number in JSON)
_JSON_TYPES: Dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


class ToolError(Exception):
    """Raised inside a tool's function: the observation is ``error: <tool>: <message>`` (no type
    name)."""


@dataclass(frozen=True)
class Tool:
    """A function the policy may call: ``fn(**arguments) -> str`` or ``(str, kind)``."""

    name: str
    description: str
    # a JSON schema: {"type": "object", "properties": {...}, "required": [...]}
    parameters: dict
    fn: Callable[..., Any]

    def schema(self) -> dict:
        """The OpenAI / Hugging Face form that chat templates take (``tools=[...]``)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def call(self, arguments: Any) -> Tuple[str, Optional[str]]:
        """(observation text, None or the kind of failure from KINDS). Never raises."""
        problem = self.check(arguments)
        if problem is not None:
            return self._error(problem), "bad_arguments"
        try:
            returned = self.fn(**arguments)
        except ToolError as e:
            return self._error(str(e)), "tool_error"
        except Exception as e:
            # the tool's own bug or refusal: the policy reads it, the rollout goes on
            message = str(e).strip()
            if message:
                message = f": {message}"
            return self._error(f"{type(e).__name__}{message}"), "tool_error"
        text, kind = returned, None
        if isinstance(returned, tuple) and len(returned) == 2:
            text, kind = returned
        if not isinstance(text, str) or (kind is not None and kind not in KINDS):
            return self._error(
                f"returned {type(returned).__name__}, not text or (text, kind)"
            ), "tool_error"
        return text, kind

    def check(self, arguments: Any) -> Optional[str]:
        """What is wrong with ``arguments`` against ``parameters`` (None: nothing): an object, the
        required keys there, no unknown keys, values of the declared JSON types."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {_json_type(arguments)}"
        properties = self.parameters.get("properties") or {}
        open_ended = (
            "properties" not in self.parameters
            or self.parameters.get("additionalProperties") is True
        )
        for key in self.parameters.get("required") or ():
            if key not in arguments:
                return f"missing argument {key!r}"
        for key, value in arguments.items():
            if key not in properties and open_ended:
                continue
            if key not in properties and not properties:
                return f"unexpected argument {key!r} (it takes none)"
            if key not in properties:
                return f"unexpected argument {key!r} (expected {one_of(sorted(properties))})"
            declared = None
            if isinstance(properties[key], dict):
                declared = properties[key].get("type")
            types = [declared] if isinstance(declared, str) else list(declared or ())
            known = [t for t in types if t in _JSON_TYPES]
            if known and not any(_JSON_TYPES[t](value) for t in known):
                return f"argument {key!r} must be of type {one_of(known)}, got {_json_type(value)}"
        return None

    def _error(self, message: str) -> str:
        line = " ".join(message.split())
        if len(line) > _MAX_ERROR:
            line = line[: _MAX_ERROR - 3] + "..."
        return f"error: {self.name}: {line}"


def _json_type(value: Any) -> str:
    for name, test in _JSON_TYPES.items():
        if name != "number" and test(value):
            return name
    if isinstance(value, float):
        return "number"
    return type(value).__name__


# ---- calculator ----

_MAX_EXPRESSION = 200  # characters
# of an integer, operands and results alike
_MAX_DIGITS = 100
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_REFUSED = {
    ast.Name: "names",
    ast.Call: "function calls",
    ast.Attribute: "attributes",
    ast.Subscript: "subscripts",
    ast.Compare: "comparisons",
    ast.BoolOp: "boolean operators",
    ast.Lambda: "lambdas",
}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (ints and floats; + - * / // % ** and unary +/-;
    parentheses), as text: an int, or a float rounded to 10 significant digits (an integral float
    prints as an int: 6/3 → 2). Anything else, or a result over 100 digits, is a ToolError."""
    if len(expression) > _MAX_EXPRESSION:
        raise ToolError(f"expression longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a NUL byte
        raise ToolError(f"invalid expression: {expression.strip()!r}") from None
    return _format(_evaluate(tree.body))


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large") from None
        return _bounded(value)
    what = _REFUSED.get(type(node))
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = f"the operator {type(node.op).__name__}"
    elif isinstance(node, ast.Constant):
        what = f"the constant {node.value!r:.20}"
    raise ToolError(
        f"not allowed: {what or type(node).__name__} (only numbers, + - * / // % ** and "
        "parentheses)"
    )


def _check_power(base, exponent) -> None:
    """Refuses a power whose result would be over the bound before computing it (2**10**10)."""
    if isinstance(exponent, int) and isinstance(base, int) and abs(base) > 1 and exponent > 0:
        if exponent * math.log10(abs(base)) > _MAX_DIGITS:
            raise ToolError(f"result too large (over {_MAX_DIGITS} digits)")


def _bounded(value):
    if isinstance(value, complex):
        raise ToolError("result is not a real number")
    if isinstance(value, int) and abs(value) >= 10**_MAX_DIGITS:
        raise ToolError(f"result too large (over {_MAX_DIGITS} digits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result too large")
    return value


def _format(value) -> str:
    if isinstance(value, int):
        return str(value)
    rounded = float(f"{value:.10g}")
    if rounded.is_integer() and abs(rounded) < 1e16:
        # beyond, an int's digits would be float noise
        return str(int(rounded))
    return repr(rounded)


def calculator_tool(executor: Optional[Executor] = None) -> Tool:
    """The calculator (``executor``: unused; every built-in factory takes it). Its schema is the one
    the embedded tool-use task's SFT data renders (rlhf/data/tool_arith.py CALCULATOR)."""
    return Tool(
        name="calculator",
        description="Evaluates an arithmetic expression.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
            "required": ["expression"],
        },
        fn=calculate,
    )


# ---- python ----


def _limit_kind(limit: Optional[str]) -> Optional[str]:
    if limit is None:
        return None
    if limit in ("wall_time", "cpu_time"):
        return "timeout"
    return "limit"


def python_tool(executor: Optional[Executor] = None, limits: Optional[Limits] = None) -> Tool:
    """Code run by ``executor`` (default: a ``Sandbox`` with ``limits``); the observation is what it
    printed, the end of its traceback, or the limit that stopped it (``Result.observation``)."""
    if executor is not None and limits is not None:
        raise ValueError(
            "python_tool: give an executor or limits, not both (the executor has its own)"
        )
    runner = executor
    if runner is None:
        runner = Sandbox(limits or Limits())

    def run(code: str) -> Tuple[str, Optional[str]]:
        result = runner.run(code)
        return result.observation(), _limit_kind(result.limit)

    return Tool(
        name="python",
        description=(
            "Runs a Python 3 program and returns what it prints (stdout; the end of the "
            "traceback if it "
            "fails). Standard library only; no network; files only in its working "
            "directory; limited "
            "time and memory."
        ),
        parameters={
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "the program; print the results"}
            },
            "required": ["code"],
        },
        fn=run,
    )


# the built-in tools by name: factories taking an optional ``executor`` (what runs the Python tool's
# code)
TOOLS: Dict[str, Callable[..., Tool]] = {"calculator": calculator_tool, "python": python_tool}


def resolve_tools(names: Sequence[str], executor: Optional[Executor] = None) -> List[Tool]:
    """The tools of ``env.tools``: built-in names (TOOLS; ``executor`` runs the Python tool's code,
    by default a ``Sandbox()``) or dotted paths ``module.attr`` to a Tool or to a function of no
    arguments returning one. ConfigError (one line naming the entry) otherwise, and for two tools of
    one name."""
    tools: List[Tool] = []
    for entry in names:
        if entry in TOOLS:
            tool = TOOLS[entry](executor=executor)
        else:
            tool = _import_tool(entry)
        if any(t.name == tool.name for t in tools):
            raise ConfigError(
                f"env.tools: two tools are named {tool.name!r} ({entry} is the second)"
            )
        tools.append(tool)
    return tools


def _import_tool(entry: str) -> Tool:
    module, _, attr = str(entry).rpartition(".")
    if not module:
        raise ConfigError(
            f"env.tools: {entry!r} is not a built-in tool ({one_of(sorted(TOOLS))}) nor a "
            "dotted path module.attr"
        )
    try:
        obj = getattr(importlib.import_module(module), attr)
    except Exception as e:
        # ImportError, AttributeError, or the module raising on import
        raise ConfigError(
            f"env.tools: cannot import {entry}: {type(e).__name__}: {first_line(e)}"
        ) from None
    if not isinstance(obj, Tool) and callable(obj):
        try:
            obj = obj()
        except Exception as e:
            raise ConfigError(
                f"env.tools: {entry}() raised {type(e).__name__}: {first_line(e)}"
            ) from None
    if not isinstance(obj, Tool):
        raise ConfigError(
            f"env.tools: {entry} is a {type(obj).__name__}, not a Tool (rlhf.envs.tools.Tool) "
            f"or a function of no arguments returning one"
        )
    return obj
