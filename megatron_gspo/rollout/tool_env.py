"""The built-in tool-calling environment (`env.fn: tools`, `env.tools: [calc, my_pkg.tools:f]`).

The prompt is the data row's prompt as a user message, rendered by the tokenizer's chat template
with the tools' schemas (`apply_chat_template(..., tools=)`). Each model turn is searched for
Qwen3's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (rollout/tools.py); each
call runs and its result goes back as a `tool` message, as the template renders it (a malformed
block gets an `error: ...` result, which the model sees). A turn without a tool call is the final
answer: the episode is done, and `reward.fn` scores that turn.

The episode, its tools with it, lives in an environment worker process (rollout/env.py): a tool
that hangs, spins, raises SystemExit or kills its process ends its episode there, bounded by
env.timeout_s, like any other environment's step.
"""

from __future__ import annotations

import asyncio

from megatron_gspo.rollout.env import Step, Turn
from megatron_gspo.rollout.tool_calls import parse_tool_calls
from megatron_gspo.rollout.tools import Tool, call_tool, resolve_tools


class ToolEpisode:
    def __init__(self, row, tools: dict[str, Tool], loop: asyncio.AbstractEventLoop | None = None):
        """`loop`: where `async def` tools run (one for the worker's life)."""
        self.row, self._tools, self._loop = row, tools, loop
        self.tools = [t.schema for t in tools.values()]  # what the chat template lists

    def prompt(self) -> list[dict]:
        return [{"role": "user", "content": self.row.prompt}]

    def step(self, turn: Turn) -> Step:
        calls, errors = parse_tool_calls(turn.text)
        if not calls and not errors:
            return Step(done=True)
        results = [call_tool(self._tools, c, self._loop) for c in calls]
        results += [f"error: {e}" for e in errors]
        return Step(observation=[{"role": "tool", "content": r} for r in results])


def tool_env(specs: list[str]):
    """The episode factory of `env.fn: tools` with the tools `specs` name."""
    tools = resolve_tools(specs)
    loop = asyncio.new_event_loop()  # (the `async def` tools' calls, on one loop)

    def start(row) -> ToolEpisode:
        return ToolEpisode(row, tools, loop)

    return start
