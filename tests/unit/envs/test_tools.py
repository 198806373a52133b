"""Tools (rlhf/envs/tools.py) and tool calls (rlhf/envs/toolcalls.py): the calculator, argument
checks, the python tool, resolving ``env.tools`` and ``env.tool_parser``, the Hermes parser and
``execute``."""

import time

import pytest

from rlhf.data import tool_arith
from rlhf.envs.sandbox import Limits, Result, Sandbox
from rlhf.envs.toolcalls import (
    ToolCall,
    execute,
    format_call,
    parse_hermes,
    resolve_parser,
)
from rlhf.envs.tools import Tool, ToolError, calculator_tool, python_tool, resolve_tools
from rlhf.errors import ConfigError


def _echo(text: str, kind=None):
    if kind is None:
        return text
    return text, kind


# a user's tool and tool factory, named by dotted path in the tests below
MY_TOOL = Tool(
    name="echo",
    description="Returns its text.",
    parameters={
        "type": "object",
        "properties": {"text": {"type": "string"}, "kind": {"type": ["string", "null"]}},
        "required": ["text"],
    },
    fn=_echo,
)
NOT_A_TOOL = 42


def make_tool() -> Tool:
    return Tool(
        "upper", "Upper-cases its text.", MY_TOOL.parameters, lambda text, kind=None: text.upper()
    )


def my_parser(text):
    return parse_hermes(text.replace("[call]", "<tool_call>").replace("[/call]", "</tool_call>"))


def calc(expression):
    return calculator_tool().call({"expression": expression})


@pytest.mark.parametrize(
    "expression, value",
    [
        ("3*4", "12"),
        ("12 * (3 + 4)", "84"),
        ("6/3", "2"),
        ("1/3", "0.3333333333"),
        ("0.1 + 0.2", "0.3"),
        ("-(3 + 4) * 2", "-14"),
        ("7 // 2", "3"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("+5", "5"),
        ("1e16", "1e+16"),
        ("10 ** 99", "1" + "0" * 99),
    ],
)
def test_the_calculator_computes(expression, value):
    assert calc(expression) == (value, None)


@pytest.mark.parametrize(
    "expression, message",
    [
        ("2**10**10", "result too large (over 100 digits)"),
        ("10 ** 100", "result too large (over 100 digits)"),
        ("1e308 * 10", "result too large"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "result is not a real number"),
        ("__import__('os')", "not allowed: function calls"),
        ("x + 1", "not allowed: names"),
        ("(1).real", "not allowed: attributes"),
        ("1 << 3", "not allowed: the operator LShift"),
        ("'a' * 3", "not allowed: the constant 'a'"),
        ("True + 1", "not allowed: the constant True"),
        ("1 +", "invalid expression: '1 +'"),
        ("1" * 201, "expression longer than 200 characters"),
    ],
)
def test_the_calculator_refuses(expression, message):
    start = time.monotonic()
    text, kind = calc(expression)
    assert kind == "tool_error" and text.startswith(f"error: calculator: {message}")
    # refused before computing, never a long power
    assert time.monotonic() - start < 0.5


def test_the_calculators_schema_is_the_one_the_sft_data_renders():
    assert calculator_tool().schema() == tool_arith.CALCULATOR


def test_arguments_are_checked_against_the_schema():
    tool = calculator_tool()
    assert tool.call({}) == ("error: calculator: missing argument 'expression'", "bad_arguments")
    assert tool.call({"expression": "1", "x": 2}) == (
        "error: calculator: unexpected argument 'x' (expected expression)",
        "bad_arguments",
    )
    assert tool.call({"expression": 3}) == (
        "error: calculator: argument 'expression' must be of type string, got integer",
        "bad_arguments",
    )
    assert tool.call(["1 + 1"]) == (
        "error: calculator: arguments must be a JSON object, got array",
        "bad_arguments",
    )
    counts = Tool(
        "n", "", {"type": "object", "properties": {"n": {"type": "integer"}}}, lambda n=0: str(n)
    )
    assert counts.call({"n": True})[1] == "bad_arguments"  # a boolean is no integer in JSON
    assert (
        counts.call({"n": 2.5})[0] == "error: n: argument 'n' must be of type integer, got number"
    )
    assert counts.call({}) == ("0", None)
    assert MY_TOOL.call({"text": "a", "kind": None}) == ("a", None)  # a list of types


def test_a_tools_exception_becomes_one_line_and_its_kind_is_reported():
    def boom(text):
        raise ValueError("bad\nthing " + "x" * 500)

    tool = Tool("boom", "", MY_TOOL.parameters, boom)
    text, kind = tool.call({"text": "a"})
    assert kind == "tool_error" and text.startswith("error: boom: ValueError: bad thing xxx")
    assert "\n" not in text and len(text) <= len("error: boom: ") + 200
    assert Tool("t", "", MY_TOOL.parameters, lambda text: 3).call({"text": "a"})[1] == "tool_error"
    refusing = Tool(
        "t", "", MY_TOOL.parameters, lambda text: (_ for _ in ()).throw(ToolError("no, " + text))
    )
    assert refusing.call({"text": "never"}) == ("error: t: no, never", "tool_error")
    assert MY_TOOL.call({"text": "slow", "kind": "timeout"}) == ("slow", "timeout")


def test_the_python_tool_runs_code_in_the_sandbox():
    [tool] = resolve_tools(["python"], Sandbox(Limits(cpu_s=1, wall_s=1)))
    assert tool.schema()["function"]["parameters"]["required"] == ["code"]
    assert tool.call({"code": "print(6 * 7)"}) == ("42", None)
    assert tool.call({"code": "x = 1"}) == ("(no output)", None)
    assert tool.call({"code": "import time\ntime.sleep(10)"}) == ("timed out after 1 s", "timeout")
    assert tool.call({"code": "x = bytearray(2**31)"}) == (
        "memory limit (256 MB) exceeded",
        "limit",
    )
    text, kind = tool.call({"code": "1 / 0"})
    # the code's error, not the tool's
    assert kind is None and text.endswith("ZeroDivisionError: division by zero")


def test_the_python_tool_takes_another_executor():
    class Remote:
        def run(self, code):
            return Result(stdout=f"ran {len(code)} chars\n", stderr="", exit_code=0)

    assert python_tool(executor=Remote()).call({"code": "abc"}) == ("ran 3 chars", None)
    with pytest.raises(ValueError, match="not both"):
        python_tool(executor=Remote(), limits=Limits())


def test_resolve_tools_builtins_and_dotted_paths():
    tools = resolve_tools(
        ["calculator", "tests.unit.envs.test_tools.MY_TOOL", "tests.unit.envs.test_tools.make_tool"]
    )
    assert [t.name for t in tools] == ["calculator", "echo", "upper"]
    assert tools[2].call({"text": "ab"}) == ("AB", None)


@pytest.mark.parametrize(
    "names, message",
    [
        (["nope"], r"env.tools: 'nope' is not a built-in tool \(calculator or python\)"),
        (
            ["no_such_module.tool"],
            r"env.tools: cannot import no_such_module.tool: ModuleNotFoundError",
        ),
        (
            ["tests.unit.envs.test_tools.MISSING"],
            r"env.tools: cannot import tests.unit.envs.test_tools.MISSING: AttributeError",
        ),
        (
            ["tests.unit.envs.test_tools.NOT_A_TOOL"],
            r"env.tools: tests.unit.envs.test_tools.NOT_A_TOOL is a int, not a Tool",
        ),
        (
            ["tests.unit.envs.test_tools.calc"],
            r"env.tools: tests.unit.envs.test_tools.calc\(\) raised TypeError",
        ),
        (["calculator", "calculator"], r"env.tools: two tools are named 'calculator'"),
    ],
)
def test_resolve_tools_errors_name_the_key_and_the_entry(names, message):
    with pytest.raises(ConfigError, match=message):
        resolve_tools(names)


def test_one_call():
    p = parse_hermes(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>'
    )
    assert (
        p.calls == [ToolCall("calculator", {"expression": "3*4"})]
        and p.errors == []
        and p.content == ""
    )


def test_two_calls_with_text_around():
    text = (
        "Let me compute.\n"
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n'
        "Done."
    )
    p = parse_hermes(text)
    assert p.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    assert p.content == "Let me compute.\n\n\nDone."
    plain = parse_hermes("The answer is 4.")
    assert plain.calls == [] and plain.errors == [] and plain.content == "The answer is 4."


def test_malformed_calls_are_errors_in_their_place():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "b" "arguments": {}}</tool_call>'
        '<tool_call>{"name": "c"}</tool_call>'
    )
    p = parse_hermes(text)
    assert p.errors == ["error: tool call 2 is not valid JSON: Expecting ',' delimiter at char 13"]
    assert [type(x).__name__ for x in p.sequence] == ["ToolCall", "str", "ToolCall"]
    assert p.calls[1] == ToolCall("c", {})  # no arguments: none


@pytest.mark.parametrize(
    "body, message",
    [
        (
            '["calculator"]',
            'error: tool call 1 must be a JSON object {"name": ..., "arguments": {...}}, '
            "got an array",
        ),
        ('{"arguments": {}}', 'error: tool call 1 needs a "name"'),
        ('{"name": "", "arguments": {}}', 'error: tool call 1 needs a "name"'),
        (
            '{"name": "a", "arguments": [1]}',
            "error: tool call 1 (a): its arguments must be a JSON object, got an array",
        ),
        (
            '{"name": "a", "arguments": "3"}',
            "error: tool call 1 (a): its arguments must be a JSON object, got a number",
        ),
        (
            '{"name": "a", "arguments": "{x"}',
            "error: tool call 1 (a): its arguments are a string that is not valid JSON",
        ),
        ("", "error: tool call 1 is not valid JSON: Expecting value at char 0"),
    ],
)
def test_what_a_call_must_be(body, message):
    p = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert p.calls == [] and len(p.errors) == 1 and p.errors[0].startswith(message)


def test_arguments_as_a_json_string_are_accepted():
    p = parse_hermes('<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert p.calls == [ToolCall("a", {"x": 2})] and p.errors == []


def test_a_missing_closing_tag_at_the_end():
    p = parse_hermes('Sure. <tool_call>{"name": "a", "arguments": {"x": 1}}')
    assert p.calls == [ToolCall("a", {"x": 1})] and p.content == "Sure."
    p = parse_hermes('<tool_call>{"name": "a", "arguments": {"x": 1')
    assert p.calls == [] and p.errors[0].startswith(
        "error: tool call 1 is not valid JSON (and has no closing"
    )


def test_format_call_round_trips():
    call = ToolCall("calculator", {"expression": "3*4"})
    assert (
        format_call(call)
        == '<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>'
    )
    for c in (
        call,
        ToolCall("search", {"q": "café ☕", "n": 3, "deep": {"a": [1, None, True]}}),
        ToolCall("t", {}),
    ):
        p = parse_hermes(format_call(c))
        assert p.calls == [c] and p.errors == [] and p.content == ""
    assert "☕" in format_call(ToolCall("s", {"q": "☕"}))  # not escaped


def test_resolve_parser():
    assert resolve_parser("hermes") is parse_hermes
    assert resolve_parser("tests.unit.envs.test_tools.my_parser")(
        '[call]{"name": "a"}[/call]'
    ).calls == [ToolCall("a")]
    with pytest.raises(
        ConfigError, match=r"env.tool_parser=nope: not a built-in parser \(hermes\)"
    ):
        resolve_parser("nope")
    with pytest.raises(
        ConfigError, match=r"env.tool_parser=no_such_module.parse: cannot import it"
    ):
        resolve_parser("no_such_module.parse")
    with pytest.raises(
        ConfigError,
        match=r"env.tool_parser=tests.unit.envs.test_tools.NOT_A_TOOL: a int is not callable",
    ):
        resolve_parser("tests.unit.envs.test_tools.NOT_A_TOOL")


def test_execute_answers_every_call_in_order_and_counts():
    tools = {t.name: t for t in resolve_tools(["calculator", "tests.unit.envs.test_tools.MY_TOOL"])}
    text = (
        "Thinking.\n"
        + format_call(ToolCall("calculator", {"expression": "3 * 4"}))
        + format_call(ToolCall("search", {"q": "x"}))
        + "<tool_call>{bad json}</tool_call>"
        + format_call(ToolCall("calculator", {"expr": "1"}))
        + format_call(ToolCall("calculator", {"expression": "1/0"}))
        + format_call(ToolCall("echo", {"text": "slow", "kind": "timeout"}))
        + format_call(ToolCall("echo", {"text": "big", "kind": "limit"}))
    )
    messages, counts = execute(text, tools, parse_hermes)
    assert [(m["role"], m["name"]) for m in messages] == [
        ("tool", "calculator"),
        ("tool", "error"),
        ("tool", "error"),
        ("tool", "calculator"),
        ("tool", "calculator"),
        ("tool", "echo"),
        ("tool", "echo"),
    ]
    assert messages[0]["content"] == "12"
    assert messages[1]["content"] == "error: unknown tool 'search' (available: calculator or echo)"
    assert messages[2]["content"].startswith("error: tool call 3 is not valid JSON")
    assert messages[3]["content"] == "error: calculator: missing argument 'expression'"
    assert messages[4]["content"] == "error: calculator: division by zero"
    assert counts == {"tool_calls": 7, "tool_errors": 4, "tool_timeouts": 1, "tool_limits": 1}
    assert execute("The answer is 12.", tools, parse_hermes) == (
        [],
        {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_limits": 0},
    )
