"""Prompt datasets: built-in task splits, JSONL / Parquet files with broken rows, the prompt
sampler's order and resume, and prompt encoding with the tiny tokenizer."""

import json
import re

import pytest

from megatron_gspo.data.prompts import PromptSampler, broken_rows, encode_prompt, load_prompts
from megatron_gspo.data.tasks import sloppy_answer
from megatron_gspo.errors import UserError
from megatron_gspo.hf.tiny import build_tokenizer, vocabulary

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny models' tokenizer, saved and loaded back the way a checkpoint's is."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(128),
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        unk_token="<unk>",
    ).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def _solve(task: str, prompt: str) -> str:
    if task == "calc_tool":
        a, b = map(int, re.fullmatch(r"what is (\d\d)\*(\d\d) \?", prompt).groups())
        return str(a * b)
    digits = [int(d) for d in re.findall(r"\d", prompt)]
    if task == "arith":
        return str(sum(digits))
    return ("," if task.startswith("sortlong") else "").join(map(str, sorted(digits)))


# every triple of digits once; sortlong: a fixed set of distinct ten-digit prompts
N_PROMPTS = {"arith": 1000, "sort": 1000, "sortlong": 8000, "sortlong20": 8000, "calc_tool": 8100}


@pytest.mark.parametrize("task", list(N_PROMPTS))
def test_builtin_splits_are_disjoint_complete_and_correct(task):
    train = load_prompts(f"builtin:{task}", "train")
    evals = load_prompts(f"builtin:{task}", "eval")
    train_p = {r.prompt for r in train.rows}
    eval_p = {r.prompt for r in evals.rows}
    assert not train_p & eval_p
    assert len(train.rows) == len(train_p) and len(evals.rows) == len(eval_p)
    assert len(train_p) + len(eval_p) == N_PROMPTS[task]
    assert 0.15 <= len(eval_p) / N_PROMPTS[task] <= 0.25  # about one in five held out
    for row in train.rows + evals.rows:
        assert row.answer == _solve(task, row.prompt)
    assert (train.skipped, train.source) == (0, f"builtin:{task}")


@pytest.mark.parametrize("task, n, held_out", [("sortlong", 10, 1562), ("sortlong20", 20, 1647)])
def test_sortlong_prompts_are_fixed_digit_lists(task, n, held_out):
    rows = load_prompts(f"builtin:{task}", "eval", seed=3).rows
    assert all(re.fullmatch(rf"sort( \d){{{n}}}", r.prompt) for r in rows)
    assert all(len(r.answer) == 2 * n - 1 for r in rows)  # n digits, n - 1 commas
    assert len(rows) == held_out  # the same set for every seed: only the order follows it
    assert {r.prompt for r in rows} == {
        r.prompt for r in load_prompts(f"builtin:{task}", "eval").rows
    }
    digits = [d for r in rows for d in r.prompt.split()[1:]]
    assert set(digits) == set("0123456789")


def test_builtin_seed_shuffles_order_not_membership():
    a, b = load_prompts("builtin:arith", "eval", seed=0), load_prompts("builtin:arith", "eval", 1)
    assert [r.prompt for r in a.rows] != [r.prompt for r in b.rows]
    assert sorted(r.prompt for r in a.rows) == sorted(r.prompt for r in b.rows)
    assert a.rows == load_prompts("builtin:arith", "eval", seed=0).rows


def test_sloppy_answers():
    assert sloppy_answer("arith", "what is 7 + 5 + 3 ?", "15") == "5"
    assert sloppy_answer("arith", "what is 1 + 2 + 3 ?", "6") == "6"
    assert sloppy_answer("sort", "sort 3 1 2", "123") == "312"
    rows = load_prompts("builtin:arith", "train").rows + load_prompts("builtin:arith", "eval").rows
    wrong = sum(sloppy_answer("arith", r.prompt, r.answer) != r.answer for r in rows)
    assert wrong == 1000 - 220  # sums of three digits >= 10: 1000 - C(12, 3)


def test_calc_tool_sloppy_answer_forgets_the_cross_terms():
    assert sloppy_answer("calc_tool", "what is 37*48 ?", "1776") == "1256"  # 1200 + 56
    assert sloppy_answer("calc_tool", "what is 12*13 ?", "156") == "106"
    rows = load_prompts("builtin:calc_tool", "train").rows
    rows += load_prompts("builtin:calc_tool", "eval").rows
    right = [r.prompt for r in rows if sloppy_answer("calc_tool", r.prompt, r.answer) == r.answer]
    assert len(right) == 81  # both numbers multiples of ten: no cross terms to forget
    assert all(re.fullmatch(r"what is \d0\*\d0 \?", p) for p in right)


def test_sortlong_sloppy_answer_puts_the_last_digit_at_the_end():
    prompt, answer = "sort 3 1 4 1 5 9 2 6 5 3", "1,1,2,3,3,4,5,5,6,9"
    assert sloppy_answer("sortlong", prompt, answer) == "1,1,2,3,4,5,5,6,9,3"
    assert sloppy_answer("sortlong", "sort 5 1 8 9 4 3 9 1 7 0", "") == "1,1,3,4,5,7,8,9,9,0"
    # right where the last digit is the largest (ties included)
    assert sloppy_answer("sortlong", "sort 9 0 0 0 0 0 0 0 0 9", "") == "0,0,0,0,0,0,0,0,9,9"
    twenty = "sort 3 1 4 1 5 9 2 6 5 3 5 8 9 7 9 3 2 3 8 4"
    assert sloppy_answer("sortlong20", twenty, "") == "1,1,2,2,3,3,3,3,4,5,5,5,6,7,8,8,9,9,9,4"
    rows = load_prompts("builtin:sortlong", "train").rows
    rows += load_prompts("builtin:sortlong", "eval").rows
    sloppy = [sloppy_answer("sortlong", r.prompt, r.answer) for r in rows]
    assert sum(s != r.answer for s, r in zip(sloppy, rows)) == 6731  # of 8000
    assert all(sorted(s) == sorted(r.answer) for s, r in zip(sloppy, rows))  # the same digits
    # where it first leaves the answer is spread along it: at any digit but the last
    first = {
        next(i for i, (a, b) in enumerate(zip(s, r.answer)) if a != b)
        for s, r in zip(sloppy, rows)
        if s != r.answer
    }
    assert first == set(range(0, 18, 2))


def test_sortlong_answers_are_long_in_the_tiny_tokenizer(tokenizer):
    rows = load_prompts("builtin:sortlong", "eval").rows[:200]
    for row in rows:
        for text in (row.answer, sloppy_answer("sortlong", row.prompt, row.answer)):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert 16 <= len(ids) + 1 <= 64  # with EOS: 10 digits, 9 commas, EOS = 20
            assert len(ids) == 19 and tokenizer.unk_token_id not in ids
            assert "".join(tokenizer.decode(ids).split()) == text  # what the reward compares


def test_builtin_errors():
    with pytest.raises(UserError, match="unknown built-in task 'nope'.*arith"):
        load_prompts("builtin:nope")
    with pytest.raises(UserError, match="unknown split 'test'"):
        load_prompts("builtin:arith", "test")


def test_jsonl_broken_rows_are_skipped_and_counted(tmp_path):
    lines = [
        json.dumps({"prompt": "what is 1 + 1 ?", "answer": "2"}),
        json.dumps({"prompt": "p2", "answer": 18, "extra": [1]}),  # a number answer is kept
        "",  # blank lines are not rows
        "{not json",
        json.dumps(["prompt", "answer"]),
        json.dumps({"prompt": "p3"}),
        json.dumps({"prompt": " ", "answer": "1"}),
        json.dumps({"prompt": "p4", "answer": True}),
        json.dumps({"prompt": 5, "answer": "1"}),
        json.dumps({"prompt": "p5", "answer": None}),
        json.dumps({"prompt": "p6", "answer": 0.5}),
    ]
    path = tmp_path / "d.jsonl"
    path.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe broken utf-8\n")
    got = load_prompts(str(path))
    assert [(r.prompt, r.answer) for r in got.rows] == [
        ("what is 1 + 1 ?", "2"),
        ("p2", "18"),
        ("p6", "0.5"),
    ]
    assert got.skipped == 8
    assert got.source == str(path)


def test_a_byte_order_mark_opening_a_jsonl_is_not_a_broken_row(tmp_path):
    """Editors on Windows write a UTF-8 BOM first: the first row reads as the others do; a BOM
    anywhere else is not one and that row is broken."""
    rows = [json.dumps({"prompt": f"p{i}", "answer": str(i)}) for i in range(3)]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(rows).encode() + b"\n")
    got = load_prompts(str(path))
    assert [(r.prompt, r.answer) for r in got.rows] == [("p0", "0"), ("p1", "1"), ("p2", "2")]
    assert got.skipped == 0
    path.write_bytes("\n".join(rows).encode() + b"\n\xef\xbb\xbf" + rows[0].encode() + b"\n")
    assert load_prompts(str(path)).skipped == 1


def test_broken_rows_are_reported_and_too_many_are_an_error(tmp_path):
    good = [json.dumps({"prompt": f"p{i}", "answer": i}) for i in range(18)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([*good, "{not json"]) + "\n")
    assert broken_rows(load_prompts(str(path)), "data.train") == (
        f"data.train {path}: skipped 1 broken row of 19"
    )
    assert broken_rows(load_prompts("builtin:arith"), "data.train") is None
    path.write_text("\n".join([*good, "{not json", "[]", "{}"]) + "\n")
    with pytest.raises(UserError) as e:
        broken_rows(load_prompts(str(path)), "data.train")
    assert "3 of 21 rows are broken (more than 10%)" in str(e.value)
    assert "fix the file or drop those rows" in str(e.value) and "\n" not in str(e.value)


def test_parquet_rows_and_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    table = pa.table({"prompt": ["a", None, "", "d"], "answer": [1, 2, 3, None], "x": [0] * 4})
    pq.write_table(table, path)
    got = load_prompts(str(path))
    assert [(r.prompt, r.answer) for r in got.rows] == [("a", "1")]
    assert got.skipped == 3

    pq.write_table(pa.table({"question": ["a"], "answer": ["1"]}), tmp_path / "q.parquet")
    with pytest.raises(UserError, match="no column 'prompt' \\(it has question, answer\\)"):
        load_prompts(str(tmp_path / "q.parquet"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="not a readable Parquet file"):
        load_prompts(str(tmp_path / "bad.parquet"))


def test_unusable_datasets_are_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(UserError, match="unknown format.*\\.jsonl or \\.parquet"):
        load_prompts(str(tmp_path / "d.csv"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\nnope\n')
    with pytest.raises(UserError, match="no usable row \\(2 broken\\)"):
        load_prompts(str(tmp_path / "bad.jsonl"))


def test_sampler_epochs_are_permutations_and_deterministic():
    sampler = PromptSampler(10, 3, seed=5)
    epochs = [[sampler.next_batch() for _ in range(3)] for _ in range(4)]
    for batches in epochs:
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == 9 and set(flat) <= set(range(10))  # 10 % 3 rows left out
    orders = [sum(batches, []) for batches in epochs]
    assert len({tuple(o) for o in orders}) == 4  # a fresh permutation each epoch
    again = PromptSampler(10, 3, seed=5)
    assert [again.next_batch() for _ in range(12)] == sum(epochs, [])
    other = PromptSampler(10, 3, seed=6)
    assert [other.next_batch() for _ in range(3)] != epochs[0]


def test_sampler_resumes_from_json_state():
    sampler = PromptSampler(7, 2, seed=1)
    for _ in range(5):  # into the second epoch
        sampler.next_batch()
    state = json.loads(json.dumps(sampler.state_dict()))
    expected = [sampler.next_batch() for _ in range(6)]
    resumed = PromptSampler(7, 2, seed=1)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(6)] == expected
    with pytest.raises(
        UserError, match="resume with the same data.train, rollout.prompts_per_step and seed"
    ):
        PromptSampler(8, 2, seed=1).load_state_dict(state)


def test_sampler_errors():
    with pytest.raises(UserError) as e:
        PromptSampler(3, 4, seed=0)
    assert str(e.value) == ("the prompt dataset has 3 usable rows, fewer than the 4 prompts a "
                            "step needs; lower rollout.prompts_per_step or give more rows")  # fmt: skip
    with pytest.raises(UserError, match="rollout.prompts_per_step must be at least 1, got 0"):
        PromptSampler(3, 0, seed=0)


def test_encode_prompt(tokenizer):
    words = vocabulary(128)
    ids = encode_prompt(tokenizer, "what is 12 + 3 ?")
    assert ids == [words.index(w) for w in ["what", "is", "1", "2", "+", "3", "?"]]
    ids = encode_prompt(tokenizer, "sort 3 1", template="{prompt} answer :")
    assert ids == [words.index(w) for w in ["sort", "3", "1", "answer", ":"]]
    # braces in the prompt are text, not template fields
    assert encode_prompt(tokenizer, "{x}") == [words.index(w) for w in ["<unk>", "x", "<unk>"]]
    with pytest.raises(UserError, match="no '\\{prompt\\}'"):
        encode_prompt(tokenizer, "a", template="question")
    with pytest.raises(UserError, match="cannot be filled"):
        encode_prompt(tokenizer, "a", template="{prompt} {other}")
    with pytest.raises(UserError, match="encodes to no tokens"):
        encode_prompt(tokenizer, "   ")


def test_prompts_longer_than_max_prompt_tokens_are_cut_with_a_notice(tmp_path, tokenizer, capsys):
    """A prompt past data.max_prompt_tokens keeps its last tokens (the question, not the
    preamble); the start says how many are cut, once, instead of cutting them silently."""
    from megatron_gspo.config import load_config
    from megatron_gspo.train.producer import PromptSet

    tokenizer.save_pretrained(tmp_path / "tok")
    rows = [{"prompt": "1 + 1 =", "answer": 2}, {"prompt": "9 " * 40 + "+ 2 =", "answer": 11},
            {"prompt": "8 " * 20 + "=", "answer": 8}]  # fmt: skip
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, ["model.path=m", f"data.train={data}", f"data.eval={data}",
                             "data.max_prompt_tokens=16"])  # fmt: skip
    prompts = PromptSet(cfg, tmp_path / "tok")
    whole = [encode_prompt(tokenizer, r["prompt"]) for r in rows]
    assert [len(w) > 16 for w in whole] == [False, True, True]
    assert capsys.readouterr().out == (
        f"data.train: 2 of 3 prompts are longer than data.max_prompt_tokens (16 tokens; the "
        f"longest {len(whole[1])}); each is cut to its last 16 tokens: raise "
        "data.max_prompt_tokens or shorten them\n"
    )
    assert prompts.encode(rows[1]["prompt"]) == whole[1][-16:]
    assert prompts.encode(rows[0]["prompt"]) == whole[0]
