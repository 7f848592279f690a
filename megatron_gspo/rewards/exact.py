"""Exact-answer reward for the built-in tasks.

reward = 1.0 if strip_ws(response) == strip_ws(answer) else 0.0, where strip_ws removes every
whitespace character: the tiny tokenizer decodes "15" as "1 5", and the task's answer is "15".
The response is the decoded completion without special tokens (decode with
skip_special_tokens=True): anything else after the answer makes it wrong.
"""

from __future__ import annotations


def _strip_ws(text: str) -> str:
    return "".join(text.split())


def exact_answer(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response is the answer, ignoring whitespace; else 0.0."""
    return 1.0 if _strip_ws(response) == _strip_ws(answer) else 0.0
