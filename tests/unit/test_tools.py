"""Tools for tool-calling rollouts: the safe calculator, schemas derived from signatures, the
registry and specs, reading Qwen3 <tool_call> blocks, and the text a call feeds back."""

from __future__ import annotations

import json

import pytest

from megatron_gspo.errors import UserError
from megatron_gspo.rollout.tool_calls import ToolCall, parse_tool_calls
from megatron_gspo.rollout.tools import (
    MAX_RESULT_CHARS,
    REGISTRY,
    Tool,
    calc,
    call_tool,
    function_schema,
    resolve_tools,
    tool,
)

pytestmark = pytest.mark.unit


# module-level helpers, named by "tests.unit.test_tools:<name>" specs
def shout(text: str, times: int = 1) -> str:
    """Repeat a text in capitals."""
    return " ".join([text.upper()] * times)


def whisper(text: str) -> str:
    """Say it quietly."""
    return text.lower()


def _echo(text: str) -> str:
    return text


ECHO = Tool(
    name="echo",
    fn=_echo,
    schema={
        "type": "function",
        "function": {
            "name": "echo",
            "description": "Echo a text",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
            },
        },
    },
)
NOT_A_FUNCTION = 3


def countdown(n: int):
    """Count down (yields: not a tool)."""
    yield from range(n, 0, -1)


async def lines(text: str):
    """Each line (an async generator: not a tool)."""
    for line in text.splitlines():
        yield line


@pytest.fixture(autouse=True)
def registry():
    """The global registry as it was before each test (tests register tools of their own)."""
    saved = dict(REGISTRY)
    yield REGISTRY
    REGISTRY.clear()
    REGISTRY.update(saved)


# ---------------------------------------------------------------------------------------------
# calc


@pytest.mark.parametrize(
    "expr, value",
    [
        ("37*48", 37 * 48),
        ("2+3*4", 2 + 3 * 4),
        ("(2+3)*4", (2 + 3) * 4),
        ("2**3**2", 2**3**2),  # right-associative
        ("-2**2", -(2**2)),  # ** binds tighter than unary minus
        ("(-2)**2", (-2) ** 2),
        ("- -3", 3),
        ("+5-+3", 5 - 3),
        ("-(3-10)*2", -(3 - 10) * 2),
        ("3*(4+(5-1))/2", 3 * (4 + (5 - 1)) / 2),
        (" 1 + 2 ", 3),
        ("7//2", 7 // 2),
        ("-7//2", -7 // 2),
        ("7%3", 7 % 3),
        ("-7%3", -7 % 3),
        ("7.5%2", 7.5 % 2),
        ("9//2.0", 9 // 2.0),
        ("7/2", 7 / 2),
        ("0.1+0.2", 0.1 + 0.2),
        ("1e3/8", 1e3 / 8),
        ("2**-1", 2**-1),
        ("2**0.5", 2**0.5),
        ("2**59", 2**59),
        ("1**64", 1),
        ("10**18", 10**18),
        ("-10**18", -(10**18)),
    ],
)
def test_calc_values(expr, value):
    if isinstance(value, int):
        assert calc(expr) == str(value)
    else:
        assert float(calc(expr)) == value


@pytest.mark.parametrize(
    "expr, text",
    [
        ("37*48", "1776"),
        ("4/2", "2"),  # an integral float prints as an int
        ("1.5*4", "6"),
        ("-0.0", "0"),
        ("7/2", "3.5"),
        ("0.1+0.2", "0.30000000000000004"),  # the shortest repr of the float
        ("1/3", "0.3333333333333333"),
        ("-1/4", "-0.25"),
    ],
)
def test_calc_formats_integral_results_as_ints(expr, text):
    assert calc(expr) == text


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os')",
        "__import__('os').system('true')",
        "abs(-1)",
        "(1).real",
        "x",
        "x + 1",
        "(1, 2)[0]",
        "[1, 2]",
        "1 if 1 else 2",
        "lambda: 1",
        "1 < 2",
        "2 ^ 3",
        "1 << 3",
        "True + 1",
        "'a' * 3",
        "1j",
        "",
        "1 +",
        "1; 2",
        "2**1000",  # exponent past 64
        "1**65",
        "10**20*10**20",  # intermediate past 1e18
        "10**18+1",
        "2**64",
        "1e999",
        "9" * 19,
        "1e18*10",
        "(-8)**0.5",  # not a real number
        "1+" * 100 + "1",  # 201 characters
        "1/0",
        "1//0",
        "1%0",
        "1.0/0.0",
        "0**-1",
    ],
)
def test_calc_refuses(expr):
    with pytest.raises(ValueError):
        calc(expr)


def test_calc_refusal_messages():
    with pytest.raises(ValueError, match="^division by zero$"):
        calc("1/(2-2)")
    with pytest.raises(ValueError, match="exponent"):
        calc("2**1000")
    with pytest.raises(ValueError, match="too long"):
        calc("1+" * 100 + "1")
    with pytest.raises(ValueError, match="unsupported: Call"):
        calc("__import__('os')")
    with pytest.raises(ValueError, match="must be a string"):
        calc(5)  # type: ignore[arg-type]


def test_calc_takes_200_characters():
    expr = "1+" * 99 + "12"
    assert len(expr) == 200
    assert calc(expr) == str(99 + 12)


def test_calc_is_registered():
    assert REGISTRY["calc"].fn is calc
    assert REGISTRY["calc"].schema == {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression",
            "parameters": {
                "type": "object",
                "properties": {"expr": {"type": "string"}},
                "required": ["expr"],
            },
        },
    }


# ---------------------------------------------------------------------------------------------
# schemas and the registry


def test_the_decorator_derives_the_schema():
    def lookup(city: str, days: int, scale: float, metric: bool = True, note=None) -> str:
        """Look up the weather.

        More about it."""
        return city

    assert tool(lookup) is lookup  # returned unchanged
    assert REGISTRY["lookup"] == Tool(
        name="lookup",
        fn=lookup,
        schema={
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look up the weather.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                        "scale": {"type": "number"},
                        "metric": {"type": "boolean"},
                        "note": {"type": "string"},
                    },
                    "required": ["city", "days", "scale"],
                },
            },
        },
    )


def test_the_decorator_takes_a_name_and_description():
    @tool(name="weather", description="Today's weather")
    def lookup(city: str, *args, **kwargs) -> str:
        return city

    assert lookup("x") == "x"
    assert REGISTRY["weather"].fn is lookup
    assert REGISTRY["weather"].schema["function"] == {
        "name": "weather",
        "description": "Today's weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }


def test_string_annotations_that_do_not_resolve_still_map():
    def f(x: NoSuchType, n: int, flag: bool = False):  # noqa: F821
        pass

    assert function_schema(f)["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "x": {"type": "string"},
            "n": {"type": "integer"},
            "flag": {"type": "boolean"},
        },
        "required": ["x", "n"],
    }
    assert function_schema(f)["function"]["description"] == ""


def test_registering_a_name_twice():
    def first(a: str) -> str:
        return a

    def second(a: str) -> str:
        return a

    tool(name="dup")(first)
    tool(name="dup")(first)  # the same tool again is fine
    with pytest.raises(UserError, match="'dup' is registered twice"):
        tool(name="dup")(second)
    with pytest.raises(UserError, match="'calc' is registered twice"):
        tool(name="calc")(second)
    assert REGISTRY["dup"].fn is first and REGISTRY["calc"].fn is calc


# ---------------------------------------------------------------------------------------------
# resolve_tools


def test_resolve_by_name_and_by_module_function():
    tools = resolve_tools(["calc", "tests.unit.test_tools:shout", "tests.unit.test_tools:ECHO"])
    assert list(tools) == ["calc", "shout", "echo"]
    assert tools["calc"] is REGISTRY["calc"]
    assert tools["echo"] is ECHO
    assert tools["shout"].fn is shout
    assert tools["shout"].schema["function"] == {
        "name": "shout",
        "description": "Repeat a text in capitals.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
            "required": ["text"],
        },
    }
    assert "shout" not in REGISTRY  # a plain function is wrapped, not registered


MY_TOOLS = """from megatron_gspo.rollout.tools import tool


def mul(a: int, b: int) -> int:
    "Multiply."
    return a * b


@tool(name="neg")
def negate(x: int) -> int:
    "Negate."
    return -x
"""


def test_resolve_a_py_file_s_functions_importing_the_file_once(tmp_path):
    """ "path/to/file.py:function", as env.fn and reward.fn take it: two of its tools import it
    once (an @tool in it registered a second time, as another function, would be refused)."""
    path = tmp_path / "my_tools.py"
    path.write_text(MY_TOOLS)
    tools = resolve_tools([f"{path}:mul", f"{path}:negate", "calc"])
    assert list(tools) == ["mul", "neg", "calc"]
    assert tools["neg"] is REGISTRY["neg"]
    assert call_tool(tools, ToolCall("mul", {"a": 37, "b": 48})) == str(37 * 48)
    assert call_tool(tools, ToolCall("neg", {"x": 5})) == "-5"
    assert resolve_tools([f"{path}:negate"])["neg"] is tools["neg"]


def test_resolve_a_decorated_function_keeps_its_registered_name():
    tool(name="quiet", description="Lower the voice")(whisper)
    tools = resolve_tools(["tests.unit.test_tools:whisper", "quiet"])
    assert tools == {"quiet": REGISTRY["quiet"]}


@pytest.mark.parametrize(
    "spec, words",
    [
        ("nosuch", ["'nosuch'", "not a known tool", "calc"]),
        (
            "nosuch.module:f",
            ["'nosuch.module:f'", "cannot import 'nosuch.module'", "give the path of a .py file"],
        ),
        ("nosuch.py:f", ["tool 'nosuch.py:f': file 'nosuch.py' does not exist"]),
        ("tests.unit.test_tools:missing", ["has no attribute 'missing'"]),
        ("tests.unit.test_tools:NOT_A_FUNCTION", ["is a int, not a function"]),
        (":f", ["module:function", "calc"]),
        ("tests.unit.test_tools:", ["module:function"]),
        (
            "builtins:max",
            [
                "tool 'builtins:max': its parameters cannot be read (no signature "
                "found for builtin",
                "wrap it in a function with named parameters",
            ],
        ),
    ],
)
def test_resolve_errors_name_the_spec_and_the_fix(spec, words):
    with pytest.raises(UserError) as e:
        resolve_tools([spec])
    message = str(e.value)
    assert "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("name, kind", [("countdown", "a generator"),
                                        ("lines", "an async generator")])  # fmt: skip
def test_a_generator_function_is_refused_as_a_tool(name, kind):
    """Its result was shown to the model as "<generator object ...>"."""
    with pytest.raises(UserError) as e:
        resolve_tools([f"tests.unit.test_tools:{name}"])
    assert str(e.value) == (
        f"tool {name!r} (tests.unit.test_tools.{name}) is {kind} function (it yields); a tool "
        "must return its result: return the text (e.g. ''.join of what it yields) instead"
    )
    with pytest.raises(UserError, match=f"is {kind} function"):
        tool(name="gen")(globals()[name])
    assert "gen" not in REGISTRY


def test_resolve_refuses_two_tools_of_one_name():
    tool(name="shout")(whisper)
    with pytest.raises(UserError, match="also named 'shout'"):
        resolve_tools(["shout", "tests.unit.test_tools:shout"])
    assert list(resolve_tools(["calc", "calc"])) == ["calc"]


# ---------------------------------------------------------------------------------------------
# parse_tool_calls

CALL = '{"name": "calc", "arguments": {"expr": "37*48"}}'


def test_parse_one_block():
    text = f"Let me compute.\n<tool_call>\n{CALL}\n</tool_call>"
    assert parse_tool_calls(text) == ([ToolCall("calc", {"expr": "37*48"})], [])


def test_parse_two_blocks_in_order():
    text = (
        f"<think>two sums</think>\n<tool_call>\n{CALL}\n</tool_call>\nand\n"
        '<tool_call>\n{"name": "shout", "arguments": {"text": "hi", "times": 2}}\n</tool_call>\n'
    )
    assert parse_tool_calls(text) == (
        [ToolCall("calc", {"expr": "37*48"}), ToolCall("shout", {"text": "hi", "times": 2})],
        [],
    )


@pytest.mark.parametrize(
    "block",
    [
        f"<tool_call>{CALL}</tool_call>",
        f"<tool_call>\n\n  {CALL}  \n\t</tool_call>",
        "<tool_call>\n" + json.dumps(json.loads(CALL), indent=2) + "\n</tool_call>",
        '<tool_call>{"name":"calc","arguments":"{\\"expr\\": \\"37*48\\"}"}</tool_call>',
    ],
)
def test_parse_whitespace_and_string_arguments(block):
    assert parse_tool_calls(block) == ([ToolCall("calc", {"expr": "37*48"})], [])


def test_parse_missing_arguments_is_empty():
    text = '<tool_call>{"name": "now"}</tool_call>'
    assert parse_tool_calls(text) == ([ToolCall("now", {})], [])


@pytest.mark.parametrize(
    "body, why",
    [
        ('{"name": "calc", "arguments": {"expr": }}', "invalid JSON (Expecting value"),
        ("", "invalid JSON"),
        ("[1, 2]", "not a JSON object but a list"),
        ('{"arguments": {}}', 'missing "name"'),
        ('{"name": 3}', 'missing "name"'),
        ('{"name": ""}', 'missing "name"'),
        ('{"name": "calc", "arguments": [1]}', '"arguments" is not a JSON object but a list'),
        ('{"name": "calc", "arguments": "[1]"}', '"arguments" is not a JSON object but a list'),
        ('{"name": "calc", "arguments": "expr=1"}', '"arguments" is a string but not JSON'),
    ],
)
def test_parse_malformed_blocks(body, why):
    text = f"<tool_call>\n{body}\n</tool_call> then <tool_call>\n{CALL}\n</tool_call>"
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("calc", {"expr": "37*48"})]  # the good block after it still counts
    assert len(errors) == 1 and errors[0].startswith(f"<tool_call> 1: {why}")


def test_parse_unclosed_tags():
    assert parse_tool_calls(f"<tool_call>\n{CALL}") == (
        [],
        ["<tool_call> 1: no closing </tool_call>"],
    )
    text = f"<tool_call>\n{CALL[:20]}\n<tool_call>\n{CALL}\n</tool_call>"
    assert parse_tool_calls(text) == (
        [ToolCall("calc", {"expr": "37*48"})],
        ["<tool_call> 1: no closing </tool_call>"],
    )


@pytest.mark.parametrize("text", ["", "The answer is 1776.", f"{CALL}", "</tool_call>"])
def test_parse_no_blocks(text):
    assert parse_tool_calls(text) == ([], [])


DEEP = 10_000  # levels: past the JSON parser's recursion limit


@pytest.mark.parametrize(
    "body, why",
    [
        ("[" * DEEP + "]" * DEEP, "invalid JSON (nested too deeply)"),
        ('{"name": "calc", "arguments": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}",
         "invalid JSON (nested too deeply)"),
        ('{"name": "calc", "arguments": "' + "[" * DEEP + "]" * DEEP + '"}',
         '"arguments" is a string but not JSON'),
    ],
)  # fmt: skip
def test_a_call_nested_10000_levels_deep_is_answered_as_malformed(body, why):
    """Not a RecursionError: the model is told its block is malformed, like any other."""
    text = f"<tool_call>\n{body}\n</tool_call> then <tool_call>\n{CALL}\n</tool_call>"
    assert parse_tool_calls(text) == (
        [ToolCall("calc", {"expr": "37*48"})],
        [f"<tool_call> 1: {why}"],
    )


# ---------------------------------------------------------------------------------------------
# call_tool


def _raises(text: str) -> str:
    raise RuntimeError(f"boom\n  at {text}")


def _long(n: int) -> str:
    return "x" * n


TOOLS = {
    "calc": REGISTRY["calc"],
    "boom": Tool("boom", _raises, {}),
    "long": Tool("long", _long, {}),
    "number": Tool("number", lambda: 42, {}),
}


def test_call_tool_returns_the_result_as_text():
    assert call_tool(TOOLS, ToolCall("calc", {"expr": "37*48"})) == "1776"
    assert call_tool(TOOLS, ToolCall("number", {})) == "42"


def test_call_tool_errors_are_text_for_the_model():
    assert call_tool(TOOLS, ToolCall("nope", {})) == (
        "error: unknown tool 'nope'; available: boom, calc, long, number"
    )
    assert call_tool(TOOLS, ToolCall("calc", {})) == (
        "error: bad arguments for calc: missing a required argument: 'expr'"
    )
    assert call_tool(TOOLS, ToolCall("calc", {"expr": "1", "x": 2})) == (
        "error: bad arguments for calc: got an unexpected keyword argument 'x'"
    )
    assert call_tool(TOOLS, ToolCall("calc", {"expr": "1/0"})) == "error: division by zero"
    assert call_tool(TOOLS, ToolCall("boom", {"text": "here"})) == (
        "error: RuntimeError: boom at here"  # one line
    )


def test_call_tool_caps_the_text():
    assert call_tool(TOOLS, ToolCall("long", {"n": MAX_RESULT_CHARS})) == "x" * 2000
    capped = call_tool(TOOLS, ToolCall("long", {"n": 5000}))
    assert len(capped) == 2000
    assert capped == "x" * (2000 - len(" ... (truncated)")) + " ... (truncated)"
    long_error = call_tool(TOOLS, ToolCall("boom", {"text": "y" * 5000}))
    assert len(long_error) == 2000 and long_error.startswith("error: RuntimeError: boom at yyy")


def test_parse_then_call():
    text = f"<tool_call>\n{CALL}\n</tool_call><tool_call>\n{CALL.replace('37*48', '4/2')}"
    calls, errors = parse_tool_calls(text)
    assert [call_tool(TOOLS, c) for c in calls] == ["1776"]
    assert errors == ["<tool_call> 2: no closing </tool_call>"]


# ---------------------------------------------------------------------------------------------
# the schema as transformers takes it


def test_transformers_renders_the_schema_and_derives_the_same_one():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    template = (
        "{% for t in tools %}<tools>{{ t | tojson }}</tools>{% endfor %}{{ messages[0].content }}"
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(
            tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")
        ),
        chat_template=template,
    )
    tools = resolve_tools(["calc", "tests.unit.test_tools:shout"])
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        tools=[t.schema for t in tools.values()],
        tokenize=False,
    )
    rendered = [json.loads(part.split("</tools>")[0]) for part in text.split("<tools>")[1:]]
    assert rendered == [t.schema for t in tools.values()]

    # transformers' own derivation (it needs Args: docs and adds their descriptions) agrees
    def lookup(city: str, days: int, scale: float, metric: bool = True) -> str:
        """Look up the weather.

        Args:
            city: c
            days: d
            scale: s
            metric: m
        """
        return city

    theirs = transformers.utils.get_json_schema(lookup)["function"]
    for prop in theirs["parameters"]["properties"].values():
        del prop["description"]
    theirs.pop("return", None)
    assert function_schema(lookup)["function"] == theirs
