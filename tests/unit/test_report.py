"""The report figure: panels, labels and values per run, "n/a" panels, the PNG, the command."""

from __future__ import annotations

import argparse
import math
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from megatron_gspo.errors import UserError
from megatron_gspo.train.metrics import MetricsLogger
from megatron_gspo.train.report import (
    PANELS,
    aggregate_seeds,
    build_figure,
    default_labels,
    load_runs,
    make_report,
    register,
)
from tests.helpers import cli_env, stopped_mid_write

pytestmark = pytest.mark.unit
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def gspo_row(step: int) -> dict:
    row = {"reward/mean": 0.1 * step, "ratio/clip_fraction_tokens": 0.01 * step}
    row["ratio/clip_fraction_seqs"] = 0.02 * step
    row.update({f"routing/changed_fraction/layer_{i}": 0.1 * i + 0.01 * step for i in (0, 1, 10)})
    return row


def grpo_row(step: int) -> dict:
    row = {"reward/mean": 0.05 * step, "kl/old": 1e-3 * step, "time/step_s": 2.0}
    if step % 2 == 0:
        row["eval/reward"] = 0.3 + 0.01 * step
    return row


def write_run(run_dir: Path, make_row, steps: int = 6) -> Path:
    with MetricsLogger(run_dir, total_steps=steps, tensorboard=False, console=False) as logger:
        for step in range(1, steps + 1):
            logger.log(step, make_row(step))
    return run_dir


@pytest.fixture
def two_runs(tmp_path) -> list[Path]:
    return [write_run(tmp_path / "gspo", gspo_row), write_run(tmp_path / "grpo", grpo_row)]


def axes_by_title(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible() and ax.get_title()}


def legend_texts(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def is_na(ax) -> bool:
    return not ax.get_lines() and [t.get_text() for t in ax.texts] == ["n/a"]


def test_panels_labels_and_values(two_runs):
    fig = build_figure(load_runs(two_runs))
    axes = axes_by_title(fig)
    assert len(axes) == len(PANELS) + 1  # + the per-layer panel
    assert legend_texts(axes["reward/mean"]) == ["gspo", "grpo"]
    # The plotted values are the logged ones.
    gspo_line, grpo_line = axes["reward/mean"].get_lines()
    np.testing.assert_array_equal(gspo_line.get_xdata(), [1, 2, 3, 4, 5, 6])
    np.testing.assert_allclose(grpo_line.get_ydata(), [0.05 * s for s in range(1, 7)])
    # eval/reward only where logged (even steps) and only for the run that has it.
    assert legend_texts(axes["eval/reward"]) == ["grpo"]
    np.testing.assert_array_equal(axes["eval/reward"].get_lines()[0].get_xdata(), [2, 4, 6])
    clip = axes["ratio/clip_fraction (tokens, seqs)"]
    assert legend_texts(clip) == ["gspo (tokens)", "gspo (seqs)"]
    assert legend_texts(axes["kl/old"]) == ["grpo"]
    for title in ("entropy", "ratio/std", "routing/changed_fraction", "response/length_mean"):
        assert is_na(axes[title]), title
    assert not is_na(axes["time/step_s"])


def test_layer_panel_orders_layers_numerically(two_runs):
    axes = axes_by_title(build_figure(load_runs(two_runs)))
    ax = axes["routing/changed_fraction per layer (gspo)"]
    assert legend_texts(ax) == ["layer 0", "layer 1", "layer 10"]
    np.testing.assert_allclose(ax.get_lines()[2].get_ydata(), [1.0 + 0.01 * s for s in range(1, 7)])


def test_many_layers_get_a_colour_bar(tmp_path):
    rows = lambda s: {f"routing/changed_fraction/layer_{i}": 0.01 * i for i in range(24)}  # noqa: E731
    fig = build_figure(load_runs([write_run(tmp_path / "big", rows, steps=2)]))
    ax = axes_by_title(fig)["routing/changed_fraction per layer (big)"]
    assert len(ax.get_lines()) == 24 and ax.get_legend() is None
    assert any(a.get_label() == "<colorbar>" for a in fig.axes)


def test_report_command_writes_a_png(two_runs, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "figs" / "report.png"
    out.parent.mkdir()
    argv = ["report", *map(str, two_runs), "--out", str(out), "--labels", "GSPO, GRPO"]
    args = parser.parse_args(argv)
    args.func(args)
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert out.read_bytes()[:8] == PNG_MAGIC
    with Image.open(out) as img:
        img.verify()
    with Image.open(out) as img:
        # 11 panels on a 4-wide grid: 3 rows of 4.2 x 3.2 inches at 100 dpi.
        assert img.size == (round(4 * 4.2 * 100), round(3 * 3.2 * 100))
    assert [p.name for p in out.parent.iterdir()] == ["report.png"]  # no temp file left


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_report_stopped_by_a_signal_mid_write_leaves_nothing_behind(two_runs, tmp_path, sig):
    """SIGTERM used to end `report` with its .report.png.tmp-PID left beside --out. Now it is
    removed; the files the user had there are as they were."""
    figs = tmp_path / "figs"
    figs.mkdir()
    (figs / "old.png").write_bytes(b"the user's figure")
    out = figs / "report.png"
    rc, err = stopped_mid_write(["report", *map(str, two_runs), "--out", str(out)], out, sig)
    assert [p.name for p in figs.iterdir()] == ["old.png"]
    assert (figs / "old.png").read_bytes() == b"the user's figure"
    # SIGTERM: SystemExit(143); SIGINT: the CLI's one line "interrupted" and exit 130
    assert rc == 128 + sig, err[-2000:]


def test_errors(two_runs, tmp_path):
    missing = tmp_path / "not_a_run"
    with pytest.raises(UserError, match=str(missing)):
        make_report([two_runs[0], missing], tmp_path / "r.png")
    with pytest.raises(UserError, match="1 labels for 2 run directories"):
        make_report(two_runs, tmp_path / "r.png", labels=["only"])
    with pytest.raises(UserError, match="ending in .png"):
        make_report(two_runs, tmp_path / "r.pdf")
    assert not (tmp_path / "r.png").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xff\xfe\n", "{m}:1 is not a metrics line; delete it or restore the file"),
        (b'{"step": 1}\n\xff\xfe\n{"step": 3}\n', "{m}:2 is not a metrics line; delete it or "
                                                  "restore the file"),
        (b"", "{m} has no metrics yet (no complete line); pass a run that has logged a step"),
        (b'{"step": 1, "rew', "{m} has no metrics yet (no complete line); pass a run that has "
                              "logged a step"),
    ],
    ids=["not-utf8", "not-utf8-inside", "empty", "torn"],
)  # fmt: skip
def test_a_metrics_file_that_cannot_be_plotted_is_one_line_error(tmp_path, content, message):
    """Bytes that are not UTF-8 are a line that is not metrics (not a decoding traceback); a
    file with no complete line is no report (not a blank PNG); no PNG is written."""
    (tmp_path / "run").mkdir()
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "megatron_gspo", "report", str(tmp_path / "run"),
                           "--out", str(tmp_path / "u.png")], capture_output=True, text=True,
                          timeout=120, env=cli_env())  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"error: {message.format(m=metrics)}"]
    assert not (tmp_path / "u.png").exists()


def test_an_existing_out_or_a_missing_directory_is_refused(two_runs, tmp_path):
    """docs/commands.md: an existing output path is an error; nor is a directory made for it."""
    old = tmp_path / "old.png"
    old.write_bytes(b"the user's figure")
    with pytest.raises(UserError) as e:
        make_report(two_runs, old)
    assert str(e.value) == f"--out {old} exists; pass a new path, or delete it to write it again"
    assert old.read_bytes() == b"the user's figure"
    deep = tmp_path / "typo" / "figs" / "r.png"
    with pytest.raises(UserError) as e:
        make_report(two_runs, deep)
    assert str(e.value) == (f"--out {deep}: directory {deep.parent} does not exist; create it, "
                            "or give a path in an existing directory")  # fmt: skip
    assert not (tmp_path / "typo").exists()


def test_default_labels_disambiguate(tmp_path):
    assert default_labels([tmp_path / "gspo", tmp_path / "grpo"]) == ["gspo", "grpo"]
    assert default_labels([tmp_path / "a" / "seed0", tmp_path / "b" / "seed0"]) == [
        "a/seed0",
        "b/seed0",
    ]


def test_seed_bands(tmp_path):
    seeds = [
        [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.4}],
        [{"step": 1, "reward/mean": 0.3}, {"step": 2, "reward/mean": math.nan}],
        [{"step": 1, "reward/mean": 0.2, "entropy": 1.0}],
    ]
    rows = aggregate_seeds(seeds)
    assert rows[0]["step"] == 1 and rows[1]["step"] == 2
    assert rows[0]["reward/mean"] == pytest.approx(0.2)
    assert (rows[0]["reward/mean:min"], rows[0]["reward/mean:max"]) == (0.1, 0.3)
    assert rows[0]["entropy"] == 1.0 and "entropy" not in rows[1]
    assert rows[1]["reward/mean"] == rows[1]["reward/mean:min"] == 0.4  # NaN seed left out
    ax = axes_by_title(build_figure([("gspo", rows)]))["reward/mean"]
    (band,) = ax.collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert ys.min() == pytest.approx(0.1) and ys.max() == pytest.approx(0.4)
