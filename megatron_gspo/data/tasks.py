"""Built-in verifiable tasks with exact answers, split into train and eval by a hash of the prompt.

Each task enumerates every prompt it has; a prompt belongs to `eval` when the first 8 bytes of its
SHA-256, as an integer, are divisible by EVAL_EVERY, else to `train`. The split depends on the
prompt text only (not on a seed), so no prompt is ever in both, whatever the caller's seed.

Prompts use only words of the tiny tokenizer (model/tiny.py): digits, `+ ?` and a few words.
Answers are written without spaces ("15"); the tiny tokenizer decodes digits with spaces
("1 5"), which the exact-answer reward ignores.

  arith  "what is 7 + 5 + 3 ?" -> "15"      three digits 0-9: 1000 prompts, ~200 held out
  sort   "sort 3 1 2" -> "123"              three digits 0-9: 1000 prompts, ~200 held out

`sloppy_answer` is the typical mistake of each task, which the starting checkpoint is taught to
make (data/warmstart.py): arith writes only the last digit of a two-digit sum ("5" for 15, the
carry forgotten), sort gives the digits back in the order they came. Each is wrong on 78% of the
prompts (220 of 1000 sums are below 10; 220 of 1000 triples are already sorted).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable

EVAL_EVERY = 5
SPLITS = ("train", "eval")


def _arith() -> list[tuple[str, str]]:
    return [
        (f"what is {a} + {b} + {c} ?", str(a + b + c))
        for a, b, c in itertools.product(range(10), repeat=3)
    ]


def _sort() -> list[tuple[str, str]]:
    return [
        (f"sort {a} {b} {c}", "".join(sorted(f"{a}{b}{c}")))
        for a, b, c in itertools.product(range(10), repeat=3)
    ]


TASKS: dict[str, Callable[[], list[tuple[str, str]]]] = {"arith": _arith, "sort": _sort}


def sloppy_answer(task: str, prompt: str, answer: str) -> str:
    """The task's typical wrong answer to `prompt` (equal to `answer` where it happens to be right)."""
    if task == "arith":
        return answer[-1]
    if task == "sort":
        return "".join(prompt.split()[1:])
    raise KeyError(task)


def in_eval(prompt: str) -> bool:
    """True when `prompt` is held out: int(sha256(prompt)[:8]) % EVAL_EVERY == 0."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return int.from_bytes(digest[:8], "big") % EVAL_EVERY == 0


def task_rows(task: str, split: str) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of one split of a built-in task, in a fixed order."""
    if task not in TASKS:
        raise KeyError(task)
    if split not in SPLITS:
        raise ValueError(split)
    want_eval = split == "eval"
    return [row for row in TASKS[task]() if in_eval(row[0]) == want_eval]
