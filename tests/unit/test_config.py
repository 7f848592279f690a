"""The typed run config: YAML + dotted overrides, every key and value checked at load."""

import subprocess
import sys

import pytest
import yaml

from megatron_gspo.algo.config import AlgoConfig, LossKind
from megatron_gspo.config import Config, load_config
from megatron_gspo.errors import UserError
from megatron_gspo.model.optim import OptimConfig
from megatron_gspo.model.parallel import ParallelConfig
from megatron_gspo.routing.modes import ReplayMode
from megatron_gspo.weight_sync.config import SyncConfig
from tests.helpers import cli_env

pytestmark = pytest.mark.unit


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_build_typed_sections(tmp_path):
    path = _write(tmp_path, "model: {path: m}\nalgo: {loss: grpo, clip_low: 3e-4}\n")
    cfg = load_config(path, ["algo.routing_replay=r2", "train.steps=3", "rollout.urls=[http://a]"])
    assert isinstance(cfg, Config)
    assert cfg.algo.loss == "grpo" and cfg.algo.routing_replay == "r2"
    assert cfg.algo.clip_low == pytest.approx(3e-4)  # YAML reads 3e-4 as a string
    assert cfg.train.steps == 3 and cfg.rollout.urls == ["http://a"]
    # the sections are their components' own configs (one set of defaults), modes their enums
    assert isinstance(cfg.optim, OptimConfig) and cfg.optim.lr == OptimConfig().lr
    assert cfg.algo.loss is LossKind.GRPO and cfg.algo.routing_replay is ReplayMode.R2
    assert cfg.algo == AlgoConfig(loss=LossKind.GRPO, clip_low=3e-4, routing_replay=ReplayMode.R2)
    assert cfg.algo.clip == (3e-4, 0.28)  # the clip_high left out: GRPO's published one
    assert cfg.sync == SyncConfig() and cfg.sync.with_run_dir(tmp_path) == SyncConfig()
    disk = load_config(path, ["sync.method=disk"]).sync.with_run_dir(tmp_path)
    assert disk.dir == str(tmp_path / "weights")  # a disk run's versions: in its run directory
    assert isinstance(cfg.parallel, ParallelConfig) and cfg.parallel.dims(4).dp == 4
    assert yaml.safe_load(yaml.safe_dump(cfg.to_dict()))["algo"]["loss"] == "grpo"


@pytest.mark.parametrize(
    "text, override, message",
    [
        ("model: {path: m}\nalgo: {los: grpo}\n", [], "did you mean 'algo.loss'"),
        ("model: {path: m}\nalgoo: {loss: grpo}\n", [], "did you mean 'algo'"),
        ("model: {path: m}\n", ["train.stepz=3"], "did you mean 'train.steps'"),
        ("model: {path: m}\n", ["algo.loss=ppo"], "algo.loss must be one of"),
        ("model: {path: m}\n", ["train.steps=many"], "train.steps must be an integer"),
        ("model: {path: m}\n", ["algo.routing_replay=r4"], "none, r2, r3"),
        ("model: {path: m}\n", ["algo.minibatches=5"], "must divide the rollout batch"),
        ("model: {path: m}\n", ["rollout.group_size=1"], "group_size must be >= 2"),
        ("model: {path: m}\n", ["logging.tensorboard=maybe"], "true or false"),
        ("algo: {loss: gspo}\n", [], "model.path is required"),
        ("model: [1, 2]\n", [], "model must be a mapping"),
        ("model: {path: m}\n", ["novalue"], "must look like key.sub=value"),
        ("model: {path: m}\n", ["data.train=rows.jsonl"], "data.eval is required"),
        ("model: {path: m\n", [], "not valid YAML"),
        ("model: {path: m}\n", ["rollout.router_url=http://r:1"], "router_url needs rollout.urls"),
        ("model: {path: m}\n", ["algo.tis=seq"], "algo.tis must be one of"),
        ("model: {path: m}\n", ["algo.tis_cap=0.5"], "tis_cap must be a finite number >= 1"),
        ("model: {path: m}\n", ["optim.decay=step"], "optim.decay must be one of"),
        ("model: {path: m}\n", ["lora.targets=[router]"], "unknown target 'router'; choose"),
        ("model: {path: m}\n", ["lora.rank=8", "lora.targets=[]"], "lora.targets is empty"),
        ("model: {path: m}\n", ["lora.experts=per_layer"], "lora.experts must be one of"),
        (
            "model: {path: m}\n",
            ["lora.rank=4", "lora.experts=shared", "parallel.tp=2", "parallel.etp=1"],
            "lora.experts: shared needs",
        ),
        (
            "model: {path: m, moe_grouped_gemm: true}\n",
            ["lora.rank=4"],
            r"set lora.experts: shared \(it runs on grouped experts\), or set model.moe_grouped",
        ),
        ("model: {path: m}\n", ["lora.dropout=1"], "lora.dropout must be a finite number in"),
        ("model: {path: m}\n", ["optim.min_lr=1"], "min_lr must be a finite number in"),
        ("model: {path: m}\n", ["rollout.urls=[http://a]", "rollout.router_url=r:1"], "http"),
        (
            "model: {path: m}\n",
            ["rollout.max_staleness=9"],
            "max_staleness must be an integer in \\[0, 8\\]",
        ),
        (
            "model: {path: m}\n",
            ["rollout.partial=true"],
            "only overlap one with rollout.max_staleness >= 1",
        ),
        (
            "model: {path: m}\n",
            ["rollout.max_staleness=1", "rollout.release_memory=true"],
            "rules out; set one of them to 0",
        ),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path, text, override, message):
    with pytest.raises(UserError, match=message) as e:
        load_config(_write(tmp_path, text), override)
    assert "\n" not in str(e.value)


def test_lora_is_off_by_default_and_reads_its_keys(tmp_path):
    assert not load_config(_write(tmp_path, "model: {path: m}\n")).lora.enabled
    over = ["lora.rank=16", "lora.alpha=32", "lora.targets=[linear_qkv, expert_fc2]"]
    lora = load_config(_write(tmp_path, "model: {path: m}\n"), over).lora
    assert lora.enabled and lora.scale == 2.0 and lora.targets == ["linear_qkv", "expert_fc2"]


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "text, message",
    [
        ("model: {path: m}\ntrain:\n  steps: [1, 2\n  lr: 3\n",
         "line 4, column 5: not valid YAML: expected ',' or ']', but got ':' (while parsing a "
         "flow sequence that starts at line 3, column 10); close the list with ] (quote an item "
         "that holds , [ ] or :)"),
        ("model:\n\tpath: m\n", "line 2, column 1: not valid YAML: found character '\\t' that "
                                "cannot start any token; indent with spaces, not tabs"),
        ("model:\n  path: m\n   dtype: bfloat16\n",
         "line 3, column 9: not valid YAML: mapping values are not allowed here; indent the keys "
         "of a section alike; quote a value with ': '"),
        ("model: {path: m}\ndata:\n  template: \"Q: {prompt}\n",
         "line 4, column 1: not valid YAML: found unexpected end of stream (while scanning a "
         "quoted scalar that starts at line 3, column 13); close the quoted string"),
        ("model: {path: @m}\n", "line 1, column 15: not valid YAML: found character '@' that "
                                "cannot start any token; quote the value (a plain one cannot "
                                "start with @ or `)"),
    ],
    ids=["list", "tab", "indent", "quote", "at"],
)  # fmt: skip
def test_a_config_that_is_not_yaml_names_the_file_line_column_and_fix(tmp_path, text, message):
    """It used to be yaml's first line only: "c.yaml is not valid YAML: while parsing a flow
    sequence", naming neither the line nor the problem."""
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, text))
    assert str(e.value) == f"{tmp_path / 'c.yaml'}, {message}"


def test_train_with_a_config_that_is_not_yaml_says_where_in_one_line(tmp_path):
    """The same line from the command, exit 2, nothing made (no runs/ directory)."""
    bad = _write(tmp_path, "model: {path: m}\ntrain:\n  steps: [1, 2\n  lr: 3\n")
    proc = subprocess.run([sys.executable, "-m", "megatron_gspo", "train", "--config", str(bad)],
                          capture_output=True, text=True, timeout=120, env=cli_env(),
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"error: {bad}, line 4, column 5: not valid YAML: expected ',' or ']', but got ':' (while "
        "parsing a flow sequence that starts at line 3, column 10); close the list with ] (quote "
        "an item that holds , [ ] or :)"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["c.yaml"]


def test_shipped_tiny_configs_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    names = sorted(p.name for p in root.glob("*.yaml"))
    assert {"tiny_moe_gspo.yaml", "tiny_moe_grpo.yaml", "tiny_moe_grpo_r2.yaml",
            "tiny_moe_grpo_r3.yaml"} <= set(names)  # fmt: skip
    for name in names:
        load_config(root / name)
    assert load_config(root / "tiny_moe_grpo_r3.yaml").algo.routing_replay == "r3"
    assert load_config(root / "tiny_moe_gspo.yaml").algo.minibatches == 4


def test_lr_schedule_per_rl_step(tmp_path):
    import math

    def lr(*overrides):
        cfg = load_config(_write(tmp_path, "model: {path: m}\n"), ["optim.lr=1e-3", *overrides])
        return [cfg.optim.lr_at(step, 10) for step in range(1, 11)]

    assert lr() == [1e-3] * 10  # the default: constant
    warm = lr("optim.warmup_steps=4")
    assert warm == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3] + [1e-3] * 6)
    linear = lr("optim.warmup_steps=2", "optim.decay=linear", "optim.min_lr=1e-4")
    expect = [5e-4, 1e-3] + [1e-4 + 9e-4 * (1 - k / 8) for k in range(1, 9)]
    assert linear == pytest.approx(expect)
    cosine = lr("optim.decay=cosine")
    assert cosine == pytest.approx([5e-4 * (1 + math.cos(math.pi * k / 10)) for k in range(1, 11)])
    assert cosine[-1] == pytest.approx(0.0, abs=1e-12)


def _numeric_keys(cls=Config, where=""):
    """Every numeric leaf of the config: (dotted key, int or float, inside a list)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, hint = f"{where}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _numeric_keys(hint, key + ".")
            continue
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        in_list = typing.get_origin(hint) is list
        leaf = args[0] if args else hint
        if leaf in (int, float):
            yield key, leaf, in_list


NUMERIC = list(_numeric_keys())


def test_every_numeric_field_is_enumerated():
    keys = {k for k, _, _ in NUMERIC}
    assert {"seed", "optim.lr", "optim.adam_eps", "optim.clip_grad", "rollout.temperature",
            "rollout.url_nodes", "sync.bucket_mb", "parallel.vpp"} <= keys  # fmt: skip
    assert len(keys) > 30


@pytest.mark.parametrize("key, kind, in_list", NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_non_finite_and_negative_numbers_are_refused(tmp_path, key, kind, in_list):
    """NaN, inf and -1 are invalid for every numeric field: each is one line naming the key."""
    path = _write(tmp_path, "model: {path: m}\n")
    bad = [".nan", ".inf", "-.inf", "-1"] if kind is float else ["-1", ".nan"]
    for value in bad:
        extra = ["rollout.urls=[http://a]"] if key == "rollout.url_nodes" else []
        override = f"{key}=[{value}]" if in_list else f"{key}={value}"
        with pytest.raises(UserError) as e:
            load_config(path, [*extra, override])
        message = str(e.value)
        assert key in message and "\n" not in message, (override, message)
        assert "finite" in message or "integer" in message, (override, message)


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=.inf", "optim.lr must be a finite number > 0, not inf"),
        ("rollout.temperature=.nan", "rollout.temperature must be a finite number >= 0, not nan"),
        ("seed=-1", "seed must be an integer in [0, 9223372036854775807], not -1"),
        ("optim.adam_eps=-1", "optim.adam_eps must be a finite number > 0, not -1.0"),
        ("optim.clip_grad=-1", "optim.clip_grad must be a finite number >= 0, not -1.0"),
        ("optim.min_lr=1", "optim.min_lr must be a finite number in [0, optim.lr], not 1.0"),
    ],
)
def test_issue_25_values_get_one_line_naming_the_range(tmp_path, override, message):
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, "model: {path: m}\n"), [override])
    assert str(e.value) == message


HUGE = "9" * 400  # beyond any float and any 64-bit integer


@pytest.mark.parametrize("key, kind, in_list", NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_numbers_too_large_to_use_are_one_line_naming_the_key(tmp_path, key, kind, in_list):
    """A 400-digit integer used to be an OverflowError traceback (float keys) or to pass the
    check and overflow where it was used (int keys); 5000 digits, a ValueError traceback."""
    path = _write(tmp_path, "model: {path: m}\n")
    for value in (HUGE, "-" + HUGE, "9" * 5000):
        extra = ["rollout.urls=[http://a]"] if key == "rollout.url_nodes" else []
        override = f"{key}=[{value}]" if in_list else f"{key}={value}"
        with pytest.raises(UserError) as e:
            load_config(path, [*extra, override])
        message = str(e.value)
        assert key in message and "\n" not in message and len(message) < 300, message


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=" + HUGE, "optim.lr must be a finite number, not a 400-digit integer"),
        ("train.steps=" + HUGE, "train.steps must be a 64-bit integer"),
        ("rollout.health_timeout_s=1.0e+300", "rollout.health_timeout_s must be a finite number"),
        ("env.timeout_s=1.0e+300", "env.timeout_s must be a finite number in [0.01, 1e+09]"),
        ("sync.bucket_mb=1.0e+300", "sync.bucket_mb must be a finite number in (0, 1.04858e+06]"),
    ],
)
def test_values_that_overflow_where_used_are_refused(tmp_path, override, message):
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, "model: {path: m}\n"), [override])
    assert str(e.value).startswith(message), str(e.value)


F32 = "must be a number a 32-bit float holds (0, or a magnitude in [1.2e-38, 3.4e38]), not "


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo.loss=grpo", "algo.clip_high=1e39"],
        ["algo.loss=sapo", "algo.sapo_tau_neg=1e308"],
        ["algo.loss=sapo", "algo.sapo_tau_pos=1e-320"],
        ["algo.mismatch=tis", "algo.tis_cap=1e308"],
        ["algo.kl_coef=1e308"],
        ["optim.lr=1e-40"],
    ],
)
def test_floats_beyond_fp32_are_refused(tmp_path, overrides):
    """The step computes in fp32: these were inf or 0 there (a traceback converting a clip
    bound, or a NaN loss and every update skipped)."""
    key, value = overrides[-1].split("=")
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, "model: {path: m}\n"), overrides)
    assert str(e.value) == f"{key} {F32}{float(value)!r}"
    load_config(_write(tmp_path, "model: {path: m}\n"), [*overrides[:-1], f"{key}=2.0"])


def test_an_override_that_is_not_yaml_is_text_for_a_string_key_else_an_error(tmp_path):
    """`data.template={prompt}{x}` used to be a 33-line yaml ParserError traceback."""
    path = _write(tmp_path, "model: {path: m}\n")
    for text in ("Q: {prompt} A:", "{prompt} [{{x}}", "{prompt}"):  # YAML: a mapping, an error
        assert load_config(path, [f"data.template={text}"]).data.template == text
    assert load_config(path, ["data.template='{prompt}: '"]).data.template == "{prompt}: "
    with pytest.raises(UserError) as e:  # taken as text, then checked as a template
        load_config(path, ["data.template={prompt}{x}"])
    assert str(e.value).startswith("data.template '{prompt}{x}' cannot be filled (KeyError")
    for override, message in [  # (what the parser found, not "while parsing a flow mapping")
        (
            "train.steps=[1, {",
            "override train.steps: '[1, {' is not valid YAML (expected the "
            "node content, but found '<stream end>' at character 6); write the "
            "value as YAML",
        ),
        ("rollout.urls=[a, {", "override rollout.urls: '[a, {' is not valid YAML"),
        ("algo.loss={gspo", "override algo.loss: '{gspo' is not valid YAML"),
        ("nokey.x={a", "unknown config key 'nokey'"),
    ]:
        with pytest.raises(UserError) as e:
            load_config(path, [override])
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    big = _write(tmp_path, f"model: {{path: m}}\ntrain: {{steps: {'9' * 5000}}}\n")
    with pytest.raises(UserError, match="is not valid YAML: Exceeds the limit"):
        load_config(big)


@pytest.mark.parametrize(
    "url", ["notaurl", "http://127.0.0.1:99999", "http://[::1", "ftp://a:1", "http://:80", "a:1"]
)
def test_a_malformed_rollout_url_is_refused_at_load(tmp_path, url):
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, "model: {path: m}\n"), [f'rollout.urls=["{url}"]'])
    assert str(e.value).startswith("rollout.urls[0] must be an http(s) URL with a host")
    load_config(_write(tmp_path, "model: {path: m}\n"), ['rollout.urls=["http://[::1]:30000"]'])


ROLLOUT_WHY = ("tokens a rollout may hold in the model's context of 2048 tokens "
               "(max_position_embeddings in m/config.json): SGLang 0.5.23 ends a generation at "
               "context - 2 tokens with its prompt, whatever max_new_tokens asks; ")  # fmt: skip


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.max_new_tokens=100000000"], "data.max_prompt_tokens (256) + "
         "rollout.max_new_tokens (100000000) = 100000256 tokens exceed the 2046 " + ROLLOUT_WHY
         + "lower rollout.max_new_tokens to at most 1790"),
        (["data.max_prompt_tokens=2000", "rollout.max_new_tokens=49"], "= 2049 tokens exceed "
         "the 2046 " + ROLLOUT_WHY + "lower rollout.max_new_tokens to at most 46 or "
         "data.max_prompt_tokens to at most 1997"),
        # a prompt budget past what SGLang takes as a prompt: only it can be lowered
        (["data.max_prompt_tokens=5000"], "data.max_prompt_tokens (5000) + "
         "rollout.max_new_tokens (16) = 5016 tokens exceed the 2046 " + ROLLOUT_WHY + "lower "
         "data.max_prompt_tokens to at most 2030"),
        (["data.max_prompt_tokens=2048"], "; lower data.max_prompt_tokens to at most 2030"),
        (["data.max_prompt_tokens=3000", "rollout.max_new_tokens=3000"], "; lower "
         "data.max_prompt_tokens and rollout.max_new_tokens to 2046 tokens together"),
        (["env.fn=x:y", "env.max_tokens=1800"], "env.max_tokens (1800) = 2056 tokens exceed the "
         "2042 tokens an episode may hold in the model's context of 2048 tokens "
         "(max_position_embeddings in m/config.json): the last turn may have all but one of them "
         "in its prompt, and SGLang 0.5.23 takes a prompt of at most context - 7 tokens; lower "
         "env.max_tokens to at most 1786 or data.max_prompt_tokens to at most 242"),
        # the sum fits, but SGLang refuses a prompt this long
        (["data.max_prompt_tokens=2043", "rollout.max_new_tokens=1"], "data.max_prompt_tokens "
         "(2043) exceeds the 2041 tokens a prompt may hold in the model's context of 2048 tokens "
         "(max_position_embeddings in m/config.json): SGLang 0.5.23 refuses a prompt of "
         "context - 6 tokens or more; lower data.max_prompt_tokens to at most 2041"),
    ],
)  # fmt: skip
def test_prompt_and_generation_must_fit_the_models_context(tmp_path, overrides, message):
    cfg = load_config(_write(tmp_path, "model: {path: m}\n"), overrides)
    with pytest.raises(UserError) as e:
        cfg.check_context(2048, "m/config.json")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).endswith(message.rpartition("; ")[2]), str(e.value)  # the whole hint
    assert "at most 0" not in str(e.value)
    load_config(_write(tmp_path, "model: {path: m}\n")).check_context(2048, "m/config.json")


# SGLang 0.5.23's scheduler, written out (srt/managers/tp_worker.py:568-572, a KV pool of at least
# the context): a prompt of max_req_input_len tokens or more is refused (srt/managers/utils.py:272),
# max_new_tokens is cut to max_req_len - prompt - 1 (srt/managers/scheduler.py:2710-2716)
CONTEXT = 2048
MAX_REQ_LEN = CONTEXT - 1
MAX_REQ_INPUT_LEN = MAX_REQ_LEN - 5


def sglang_serves(prompt: int, max_new_tokens: int) -> bool:
    """Whether SGLang takes the request and generates all `max_new_tokens` it asks for."""
    return prompt < MAX_REQ_INPUT_LEN and max_new_tokens <= MAX_REQ_LEN - prompt - 1


def _check(tmp_path, overrides):
    cfg = load_config(_write(tmp_path, "model: {path: m}\n"), overrides)
    cfg.check_context(CONTEXT, "m/config.json")


@pytest.mark.parametrize(
    "prompt, new",
    [(256, CONTEXT - 256), (256, CONTEXT - 257), (256, CONTEXT - 258), (2000, 47), (2000, 46),
     (MAX_REQ_INPUT_LEN, 1), (MAX_REQ_INPUT_LEN - 1, 1), (MAX_REQ_INPUT_LEN - 1, 5),
     (MAX_REQ_INPUT_LEN - 1, 6)],
)  # fmt: skip
def test_a_config_passes_exactly_when_sglang_serves_its_longest_rollout(tmp_path, prompt, new):
    """data.max_prompt_tokens + rollout.max_new_tokens equal to the context passed, and SGLang
    then cut every longest answer 2 tokens short without a word (finish_reason length)."""
    overrides = [f"data.max_prompt_tokens={prompt}", f"rollout.max_new_tokens={new}"]
    if sglang_serves(prompt, new):
        _check(tmp_path, overrides)
        return
    with pytest.raises(UserError) as e:
        _check(tmp_path, overrides)
    # the hint names the largest values SGLang serves, each with the other as it is
    most_new = max((n for n in range(1, CONTEXT) if sglang_serves(prompt, n)), default=None)
    most_prompt = max(p for p in range(1, CONTEXT) if sglang_serves(p, new))
    hint = f"data.max_prompt_tokens to at most {most_prompt}"
    if most_new is not None:
        hint = f"rollout.max_new_tokens to at most {most_new} or {hint}"
    assert str(e.value).endswith(f"; lower {hint}") and "\n" not in str(e.value), str(e.value)


def test_an_episodes_last_turn_is_a_prompt_sglang_serves(tmp_path):
    """An episode's last turn can be a prompt of data.max_prompt_tokens + env.max_tokens - 1
    tokens asking for 1 (rollout/episodes.py): SGLang must take it."""
    prompt = 256
    most = max(m for m in range(1, CONTEXT) if sglang_serves(prompt + m - 1, 1))
    for max_tokens in (most, most + 1):
        env = ["env.fn=x:y", f"data.max_prompt_tokens={prompt}", f"env.max_tokens={max_tokens}"]
        if max_tokens == most:
            _check(tmp_path, env)
            continue
        with pytest.raises(UserError, match=f"; lower env.max_tokens to at most {most} or "):
            _check(tmp_path, env)


@pytest.mark.parametrize(
    "overrides, recompute, grouped",
    [
        ([], "none", "auto"),
        (["model.recompute=selective", "model.moe_grouped_gemm=true"], "selective", "true"),
        (["model.recompute=full", "model.moe_grouped_gemm=false"], "full", "false"),
        (["model.recompute=true", "model.moe_grouped_gemm=auto"], "full", "auto"),  # former bool
        (["model.recompute=false"], "none", "auto"),
    ],
)
def test_recompute_and_grouped_experts_modes(overrides, recompute, grouped):
    from megatron_gspo.model.modes import GroupedGemm, Recompute

    cfg = load_config(None, ["model.path=m", *overrides])
    assert cfg.model.recompute is Recompute(recompute)
    assert cfg.model.moe_grouped_gemm is GroupedGemm(grouped)
    assert (
        cfg.model.moe_grouped_gemm.resolve()
        == {"auto": None, "true": True, "false": False}[grouped]
    )
    assert cfg.to_dict()["model"]["moe_grouped_gemm"] == grouped


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.recompute=partial", "model.recompute must be one of none, selective, full"),
        ("model.moe_grouped_gemm=yes please", "model.moe_grouped_gemm must be one of auto, true"),
        ("model.moe_grouped_gemm=1", "model.moe_grouped_gemm must be one of auto, true, false"),
    ],
)
def test_bad_model_modes_are_one_line_naming_the_choices(override, message):
    with pytest.raises(UserError, match=message) as e:
        load_config(None, ["model.path=m", override])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("rank", "experts", "targets", "grouped", "te", "want"),
    [
        (0, "per_expert", None, None, False, None),  # LoRA off: the device decides
        (4, "per_expert", None, None, False, False),  # per-expert adapters: SequentialMLP
        (4, "shared", None, None, False, None),  # grouped experts take a shared adapter
        (4, "shared", None, None, True, False),  # TE's grouped MLP takes none
        (4, "shared", None, True, False, True),
        (4, "per_expert", ["linear_qkv"], True, True, True),  # experts not adapted
        (4, "per_expert", None, False, True, False),
    ],
)
def test_lora_picks_experts_its_adapters_can_sit_on(rank, experts, targets, grouped, te, want):
    from megatron_gspo.model.lora_config import ExpertAdapters, LoraConfig

    cfg = LoraConfig(rank=rank, experts=ExpertAdapters(experts))
    if targets is not None:
        cfg.targets = targets
    assert cfg.experts_build(grouped, te) is want
    with pytest.raises(UserError, match="model.moe_grouped_gemm=false"):
        LoraConfig(rank=4, experts=ExpertAdapters.SHARED).experts_build(True, te=True)


def test_greedy_rollouts_that_cannot_learn_are_refused(tmp_path):
    """rollout.temperature=0 used to train every step on groups of identical answers (zero
    advantages, nothing learned) without a word; it is refused in one line at load."""
    path = _write(tmp_path, "model: {path: m}\n")
    with pytest.raises(UserError) as e:
        load_config(path, ["rollout.temperature=0"])
    message = str(e.value)
    assert message.startswith("rollout.temperature=0 samples greedily") and "\n" not in message
    assert "set rollout.temperature > 0" in message
    assert load_config(path, ["rollout.temperature=0.01"]).rollout.temperature == 0.01
