"""Environments of the episode tests, as their worker processes import them
(`tests.e2e.envs:NAME`); free of heavy imports."""

from __future__ import annotations

import json

from megatron_gspo.rollout.env import Step


class Scripted:
    """Answers turn 0 with a tool message, turn 1 with text, turn 2 with token ids, then done;
    appends each turn's ids to the file `row.extra["seen"]`."""

    def __init__(self, row):
        self.row = row

    def prompt(self):
        return [{"role": "user", "content": self.row.prompt}]

    def step(self, turn):
        with open(self.row.extra["seen"], "a") as f:
            f.write(json.dumps(turn.ids) + "\n")
        answers = [
            Step([{"role": "tool", "content": "42"}]),
            Step("ok?"),
            Step([5, 6, 7]),
            Step(done=True, reward=0.75),
        ]
        return answers[turn.index]


class Endless:
    """Never done: answers every turn with 4 token ids."""

    def __init__(self, row):
        pass

    def step(self, turn):
        return Step([10, 11, 12, 13])


class Flood:
    """Answers with 30 million characters of text (a log, a file), far past any episode's room."""

    def __init__(self, row):
        pass

    def step(self, turn):
        return Step("log line\n" * 3_000_000 + "end")
