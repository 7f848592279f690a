"""Tools for tool-calling rollouts: what the model may call, how its calls are read, what it is told.

A tool is a Python function plus its JSON schema in the OpenAI / Hugging Face function format,
the form `tokenizer.apply_chat_template(messages, tools=[schema, ...])` renders into the prompt:

    {"type": "function", "function": {"name": "calc", "description": "Evaluate ...",
     "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                    "required": ["expr"]}}}

`@tool` derives that schema from the function's signature (str -> "string", int -> "integer",
float -> "number", bool -> "boolean", anything else -> "string"; a parameter without a default is
required) and the first line of its docstring, and registers the tool by name in REGISTRY.
`resolve_tools` turns the config's specs ("calc", "module:function" or "path/to/file.py:function",
the module imported as env.fn's and reward.fn's are) into {name: Tool}.

The model calls tools the way Qwen3 writes them, one JSON object per block:

    <tool_call>
    {"name": "calc", "arguments": {"expr": "37*48"}}
    </tool_call>

`parse_tool_calls` (rollout/tool_calls.py) reads every block of a turn and lists one short error
per malformed block; `call_tool` runs one call and returns the text fed back to the
model. A failing call (unknown tool, wrong arguments, an exception in the tool) becomes the text
"error: ..." shown to the model, as Qwen-Agent and verl do; it is never raised. A tool may be
`async def`: its result is awaited, not shown to the model as a coroutine. A generator function
is refused when the tools are resolved (`yield` the model would see as a generator object).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import operator
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_gspo.errors import UserError
from megatron_gspo.rewards.plugin import import_user_module
from megatron_gspo.rollout.tool_calls import ToolCall

MAX_RESULT_CHARS = 2000  # the most text one call feeds back to the model
_TRUNCATED = " ... (truncated)"


@dataclass(frozen=True)
class Tool:
    """A callable the model may use, with the function schema the chat template shows it."""

    name: str
    fn: Callable[..., object]
    schema: dict


REGISTRY: dict[str, Tool] = {}  # the tools known by name ("calc"), filled by @tool

# ---------------------------------------------------------------------------------------------
# schema derivation and the registry

# by type, and by name for annotations left as strings (`from __future__ import annotations`)
_JSON_TYPES: dict[object, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_JSON_TYPES |= {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}


def _annotations(fn: Callable[..., object]) -> dict[str, object]:
    """The parameters' annotations, resolved where they can be (string annotations otherwise)."""
    try:
        return typing.get_type_hints(fn)
    except Exception:  # a name the annotation uses is not importable: keep the strings
        return dict(getattr(fn, "__annotations__", {}))


def _json_type(annotation: object) -> str:
    try:
        return _JSON_TYPES.get(annotation, "string")
    except TypeError:  # an unhashable annotation
        return "string"


def function_schema(
    fn: Callable[..., object], name: str | None = None, description: str | None = None
) -> dict:
    """The OpenAI / HF function schema of `fn` (see the module docstring)."""
    hints = _annotations(fn)
    properties: dict[str, dict] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue  # *args / **kwargs have no name the model could fill
        properties[param.name] = {"type": _json_type(hints.get(param.name))}
        if param.default is param.empty:
            required.append(param.name)
    if description is None:  # the docstring's first line
        description = (inspect.getdoc(fn) or "").strip().split("\n")[0].strip()
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {
            "name": name or fn.__name__,
            "description": description,
            "parameters": parameters,
        },
    }


def make_tool(
    fn: Callable[..., object], name: str | None = None, description: str | None = None
) -> Tool:
    """`fn` as a Tool, its schema derived from its signature and docstring (not registered).
    A generator function is refused: the model would be shown "<generator object ...>"."""
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        kind = "an async generator" if inspect.isasyncgenfunction(fn) else "a generator"
        raise UserError(
            f"tool {name or getattr(fn, '__name__', repr(fn))!r} ({_where(fn)}) is {kind} "
            "function (it yields); a tool must return its result: return the text (e.g. "
            "''.join of what it yields) instead"
        )
    schema = function_schema(fn, name, description)
    return Tool(name=schema["function"]["name"], fn=fn, schema=schema)


def register(new: Tool) -> Tool:
    """Add `new` to REGISTRY; the same tool twice is fine, another tool under its name is not."""
    existing = REGISTRY.get(new.name)
    if existing is not None and existing != new:
        raise UserError(
            f"tool {new.name!r} is registered twice ({_where(existing.fn)} and {_where(new.fn)}); "
            "give one of them another name with @tool(name=...)"
        )
    REGISTRY[new.name] = new
    return new


def _where(fn: Callable[..., object]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def tool(
    fn: Callable[..., object] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
) -> Any:
    """Register a function as a tool: `@tool` or `@tool(name=..., description=...)`.

    The function is returned unchanged (it stays callable as itself); its Tool is in REGISTRY.
    """

    def decorate(f: Callable[..., object]) -> Callable[..., object]:
        register(make_tool(f, name, description))
        return f

    return decorate if fn is None else decorate(fn)


# ---------------------------------------------------------------------------------------------
# resolving the config's specs


def _known() -> str:
    return ", ".join(sorted(REGISTRY)) or "none"


def _import_attr(spec: str) -> object:
    """The object "module:function" or "path/to/file.py:function" names, imported as env.fn's
    and reward.fn's code is (rewards/plugin.py)."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise UserError(
            f"tool {spec!r}: write it as a tool name ({_known()}), module:function or "
            "file.py:function"
        )
    module = import_user_module(spec, module_name, "tool")
    if not hasattr(module, attr):
        raise UserError(f"tool {spec!r}: {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def _resolve_one(spec: str) -> Tool:
    if ":" not in spec:
        if spec not in REGISTRY:
            raise UserError(
                f"tool {spec!r} is not a known tool; use one of {_known()}, module:function or "
                "file.py:function"
            )
        return REGISTRY[spec]
    obj = _import_attr(spec)
    if isinstance(obj, Tool):
        return obj
    if not callable(obj):
        raise UserError(
            f"tool {spec!r} is a {type(obj).__name__}, not a function; name a function "
            "(its signature becomes the tool's parameters)"
        )
    registered = [t for t in REGISTRY.values() if t.fn is obj]  # decorated with @tool
    if registered:
        return registered[0]
    try:
        return make_tool(obj)
    except (ValueError, TypeError) as e:  # (a builtin without a signature: max, print)
        raise UserError(
            f"tool {spec!r}: its parameters cannot be read ({e}); wrap it in a function with "
            "named parameters"
        ) from None


def resolve_tools(specs: list[str]) -> dict[str, Tool]:
    """{name: Tool} for the config's specs: registry names ("calc"), "module:function" or
    "path/to/file.py:function"."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        found = _resolve_one(spec)
        if tools.get(found.name, found) != found:
            raise UserError(
                f"tool {spec!r}: another tool in the list is also named {found.name!r}; "
                "rename one with @tool(name=...)"
            )
        tools[found.name] = found
    return tools


# ---------------------------------------------------------------------------------------------
# the built-in calculator

_CALC_MAX_CHARS = 200
_CALC_MAX_EXPONENT = 64
_CALC_MAX_VALUE = 1e18
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _checked(value: int | float) -> int | float:
    if isinstance(value, complex):  # a negative number to a fractional power
        raise ValueError("the result is not a real number")
    if not abs(value) <= _CALC_MAX_VALUE:  # NaN fails too
        raise ValueError(f"value out of range (|value| > {_CALC_MAX_VALUE:g})")
    return value


def _evaluate(node: ast.AST) -> int | float:
    """The value of an arithmetic node; anything but numbers and + - * / // % ** is refused."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        if isinstance(node.value, bool):
            raise ValueError(f"unsupported: the literal {node.value!r} (numbers only)")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _CALC_MAX_EXPONENT:
            raise ValueError(f"exponent out of range (|exponent| > {_CALC_MAX_EXPONENT})")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError(f"value out of range (|value| > {_CALC_MAX_VALUE:g})") from None
    if isinstance(node, ast.Constant):
        what = f"the literal {node.value!r}"
    else:
        what = type(node.op if isinstance(node, ast.BinOp | ast.UnaryOp) else node).__name__
    raise ValueError(f"unsupported: {what} (only numbers, + - * / // % ** and parentheses)")


@tool(name="calc", description="Evaluate an arithmetic expression")
def calc(expr: str) -> str:
    """Evaluate an arithmetic expression: + - * / // % **, unary + -, parentheses, int and float
    literals. "1776" for "37*48", "2" for "4/2" (an integral result prints as an int), else the
    shortest float repr. Bad or out-of-bounds input raises ValueError."""
    if not isinstance(expr, str):
        raise ValueError(f"expr must be a string, not {type(expr).__name__}")
    if len(expr) > _CALC_MAX_CHARS:
        raise ValueError(f"expression too long ({len(expr)} > {_CALC_MAX_CHARS} characters)")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {expr!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------
# answering the model's calls (rollout/tool_calls.py reads them)


def _cap(text: str) -> str:
    if len(text) <= MAX_RESULT_CHARS:
        return text
    return text[: MAX_RESULT_CHARS - len(_TRUNCATED)] + _TRUNCATED


def _error(message: str) -> str:
    return _cap("error: " + " ".join(message.split()))  # one line


async def _awaited(value: Any) -> Any:
    return await value


def _result(value: Any, loop: asyncio.AbstractEventLoop | None) -> Any:
    """What the tool returned, an `async def` tool's awaited on `loop` (None: a loop of its own)."""
    if not inspect.isawaitable(value):
        return value
    if loop is None:
        return asyncio.run(_awaited(value))
    return loop.run_until_complete(_awaited(value))


def call_tool(
    tools: dict[str, Tool], call: ToolCall, loop: asyncio.AbstractEventLoop | None = None
) -> str:
    """The text fed back to the model for `call`: str(result), at most MAX_RESULT_CHARS.

    An unknown tool, arguments its signature does not take, or an exception in the tool give
    "error: <one line>" (a ValueError by its message alone, other exceptions with their type).
    An `async def` tool is run to its end on `loop` (the one its worker keeps: a session the tool
    holds stays bound to it), or on a loop of its own.
    """
    found = tools.get(call.name)
    if found is None:
        known = ", ".join(sorted(tools)) or "none"
        return _error(f"unknown tool {call.name!r}; available: {known}")
    try:
        inspect.signature(found.fn).bind(**call.arguments)
    except TypeError as e:
        return _error(f"bad arguments for {call.name}: {e}")
    try:
        return _cap(str(_result(found.fn(**call.arguments), loop)))
    except ValueError as e:
        return _error(str(e) or "ValueError")
    except Exception as e:
        return _error(f"{type(e).__name__}: {e}")
