"""Prompt datasets: the built-in tasks, or JSONL / Parquet files with `prompt` and `answer` fields.

A broken row (a line that is not a JSON object, a missing or empty field, a field of the wrong
type) is skipped and counted in `PromptSet.skipped` (`broken_rows` says so in one line, and makes
more than MAX_BROKEN of the rows an error); a dataset that cannot be used at all (a missing file,
an unknown extension, no usable row) is a UserError naming the fix.

`answer` may be a string or a number (written as a string: 18, 0.5); `prompt` must be a string.
"""

from __future__ import annotations

import json
import numbers
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_gspo.data.tasks import SPLITS, TASKS, task_rows
from megatron_gspo.errors import UserError

BUILTIN = "builtin:"
FORMATS = (".jsonl", ".parquet")
MAX_BROKEN = 0.10  # more broken rows than this: the file is wrong, not a few of its rows
_FIELDS = ("prompt", "answer")
ROW_RULE = "each row needs a non-empty string 'prompt' and a non-empty string or number 'answer'"


@dataclass
class PromptRow:
    prompt: str
    answer: str
    extra: dict = field(default_factory=dict)  # the dataset row's other fields (environments)


@dataclass
class PromptSet:
    rows: list[PromptRow]
    skipped: int  # broken rows left out
    source: str


def load_prompts(source: str, split: str = "train", seed: int = 0) -> PromptSet:
    """Rows of `source`: "builtin:<task>" (its `split`, in an order shuffled by `seed`) or a file.

    A file is one split as it stands: `split` and `seed` do not apply to it (give the eval set as
    its own file); its rows keep the file's order.
    """
    check_source(source, split)
    if source.startswith(BUILTIN):
        return _load_builtin(source, split, seed)
    path = Path(source)
    rows, skipped = _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
    if not rows:
        raise UserError(
            f"prompt dataset {source!r} has no usable row ({skipped} broken); {ROW_RULE}"
        )
    return PromptSet(rows=rows, skipped=skipped, source=source)


def check_source(source: str, split: str = "train") -> None:
    """What `load_prompts` refuses before it reads a row: an unknown built-in task or split, a
    file of another format, a file that is not there. Cheap (no row is read), so each rank of a
    trainer checks it before the ranks first meet and every rank says the same line."""
    if source.startswith(BUILTIN):
        task = source[len(BUILTIN) :]
        if task not in TASKS:
            raise UserError(f"unknown built-in task {task!r}; choose one of: {', '.join(TASKS)}")
        if split not in SPLITS:
            raise UserError(f"unknown split {split!r} for {source}; use 'train' or 'eval'")
        return
    path = Path(source)
    if path.suffix not in FORMATS:
        raise UserError(
            f"prompt dataset {source!r}: unknown format; give a .jsonl or .parquet file with "
            f"'prompt' and 'answer' fields, or builtin:<task> ({', '.join(sorted(TASKS))})"
        )
    if not path.is_file():
        raise UserError(f"prompt dataset {source!r} does not exist; check the path")


def broken_rows(ps: PromptSet, key: str) -> str | None:
    """One line saying how many rows of `ps` (the dataset of config key `key`) were skipped as
    broken, None if none; a UserError when more than MAX_BROKEN of its rows are."""
    if not ps.skipped:
        return None
    total = len(ps.rows) + ps.skipped
    if ps.skipped > MAX_BROKEN * total:
        raise UserError(
            f"{key} {ps.source!r}: {ps.skipped} of {total} rows are broken (more than "
            f"{MAX_BROKEN:.0%}); {ROW_RULE}: fix the file or drop those rows"
        )
    rows = "row" if ps.skipped == 1 else "rows"
    return f"{key} {ps.source}: skipped {ps.skipped} broken {rows} of {total}"


def _load_builtin(source: str, split: str, seed: int) -> PromptSet:
    rows = [PromptRow(p, a) for p, a in task_rows(source[len(BUILTIN) :], split)]
    random.Random(seed).shuffle(rows)
    return PromptSet(rows=rows, skipped=0, source=source)


def _row(record: object) -> PromptRow | None:
    """The row in `record`, or None when it is broken."""
    if not isinstance(record, dict):
        return None
    prompt, answer = record.get("prompt"), record.get("answer")
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(prompt, str) or not isinstance(answer, str):
        return None
    if not prompt.strip() or not answer.strip():
        return None
    return PromptRow(prompt, answer, {k: v for k, v in record.items() if k not in _FIELDS})


def _read_jsonl(path: Path) -> tuple[list[PromptRow], int]:
    rows, skipped = [], 0
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:  # (a byte-order mark some editors write opens the file, not its first row)
                row = _row(json.loads(line.decode("utf-8-sig" if i == 0 else "utf-8")))
            except (UnicodeDecodeError, json.JSONDecodeError):
                row = None
            if row is None:
                skipped += 1
            else:
                rows.append(row)
    return rows, skipped


def _read_parquet(path: Path) -> tuple[list[PromptRow], int]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise UserError(f"prompt dataset {str(path)!r} is not a readable Parquet file ({e})") from e
    missing = [c for c in ("prompt", "answer") if c not in table.column_names]
    if missing:
        raise UserError(
            f"prompt dataset {str(path)!r} has no column {' or '.join(map(repr, missing))} "
            f"(it has {', '.join(table.column_names) or 'none'}); name the columns 'prompt' "
            "and 'answer'"
        )
    rows, skipped = [], 0
    for record in table.to_pylist():
        row = _row(record)
        if row is None:
            skipped += 1
        else:
            rows.append(row)
    return rows, skipped


class PromptSampler:
    """Batches of row indices: a fresh permutation of the rows each epoch, `batch_size` at a time
    (`batch_size`: rollout.prompts_per_step, which its errors name).

    Epoch e's order is a permutation drawn from numpy's generator seeded with (seed, e), so any
    position in the stream can be rebuilt from (epoch, pos) alone. The last n_rows % batch_size
    rows of each epoch are left out (different rows each epoch), so a batch never repeats a row.
    """

    def __init__(self, n_rows: int, batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise UserError(f"rollout.prompts_per_step must be at least 1, got {batch_size}")
        if n_rows < batch_size:
            raise UserError(
                f"the prompt dataset has {n_rows} usable rows, fewer than the {batch_size} "
                "prompts a step needs; lower rollout.prompts_per_step or give more rows"
            )
        self.n_rows, self.batch_size, self.seed = n_rows, batch_size, seed
        self.epoch, self.pos = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_rows).tolist()

    def next_batch(self) -> list[int]:
        if self.pos + self.batch_size > self.n_rows:
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        batch = self._order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return batch

    def state_dict(self) -> dict:
        return {
            "n_rows": self.n_rows,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "epoch": self.epoch,
            "pos": self.pos,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = (self.n_rows, self.batch_size, self.seed)
        theirs = tuple(state.get(k) for k in ("n_rows", "batch_size", "seed"))
        if mine != theirs:
            raise UserError(
                f"the saved prompt order is for (rows, batch size, seed) = {theirs}, this run has "
                f"{mine}; resume with the same data.train, rollout.prompts_per_step and seed"
            )
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._permutation(self.epoch)


def encode_prompt(tokenizer, text: str, template: str = "{prompt}") -> list[int]:
    """Token ids of `template` with `{prompt}` replaced by `text`; no special tokens are added."""
    if "{prompt}" not in template:
        raise UserError(f"prompt template {template!r} has no '{{prompt}}'; add it")
    try:
        full = template.format(prompt=text)
    except (KeyError, IndexError, ValueError) as e:
        raise UserError(
            f"prompt template {template!r} cannot be filled ({e!r}); its only field is "
            "{prompt}, and literal braces are written {{ and }}"
        ) from e
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    if not ids:
        raise UserError(f"prompt {text!r} encodes to no tokens; check the prompt and template")
    return list(ids)
