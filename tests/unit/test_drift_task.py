"""The drift regime's task model: `make-task-model --preset drift` and the model-shape flags give
the settings they name, flags override the preset, bad values are one-line errors, and a drift
model (with tiny step counts) builds on sortlong."""

import json

import pytest

from megatron_gspo import cli
from megatron_gspo.data import warmstart
from megatron_gspo.data.warmstart import (
    INFO_FILE,
    PRESETS,
    TASK_DEFAULTS,
    WarmStartSpec,
    lr_scale,
    make_task_model,
    task_model_spec,
)
from megatron_gspo.errors import UserError

pytestmark = pytest.mark.unit

DRIFT_SHAPE = dict(layers=6, hidden=64, experts=32, topk=4, moe_ffn=32)


def _cli_spec(monkeypatch, *flags: str) -> tuple[str, WarmStartSpec]:
    """The (task, spec) `megatron-gspo make-task-model --out m FLAGS` builds, without building."""
    asked = {}
    monkeypatch.setattr(warmstart, "make_task_model", lambda out, **kw: asked.update(kw))
    args = cli.parse_args(["make-task-model", "--out", "m", *flags])
    args.func(args)
    seed = asked.pop("seed")
    assert seed == (int(flags[flags.index("--seed") + 1]) if "--seed" in flags else 0)
    return task_model_spec(**asked)


def test_drift_preset_is_sortlong_on_many_small_experts():
    task, spec = task_model_spec(preset="drift")
    assert task == "sortlong" and PRESETS["drift"]["task"] == "sortlong"
    assert spec == WarmStartSpec(**{**TASK_DEFAULTS["sortlong"], **DRIFT_SHAPE})
    tiny = spec.tiny_spec(seed=0)
    assert (tiny.layers, tiny.experts, tiny.topk, tiny.dense_layers) == (6, 32, 4, [])


def test_drift_long_preset_is_the_drift_shape_on_twenty_digit_sorts():
    task, spec = task_model_spec(preset="drift_long")
    assert task == "sortlong20"
    assert spec == WarmStartSpec(**{**TASK_DEFAULTS["sortlong20"], **DRIFT_SHAPE})


def test_cli_flags_give_the_preset_and_override_it(monkeypatch):
    assert _cli_spec(monkeypatch, "--preset", "drift") == task_model_spec(preset="drift")
    task, spec = _cli_spec(monkeypatch, "--preset", "drift", "--layers", "3", "--moe-ffn", "16")
    assert task == "sortlong"
    assert (spec.layers, spec.moe_ffn, spec.experts, spec.topk) == (3, 16, 32, 4)
    # another task on the drift shape: that task's training, the preset's shape
    task, spec = _cli_spec(monkeypatch, "--preset", "drift", "--task", "arith", "--seed", "2")
    assert (task, spec) == ("arith", WarmStartSpec(**DRIFT_SHAPE))
    # no preset: the task's own defaults, the flags on top; the plain command is arith as before
    task, spec = _cli_spec(monkeypatch, "--task", "sortlong", "--experts", "16", "--hidden", "32")
    assert task == "sortlong"
    assert spec == WarmStartSpec(**{**TASK_DEFAULTS["sortlong"], "experts": 16, "hidden": 32})
    assert _cli_spec(monkeypatch) == ("arith", WarmStartSpec())


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--preset", "nope"], "unknown preset 'nope'; choose one of: drift, drift_long"),
        (["--preset", "drift", "--task", "nope"], "unknown task 'nope'; choose one of: arith, sort, sortlong, sortlong20, calc_tool"),
        (["--preset", "drift", "--topk", "33"], "--topk 33: the experts per token must be in [1, 32] (--experts 32); lower --topk or raise --experts"),
        (["--topk", "9"], "--topk 9: the experts per token must be in [1, 8] (--experts 8); lower --topk or raise --experts"),
        (["--experts", "0"], "--experts 0: the task model needs >= 2 experts"),
        (["--layers", "1"], "--layers 1: the task model needs >= 2 layers"),
        (["--preset", "drift", "--hidden", "36"], "--hidden 36: the task model needs a multiple of 8 (4 heads of an even size)"),
        (["--moe-ffn", "0"], "--moe-ffn 0: the task model needs >= 1"),
    ],
)  # fmt: skip
def test_bad_values_are_user_errors(flags, message, tmp_path):
    """Each names its flag and value (was "the task model needs >= 2 layers and 1 <= topk <=
    experts >= 2" for all of the first four)."""
    args = cli.parse_args(["make-task-model", "--out", str(tmp_path / "m"), *flags])
    with pytest.raises(UserError) as e:
        args.func(args)
    assert str(e.value) == message  # printed as one line by cli.main
    assert not list(tmp_path.iterdir())


def test_cli_reports_a_bad_preset_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["make-task-model", "--out", str(tmp_path / "m"), "--preset", "nope"])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err
        == "error: unknown preset 'nope'; choose one of: drift, drift_long\n"
    )
    assert not list(tmp_path.iterdir())


def test_learning_rate_warms_up_then_cools_down():
    old = WarmStartSpec(warmup_steps=4)  # no cooldown: the schedule arith and sort were built with
    assert [lr_scale(old, s, 10) for s in range(10)] == [min(1.0, (s + 1) / 4) for s in range(10)]
    spec = WarmStartSpec(warmup_steps=2, cooldown_steps=4)
    assert [lr_scale(spec, s, 8) for s in range(8)] == [0.5, 1, 1, 1, 1, 0.75, 0.5, 0.25]


def test_a_drift_model_builds_with_tiny_steps(tmp_path):
    import transformers

    knobs = dict(hidden=16, experts=8, layers=2, batch_size=4, clean_steps=2, sloppy_steps=2)
    path = make_task_model(tmp_path / "m", preset="drift", cooldown_steps=1, **knobs)
    info = json.loads((path / INFO_FILE).read_text())
    assert (info["task"], info["preset"], info["cooldown_steps"]) == ("sortlong", "drift", 1)
    config = transformers.AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.num_experts, config.num_experts_per_tok) == (2, 8, 4)
    assert (config.hidden_size, config.moe_intermediate_size) == (16, 32)  # flag, preset
