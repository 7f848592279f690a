"""A start refused on two ranks: every rank says the one line and exits 2, no traceback. A
dataset refused by rank 0 alone (it alone read it) used to end rank 0 alone: rank 1, waiting for
it in a broadcast, died of gloo's "Connection closed by peer" traceback (exit 1), which torchrun
named as the root cause, and rank 0 was killed by torchrun's SIGTERM on its way out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_gspo.data.prompts import ROW_RULE
from tests.distributed.train_ranks import train_two_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    return make_tiny_model(TinySpec(dense_layers=[0]), tmp_path_factory.mktemp("tiny") / "moe")


def broken_dataset(path: Path) -> Path:
    """18 good rows and 3 broken ones: more than 10% broken, refused once its rows are read."""
    rows = [json.dumps({"prompt": f"{i} + 1 =", "answer": i + 1}) for i in range(18)]
    path.write_text("\n".join([*rows, "{not json", '{"prompt": ""}', "[1]"]) + "\n")
    return path


@pytest.mark.parametrize("dataset", ["missing", "broken rows"])
def test_a_refused_dataset_is_one_line_on_every_rank(model, tmp_path, dataset):
    if dataset == "missing":  # every rank sees it before the ranks first meet
        data = tmp_path / "nowhere" / "train.jsonl"
        want = f"error: prompt dataset {str(data)!r} does not exist; check the path"
    else:  # rank 0 alone reads the rows, after the model is built on every rank
        data = broken_dataset(tmp_path / "rows.jsonl")
        want = (f"error: data.train {str(data)!r}: 3 of 21 rows are broken (more than 10%); "
                f"{ROW_RULE}: fix the file or drop those rows")  # fmt: skip
    run = tmp_path / "run"
    ranks = train_two_ranks(tmp_path, "--run-dir", str(run), f"model.path={model}",
                            f"data.train={data}")  # fmt: skip
    for rank in (0, 1):
        said = ranks.stderr[rank]
        assert ranks.error_lines(rank) == [want] and "Traceback" not in said, (rank, said[-3000:])
    assert ranks.exitcodes == {0: 2, 1: 2}, ranks.torchrun[-3000:]
    assert not run.exists()  # a refused start leaves no run directory
