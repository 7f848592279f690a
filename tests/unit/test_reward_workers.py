"""Training's rewards in worker processes (rewards/scoring.py, train/generate.py): a reward that
hangs, exits, interrupts or kills its process fails that sample alone, within reward.timeout_s,
logged to reward.log; junk values are refused; a broken plugin fails at start; and the calls run
side by side, each sample sent as soon as its group's generation ends."""

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_gspo.bounded import Kind
from megatron_gspo.config import load_config
from megatron_gspo.data.prompts import PromptRow
from megatron_gspo.errors import UserError
from megatron_gspo.rewards import Scored
from megatron_gspo.rewards.scoring import RewardScorer
from megatron_gspo.rollout.partial import Hold
from megatron_gspo.rollout.sample import Sample
from megatron_gspo.train.generate import Generation
from megatron_gspo.train.samples import reward_failures

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
REWARD = "tests.unit.user_code:reward"  # user_code.py: the prompt says how to misbehave


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("hang", "ran past reward.timeout_s (0.5 s) (prompt 'hang'); its worker was killed"),
        ("spin", "ran past reward.timeout_s (0.5 s) (prompt 'spin'); its worker was killed"),
        ("exit", "raised SystemExit: 3 (prompt 'exit'); fix the reward function"),
        ("interrupt", "raised KeyboardInterrupt (prompt 'interrupt'); fix the reward function"),
        ("die", "its worker process died, exited with code 7 (prompt 'die')"),
        ("kill", "its worker process died, killed by SIGKILL"),
    ],
)
def test_a_reward_that_hangs_exits_or_kills_its_process_fails_its_sample_alone(
    tmp_path, prompt, message
):
    log = tmp_path / "logs" / "reward.log"
    scorer = RewardScorer(REWARD, workers=2, timeout_s=0.5, log_path=log)
    try:
        t0 = time.monotonic()
        futures = [scorer.submit(p, "42", "42", where="step 3") for p in (prompt, "a", "b", "c")]
        bad, *good = [f.result(timeout=60) for f in futures]
        assert time.monotonic() - t0 < 20  # the hang ends at the limit, not in an hour
        assert bad.kind is not Kind.VALUE and message in bad.message, bad.message
        assert bad.message.startswith(f"reward {REWARD!r}")
        assert [o.value for o in good] == [1.0, 1.0, 1.0]
        assert scorer.submit("d", "1", "2").result(timeout=60).value == 0.0  # (a new worker)
    finally:
        scorer.close()
    assert f"step 3: {bad.message}" in log.read_text()


def test_a_plugin_that_fails_to_load_in_a_new_worker_fails_those_samples_and_loads_later(
    tmp_path, monkeypatch
):
    """Its worker died, and the new one's import raised (a file missing for a moment): that
    sample fails, with the load's error in reward.log, and a later sample, once the backoff
    (1 s) has passed, is scored by a worker that loaded it. It used to fail every later sample."""
    log, loads = tmp_path / "logs" / "reward.log", tmp_path / "loads"
    monkeypatch.setenv("USER_CODE_LOADS", f"{loads}:2")  # (user_code.py: the 2nd load raises)
    scorer = RewardScorer(REWARD, workers=1, timeout_s=5.0, log_path=log)
    try:
        assert scorer.submit("die", "1", "1").result(timeout=60).kind is Kind.DIED
        failed = scorer.submit("a", "1", "1", where="step 4").result(timeout=60)
        later = [scorer.submit("b", "1", "1").result(timeout=60)]
        deadline = time.monotonic() + 30
        while later[-1].kind is not Kind.VALUE and time.monotonic() < deadline:
            time.sleep(0.1)
            later.append(scorer.submit("b", "1", "1").result(timeout=60))
    finally:
        scorer.close()
    why = (f"reward {REWARD!r}: not scored, a new worker could not load the code: reward plugin "
           f"{REWARD!r}: importing 'tests.unit.user_code' raised FileNotFoundError: load 2: "
           "data.bin is missing")  # fmt: skip
    assert (failed.kind, failed.message) == (Kind.START, why)
    assert f"step 4: {why}\n" in log.read_text()
    assert later[-1].value == 1.0 and all(o.message.startswith(why) for o in later[:-1])
    assert len(loads.read_text().splitlines()) == 3


def test_reward_log_stops_growing_at_its_budget_and_says_so_once(tmp_path):
    """A plugin that fails on every sample wrote a traceback per sample without end: past the
    budget the log gets one line saying so, and the failures go on being outcomes (counted)."""
    log = tmp_path / "logs" / "reward.log"
    scorer = RewardScorer(REWARD, workers=1, timeout_s=5.0, log_path=log, log_bytes=1000)
    try:
        got = [scorer.submit("exit", "", "", where=f"step {i}").result(timeout=60)
               for i in range(12)]  # fmt: skip
    finally:
        scorer.close()
    assert all(o.kind is Kind.RAISED for o in got)
    text = log.read_text()
    *written, last = text.splitlines()
    assert last.endswith(
        " reward.log reached 1000 bytes: further failures are not written here, only counted "
        "(reward/failed_samples in metrics.jsonl)"
    )
    assert "step 0: " in text and "step 11: " not in text and "reached" not in "".join(written)
    assert len(text.encode()) - len(last) - 1 <= 1000
    assert scorer.log.unwritten == 12 - text.count("raised SystemExit")


@pytest.mark.parametrize(
    "prompt, shown",
    [
        ("nan", "nan (float)"),
        ("str", "'1.0' (str)"),
        ("none", "None (NoneType)"),
        ("big", "1000"),
    ],  # fmt: skip
)
def test_a_reward_that_is_not_a_finite_number_fails_its_sample(prompt, shown):
    scorer = RewardScorer("tests.unit.user_code:junk_reward", workers=1)
    try:
        o = scorer.submit(prompt, "", "").result(timeout=60)
        assert o.kind is Kind.REFUSED and f"returned {shown}" in o.message
        assert "it must return a finite number" in o.message
        assert scorer.submit("fine", "", "").result(timeout=60).value == 0.5
    finally:
        scorer.close()


def test_an_async_reward_is_awaited_in_its_worker():
    scorer = RewardScorer("tests.unit.user_code:async_reward", workers=1)
    try:
        got = [scorer.submit("p", r, "15").result(timeout=60) for r in ("15", "16", "15")]
    finally:
        scorer.close()
    assert [(o.kind, o.value) for o in got] == [(Kind.VALUE, 1.0), (Kind.VALUE, 0.0)] + [
        (Kind.VALUE, 1.0)
    ]


def test_math_is_scored_in_the_workers_and_exact_in_the_trainer():
    """math-verify's own bound (SIGALRM) works on a main thread only: math runs in workers."""
    math, exact = RewardScorer("math", workers=1), RewardScorer("exact")
    try:
        assert math.pool is not None and exact.pool is None
        got = [math.submit("", r, "15").result(timeout=120).value for r in ("1 5", "\\boxed{16}")]
        assert got == [1.0, 0.0]
        assert exact.submit("", "1 5", "15").result().value == 1.0
    finally:
        math.close()


def test_a_plugin_that_cannot_be_imported_fails_at_start_as_before():
    with pytest.raises(UserError, match="cannot import 'nosuch_mod_xyz'.*PYTHONPATH"):
        RewardScorer("nosuch_mod_xyz:fn")


LOADS = """
from megatron_gspo.errors import UserError
from megatron_gspo.rewards import Scored
from megatron_gspo.rewards.scoring import RewardScorer

try:
    RewardScorer("{spec}", workers=2)
except UserError as e:
    print("error:", e)
print("the trainer goes on")
"""


@pytest.mark.parametrize(
    "plugin, message",
    [
        ("import sys\nsys.exit(0)\n", "importing '{path}' raised SystemExit: 0"),
        ("raise KeyboardInterrupt\n", "importing '{path}' raised KeyboardInterrupt"),
        ("import os\nos._exit(0)\n", "could not be loaded: a worker process ended while "
         "starting (exited with code 0); its module must import without exiting, hanging or "
         "ending its process"),
        ("def judge(response):\n    return 1.0\n", "it takes (response) (too many positional "
         "arguments); it must be callable as fn(prompt, response, answer) -> float"),
    ],
)  # fmt: skip
def test_a_plugin_that_exits_or_cannot_be_called_fails_at_start_and_the_trainer_goes_on(
    tmp_path, plugin, message
):
    """The check at start imports the plugin in a worker: a module that exits when imported
    fails the load, with one line, instead of ending the trainer (silently, with code 0)."""
    path = tmp_path / "judge.py"
    path.write_text(plugin)
    script = tmp_path / "trainer.py"
    script.write_text(LOADS.format(spec=f"{path}:judge"))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    expected = f"error: reward plugin '{path}:judge'"
    assert out.stdout.splitlines() == [
        f"{expected}{'' if 'could not' in message else ':'} {message.format(path=path)}",
        "the trainer goes on",
    ], out.stderr[-2000:]
    assert out.returncode == 0


def test_a_plugin_file_that_imports_a_module_beside_it_is_told_to_put_its_folder_on_the_path(
    tmp_path,
):
    (tmp_path / "helpers.py").write_text("def norm(s):\n    return s.strip()\n")
    path = tmp_path / "my_rewards.py"
    path.write_text("from helpers import norm\n\ndef judge(p, r, a):\n    return 1.0\n")
    with pytest.raises(UserError) as e:
        RewardScorer(f"{path}:judge", workers=1)
    assert str(e.value) == (
        f"reward plugin '{path}:judge': cannot import '{path}' (No module named 'helpers'); it "
        f"imports 'helpers' from its own folder: put '{tmp_path}' on PYTHONPATH"
    )


def test_a_plugin_slower_to_load_than_reward_start_timeout_s_names_the_key_to_raise(tmp_path):
    """A plugin that loads a judge model when imported may take minutes: the limit on a worker's
    start is the config's, and the line says which key to raise."""
    path = tmp_path / "judge.py"
    path.write_text("import time\ntime.sleep(60)\ndef judge(p, r, a):\n    return 1.0\n")
    cfg = load_config(None, ["model.path=m", f"reward.fn={path}:judge", "reward.workers=1",
                             "reward.start_timeout_s=1"])  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        Generation(cfg, _Tok(), tmp_path)
    assert time.monotonic() - t0 < 30
    assert str(e.value) == (
        f"reward plugin '{path}:judge' could not be loaded: a worker did not start within "
        "reward.start_timeout_s (1 s); raise it if the code takes longer to load; its module "
        "must import without exiting, hanging or ending its process"
    )


@pytest.mark.parametrize("value", ["1e-9", "0.001", "0"])
def test_a_reward_timeout_too_short_for_any_call_is_refused_with_the_config(value):
    """Below 0.01 s every call would time out (and its worker be replaced): a config error."""
    with pytest.raises(UserError) as e:
        load_config(None, ["model.path=m", f"reward.timeout_s={value}"]).check()
    assert str(e.value) == (
        f"reward.timeout_s must be a finite number in [0.01, 1e+09], not {float(value)!r}"
    )
    load_config(None, ["model.path=m", "reward.timeout_s=0.01"]).check()


@pytest.mark.parametrize("fn", ["123", ":", "exact ", "judge.py:", ":judge"])
def test_a_reward_fn_that_names_nothing_is_refused_with_the_config(fn):
    """Found when the config is checked, not once the model is built (where the plugin loads)."""
    with pytest.raises(UserError) as e:
        load_config(None, ["model.path=m", f"reward.fn='{fn}'"]).check()
    assert str(e.value) == (
        f"reward.fn {fn!r} is neither exact, math nor module:function (or file.py:function); "
        "write it as one of those"
    )


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


class _Paced:
    """Rollout servers that finish prompt i's group i s after it is asked for (the fault
    injected: groups that end at different times); `ended[i]`: when it did."""

    def __init__(self):
        self.hold, self.ended = Hold(self), {}

    async def generate(self, prompts, n=1, sampling_params=None, return_logprob=True,
                       return_routed_experts=False, grouped=False):  # fmt: skip
        [ids] = prompts
        await asyncio.sleep(ids[0])
        self.ended[ids[0]] = time.time()
        return [[Sample(0, j, ids, [1] * (j + 1), finish_reason="stop") for j in range(n)]]

    async def abort(self):
        pass

    def outstanding(self):
        return 0


def test_rewards_are_scored_side_by_side_while_generation_goes_on(tmp_path, monkeypatch):
    """Each call sleeps 0.3 s (a remote judge): a group's calls start as soon as it is generated,
    before the last group is, and run in several processes at once."""
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("USER_CODE_CALLS", str(calls))
    cfg = load_config(None, ["model.path=m", "reward.fn=tests.unit.user_code:slow_reward",
                             "reward.workers=3"])  # fmt: skip
    gen = Generation(cfg, _Tok(), tmp_path)
    assert gen.rewards.pool is not None and gen.rewards.pool.wait_ready(120)
    client = _Paced()
    rows = [PromptRow(f"p{i}", "a") for i in range(3)]
    try:
        out = asyncio.run(gen.rollout(client, rows, [[0], [1], [2]], 2, {}, step=1))
    finally:
        gen.close()
    assert out.scored.rewards == [1.0, 2.0] * 3 and out.scored.failures == []
    assert [[s.prompt_index for s in g] for g in out.groups] == [[0, 0], [1, 1], [2, 2]]
    got = [json.loads(line) for line in calls.read_text().splitlines()]
    assert min(c["start"] for c in got if c["prompt"] == "p0") < client.ended[2]
    assert any(a["pid"] != b["pid"] and a["start"] < b["end"] and b["start"] < a["end"]
               for a in got for b in got)  # fmt: skip


def test_the_lines_about_a_step_s_failed_rewards_name_the_run_s_reward_log(tmp_path, caplog):
    """The step's warning (some samples failed) and the error that ends the run (every one did)
    said why the first failed and "fix the reward function", but not where the tracebacks are:
    each now names RUN_DIR/logs/reward.log."""
    cfg = load_config(None, ["model.path=m", f"reward.fn={REWARD}", "reward.workers=1"])
    gen = Generation(cfg, _Tok(), tmp_path)
    rows = [PromptRow("raise", "xx"), PromptRow("ok", "xx")]
    samples = [Sample(i, 0, [1], [1, 1], finish_reason="stop") for i in (0, 1, 0)]
    try:
        scored = gen.score(rows, samples, "step 3")
    finally:
        gen.close()
    log = tmp_path / "logs" / "reward.log"
    first = (
        f"reward {REWARD!r} raised RuntimeError: broken (prompt 'raise'); fix the reward function"
    )
    assert scored.rewards == [None, 1.0, None]
    with caplog.at_level(logging.WARNING, logger="megatron_gspo.train.samples"):
        assert reward_failures(scored, 3) == [0, 2]
    assert caplog.messages == [
        f"step 3: the reward failed on 2 of 3 samples; their groups are dropped (first: {first}); "
        f"{log} has each, with its traceback"
    ]
    every = Scored(scored.rewards[::2], scored.errors[::2])  # (the two that failed)
    with pytest.raises(UserError) as e:
        reward_failures(every, 3)
    assert str(e.value) == (
        f"{first} (all 2 samples of step 3 failed; {log} has each, with its traceback)"
    )
    assert log.read_text().count("Traceback (most recent call last)") == 2
