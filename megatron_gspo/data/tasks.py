"""Built-in verifiable tasks with exact answers, split into train and eval by a hash of the prompt.

arith and sort enumerate every prompt they have; sortlong, whose 10^10 prompts are too many, has a
fixed set of SORTLONG_PROMPTS distinct ones drawn from random.Random(SORTLONG_SEED), the same for
every caller. A prompt belongs to `eval` when the first 8 bytes of its SHA-256, as an integer, are
divisible by EVAL_EVERY, else to `train`. The split depends on the prompt text only (not on a
seed), so no prompt is ever in both, whatever the caller's seed.

Prompts use only words of the tiny tokenizer (hf/tiny.py): digits, `+ ?` and a few words.
Answers are written without spaces ("15"); the tiny tokenizer decodes digits with spaces
("1 5"), which the exact-answer reward ignores. calc_tool's model has the chars tokenizer.

  arith     "what is 7 + 5 + 3 ?" -> "15"     three digits 0-9: 1000 prompts, ~200 held out
  sort      "sort 3 1 2" -> "123"             three digits 0-9: 1000 prompts, ~200 held out
  sortlong  "sort 3 1 4 1 5 9 2 6 5 3"        ten digits 0-9: 8000 prompts, 1562 held out
              -> "1,1,2,3,3,4,5,5,6,9"        19 tokens (+ EOS): the long answer of the drift regime
  sortlong20  the same with twenty digits     8000 prompts; 39 tokens (+ EOS): the answer-length
                                              lever of the drift regime
  calc_tool "what is 37*48 ?" -> "1776"       two numbers 10-99: 8100 prompts, 1662 held out;
                                              a calc tool is offered (data/transcripts.py)

`sloppy_answer` is the typical mistake of each task, which the starting checkpoint is taught to
make (data/warmstart.py): arith writes only the last digit of a two-digit sum ("5" for 15, the
carry forgotten), sort gives the digits back in the order they came. Each is wrong on 78% of the
prompts (220 of 1000 sums are below 10; 220 of 1000 triples are already sorted). sortlong sorts
all digits but the last one given and puts that one at the end ("1,1,2,3,4,5,5,6,9,3", a loop
that stops one short): the answer leaves the right one where that digit belongs, so the point
where it goes wrong is spread along the answer, not at its first token. It is wrong on 84% of
the prompts (6731 of 8000: right where the last digit is the largest). calc_tool multiplies
without the cross terms, (a//10)*(b//10)*100 + (a%10)*(b%10) (1776 -> 1256 for 37*48), the
mental-arithmetic slip; it is right only where a%10 = b%10 = 0 (81 of 8100 prompts).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable

EVAL_EVERY = 5
SPLITS = ("train", "eval")
SORTLONG_PROMPTS, SORTLONG_SEED = 8000, 22
SORTLONG_DIGITS = {"sortlong": 10, "sortlong20": 20}  # digits to sort, per task


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


def _sortlong(n_digits: int) -> list[tuple[str, str]]:
    rng = random.Random(SORTLONG_SEED)  # a fixed prompt set, whatever the caller's seed
    seen: set[tuple[int, ...]] = set()
    rows = []
    while len(rows) < SORTLONG_PROMPTS:
        digits = tuple(rng.randrange(10) for _ in range(n_digits))
        if digits not in seen:
            seen.add(digits)
            rows.append(("sort " + " ".join(map(str, digits)), ",".join(map(str, sorted(digits)))))
    return rows


def _calc_tool() -> list[tuple[str, str]]:
    return [
        (f"what is {a}*{b} ?", str(a * b)) for a, b in itertools.product(range(10, 100), repeat=2)
    ]


TASKS: dict[str, Callable[[], list[tuple[str, str]]]] = {
    "arith": _arith,
    "sort": _sort,
    "sortlong": lambda: _sortlong(SORTLONG_DIGITS["sortlong"]),
    "sortlong20": lambda: _sortlong(SORTLONG_DIGITS["sortlong20"]),
    "calc_tool": _calc_tool,
}


def sloppy_answer(task: str, prompt: str, answer: str) -> str:
    """The task's typical wrong answer to `prompt` (equal to `answer` where it happens to be right)."""
    if task == "arith":
        return answer[-1]
    if task == "sort":
        return "".join(prompt.split()[1:])
    if task in SORTLONG_DIGITS:
        digits = prompt.split()[1:]
        return ",".join(sorted(digits[:-1]) + digits[-1:])
    if task == "calc_tool":
        a, b = map(int, prompt.split()[2].split("*"))
        return str((a // 10) * (b // 10) * 100 + (a % 10) * (b % 10))
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
