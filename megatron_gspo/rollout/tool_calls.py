"""The model's tool calls as Qwen3 writes them, one JSON object per block:

    <tool_call>
    {"name": "calc", "arguments": {"expr": "37*48"}}
    </tool_call>

`parse_tool_calls` reads every block of a turn (text outside blocks is ignored) and lists one
short error per malformed block; rollout/tools.py's `call_tool` answers each call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it: the tool's name and its keyword arguments."""

    name: str
    arguments: dict


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _parse_block(body: str) -> ToolCall | str:
    """The call in one block's text, or why it is not one."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except RecursionError:  # (the parser recurses per level: 10,000 nested brackets)
        return "invalid JSON (nested too deeply)"
    if not isinstance(obj, dict):
        return f"not a JSON object but a {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return 'missing "name" (a string)'
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return '"arguments" is a string but not JSON'
    if not isinstance(arguments, dict):
        return f'"arguments" is not a JSON object but a {type(arguments).__name__}'
    return ToolCall(name=name, arguments=arguments)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The calls in every <tool_call>...</tool_call> block of `text`, in order, and one short
    error per malformed block (numbered from 1 among all blocks). An opening tag followed by
    another opening tag, or by none and no closing tag, is an unclosed block."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    start, index = text.find(_OPEN), 0
    while start != -1:
        index += 1
        body_start = start + len(_OPEN)
        end, following = text.find(_CLOSE, body_start), text.find(_OPEN, body_start)
        if end == -1 or (following != -1 and following < end):
            errors.append(f"<tool_call> {index}: no closing </tool_call>")
            start = following
            continue
        parsed = _parse_block(text[body_start:end])
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            errors.append(f"<tool_call> {index}: {parsed}")
        start = text.find(_OPEN, end + len(_CLOSE))
    return calls, errors
