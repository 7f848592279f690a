"""Math answer checking with math-verify: reward = 1.0 when the response's final answer equals
the dataset's `answer` as mathematics (sympy-equivalent: 0.5 == 1/2 == \\frac{1}{2}), else 0.0.

The response's answer is what math-verify extracts: the last \\boxed{...} when there is one,
else the last LaTeX or plain expression (a final number). Digits separated by single spaces are
joined first ("1 5" -> "15"), since word-level tokenizers such as the tiny one decode each digit
as its own word. An answer that math-verify cannot parse scores 0.0.

math-verify bounds its parsing time with SIGALRM, which only the main thread may set; off the
main thread it runs without that bound. Training calls it on a worker process's main thread,
within reward.timeout_s as well (rewards/scoring.py).
"""

from __future__ import annotations

import re
import threading

_SPACED_DIGITS = re.compile(r"(?<=\d) (?=\d)")


def _timeout(seconds: int) -> int | None:
    return seconds if threading.current_thread() is threading.main_thread() else None


def math_answer(prompt: str, response: str, answer: str) -> float:
    """1.0 when math-verify finds the response's final answer equal to `answer`, else 0.0."""
    from math_verify import parse, verify

    gold = parse(answer, parsing_timeout=_timeout(5))
    pred = parse(_SPACED_DIGITS.sub("", response), parsing_timeout=_timeout(5))
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=_timeout(5)) else 0.0
