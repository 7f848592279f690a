"""Multi-turn episodes against the built-in server: what the sample holds (model and environment
tokens, the loss mask, log-probs and R3 routing against a teacher-forced HF forward of the whole
episode), the limits, and a training run whose environment fails in every way a user's code can.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from megatron_gspo.data.prompts import PromptRow
from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.rollout.client import RolloutClient
from megatron_gspo.rollout.env import EnvCalls
from megatron_gspo.rollout.episodes import ChatRender, EpisodeRunner, Limits
from tests.e2e.server_process import running_server
from tests.e2e.test_rollout_server import hf_teacher_forced
from tests.e2e.test_train import error_lines, metrics, train
from tests.helpers import NUMBER_FN

pytestmark = pytest.mark.e2e

SPEC = TinySpec(tokenizer="chars", layers=3, dense_layers=[0], init_std=0.2, seed=7)
ROW = PromptRow("what is 12*34 ?", "408")
# What the chat template writes after an assistant turn for one tool result, written out
TOOL_CONTINUATION = (
    "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return make_tiny_model(SPEC, tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def server(chat_model):
    with running_server(chat_model, "--enable-return-routed-experts") as url:
        yield url


def _episode(url, tok, env, limits, sampling=None, n=1, row=ROW):
    calls = EnvCalls(f"tests.e2e.envs:{env}", timeout_s=10.0, vocab_size=len(tok), workers=1)
    runner = EpisodeRunner(calls, ChatRender(tok), limits)
    sp = sampling or {"temperature": 1.0, "sampling_seed": 3}

    async def go():
        async with RolloutClient([url]) as client:
            return await asyncio.gather(*(
                runner.run(client, row, [1, 2, 3], sp, True, (0, j), 100) for j in range(n)
            ))  # fmt: skip

    try:
        return asyncio.run(go())
    finally:
        calls.close()


def test_an_episode_holds_model_and_environment_tokens_with_the_model_s_logprobs_and_routing(
    server, chat_model, tmp_path
):
    tok = AutoTokenizer.from_pretrained(chat_model)
    seen = tmp_path / "seen.jsonl"  # the turns the environment got (envs.py: Scripted)
    row = PromptRow(ROW.prompt, ROW.answer, {"seen": str(seen)})
    [s] = _episode(server, tok, "Scripted", Limits(max_turns=6, max_turn_tokens=5,
                                                   max_tokens=200), row=row)  # fmt: skip
    turns = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len(turns) == 4 and all(1 <= len(t) <= 5 for t in turns)
    assert s.turns == 4 and s.finish_reason == "stop" and s.env_reward == 0.75
    render = ChatRender(tok)
    prompt = "<|im_start|>user\nwhat is 12*34 ?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(s.prompt_ids, skip_special_tokens=False) == prompt
    env = [tok.encode(TOOL_CONTINUATION, add_special_tokens=False),
           tok.encode("ok?", add_special_tokens=False), [5, 6, 7]]  # fmt: skip
    assert env[0] == render.continuation([{"role": "tool", "content": "42"}])
    want = turns[0] + env[0] + turns[1] + env[1] + turns[2] + env[2] + turns[3]
    assert s.tokens == want
    model = [1] * len(turns[0])
    for e, t in zip(env, turns[1:]):
        model += [0] * len(e) + [1] * len(t)
    assert s.loss_mask == model
    # every model token's log-prob is the teacher-forced one given the whole episode before it
    full = s.prompt_ids + s.tokens
    logp, topk = hf_teacher_forced(chat_model, full)
    p = len(s.prompt_ids)
    ref = logp[p - 1 : -1].gather(1, torch.tensor(s.tokens)[:, None])[:, 0]
    got = torch.tensor([v if v is not None else float("nan") for v in s.logprobs])
    on = torch.tensor(model, dtype=torch.bool)
    assert torch.isnan(got[~on]).all()
    torch.testing.assert_close(got[on], ref[on], atol=1e-4, rtol=0)
    # R3: every position of the episode has the routing the server computed for it
    assert s.routed_experts.shape == (len(full) - 1, 3, 2)
    routed = torch.from_numpy(s.routed_experts[:, 1:]).sort(-1).values.long()
    assert torch.equal(routed, topk[:-1])


@pytest.mark.parametrize(
    "limits, turns, length",
    [
        (Limits(max_turns=3, max_turn_tokens=2, max_tokens=100), 3, 3 * 2 + 2 * 4),
        # 2 + 4 + 2 = 8 tokens; the next answer would make 12 > 11: not appended
        (Limits(max_turns=9, max_turn_tokens=2, max_tokens=11), 2, 8),
    ],
)
def test_an_episode_ends_at_its_turn_and_token_limits(server, chat_model, limits, turns, length):
    tok = AutoTokenizer.from_pretrained(chat_model)
    greedy_no_eos = {"temperature": 0.0, "ignore_eos": True}
    [s] = _episode(server, tok, "Endless", limits, greedy_no_eos)
    assert (s.turns, len(s.tokens), s.finish_reason) == (turns, length, "length")
    assert s.loss_mask[-2:] == [1, 1] and s.tokens[2:6] == [10, 11, 12, 13]


def test_an_observation_far_past_the_episode_s_room_ends_it_without_being_tokenized(
    server, chat_model
):
    """30 million characters cannot be 100 tokens: the episode ends at its token limit at once
    (tokenizing them held the trainer's loop, every other episode with it, for 40 s)."""
    tok = AutoTokenizer.from_pretrained(chat_model)
    t0 = time.perf_counter()
    [s] = _episode(server, tok, "Flood", Limits(max_turns=3, max_turn_tokens=2, max_tokens=100),
                   {"temperature": 0.0, "ignore_eos": True})  # fmt: skip
    assert (s.turns, len(s.tokens), s.finish_reason, s.env_error) == (1, 2, "length", None)
    assert time.perf_counter() - t0 < 15


BAD_ENV = '''
import os, time
from pathlib import Path
from megatron_gspo.rollout.env import Step

STARTS = Path(STARTS_DIR)  # one file per episode started, in any worker process

NUMBER_FN


class Env:
    """Four of every five episodes started fail, each in a different way; the fifth answers
    once, then is done (so that every step has episodes of each kind: a step on which every
    episode failed ends the run)."""

    def __init__(self, row):
        self.kind = _number(STARTS) % 5
        if self.kind == 0:
            raise RuntimeError("cannot start this one")
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        if self.kind == 1:
            raise ValueError("bad turn")
        if self.kind == 2:
            time.sleep(3600)  # (the run must still end, and its process exit)
        if self.kind == 3:
            return {"observation": "not a Step"}
        if self.turns == 2:
            return Step(done=True, reward=float(len(turn.ids) > 1))
        return Step("again:")
'''


def test_an_environment_that_raises_hangs_or_returns_garbage_is_counted_and_the_run_finishes(
    chat_model, tmp_path
):
    path, starts = tmp_path / "bad_env.py", tmp_path / "starts"
    starts.mkdir()
    path.write_text(
        BAD_ENV.replace("STARTS_DIR", repr(str(starts))).replace("NUMBER_FN", NUMBER_FN)
    )
    run_dir = tmp_path / "run"
    # (a worker per episode: a hang takes no other episode with its worker)
    rc, out = train("tiny_moe_gspo.yaml", run_dir, chat_model, f"env.fn={path}:Env",
                    "env.timeout_s=0.5", "train.eval_every=0", "rollout.max_new_tokens=4",
                    "env.workers=16")  # fmt: skip
    assert rc == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # starts 0-15, then 16-31: one in five works; the failed starts' groups drop
        assert r["env/errors"] == 13.0 and r["rollout/samples"] == 16.0, r
        assert r["reward/failed_samples"] == [4.0, 3.0][r["step"] - 1], r
        assert r["env/turns_mean"] > 0, r
    summary = [line for line in out.splitlines() if " episodes (first: " in line]
    assert [line.split(":")[0] for line in summary] == ["step 1", "step 2"], out[-3000:]
    log = (run_dir / "logs" / "env.log").read_text()
    for what in ("cannot start this one", "bad turn", "ran past env.timeout_s (0.5 s)",
                 "returned dict", "Traceback (most recent call last)"):  # fmt: skip
        assert what in log, what


CTOR_FLAKY_ENV = '''
import itertools
from megatron_gspo.rollout.env import Step

STARTS = itertools.count()  # (one worker: every episode of the run starts in this process)

class Env:
    """Every third episode fails to start; the others end after the model's first turn."""

    def __init__(self, row):
        if next(STARTS) % 3 == 0:
            raise RuntimeError("flaky start")

    def step(self, turn):
        return Step(done=True, reward=float(len(turn.ids) % 2 == 0))
'''


def test_episodes_that_failed_to_start_are_not_stale_and_nothing_is_generated_again(
    chat_model, tmp_path
):
    """An episode whose environment raised in its constructor has no model turn, so no weights
    wrote it: from step 2 on (the servers on version 1) it was counted as a sample from older
    weights, and the step's batch was generated again up to 3 times. Its group is dropped as a
    failed reward, and the console line names the run's own env.log."""
    path = tmp_path / "ctor_flaky.py"
    path.write_text(CTOR_FLAKY_ENV)
    run_dir = tmp_path / "run"
    rc, out = train("tiny_moe_gspo.yaml", run_dir, chat_model, f"env.fn={path}:Env",
                    "env.workers=1", "train.eval_every=0", "rollout.max_new_tokens=4",
                    steps=3)  # fmt: skip
    assert rc == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # 16 starts a step (none again), every third fails: 6, 5, 5
        assert r["rollout/stale_samples"] == r["rollout/stale_groups_dropped"] == 0.0, r
        assert r["rollout/regenerated_samples"] == 0.0, r
        assert r["env/errors"] == r["reward/failed_samples"] == [6.0, 5.0, 5.0][r["step"] - 1], r
    assert "generating again" not in out and "older than" not in out, out[-3000:]
    env_log = run_dir.resolve() / "logs" / "env.log"
    assert f"step 2: the environment '{path}:Env' failed on 5 of 16 episodes" in out, out[-3000:]
    assert f"; {env_log} has each" in out and "RUN_DIR" not in out, out[-3000:]
    assert env_log.read_text().count("starting the episode raised RuntimeError: flaky start") == 16


STEP_FAILS_ENV = '''
import itertools
from megatron_gspo.rollout.env import Step

CALLS = itertools.count()  # (one worker: every step() of the run is called in this process)

class Env:
    """Step 1's 16 episodes end after the model's first turn; every later step() raises."""

    def __init__(self, row):
        pass

    def step(self, turn):
        if next(CALLS) >= 16:
            raise ValueError("bad turn")
        return Step(done=True, reward=float(len(turn.ids) % 2 == 0))
'''


def test_a_step_whose_every_episode_failed_in_step_ends_the_run_and_keeps_its_checkpoints(
    chat_model, tmp_path
):
    """An environment whose step() raises on every episode of step 2: that step trained on
    rewards all 0 and the run went on to exit 0, where a reward failing on every sample ends it.
    Now it ends there in one line naming the run's env.log (exit 2), step 1's checkpoint kept."""
    path = tmp_path / "step_fails.py"
    path.write_text(STEP_FAILS_ENV)
    run_dir = tmp_path / "run"
    rc, out = train("tiny_moe_gspo.yaml", run_dir, chat_model, f"env.fn={path}:Env",
                    "env.workers=1", "train.eval_every=0", "rollout.max_new_tokens=4",
                    "train.checkpoint_every=1", steps=3)  # fmt: skip
    env_log = run_dir.resolve() / "logs" / "env.log"
    assert rc == 2 and error_lines(out) == [
        f"error: environment '{path}:Env' failed: step() raised ValueError: bad turn (all 16 "
        f"samples of step 2 failed; {env_log} has each, with its traceback)"
    ], out[-3000:]
    assert " episodes (first: " not in out, out[-3000:]  # (the error is the step's one line)
    assert [r["step"] for r in metrics(run_dir)] == [1]
    assert (run_dir / "checkpoints" / "step_1" / "trainer_state.json").is_file()
    assert env_log.read_text().count("ValueError: bad turn") == 2 * 16  # (line and traceback)


GOOD_ENV = '''
from megatron_gspo.rollout.env import Step

class Env:
    """Two more turns after the first, each answered with a tool message; reward: the last
    turn's length is even."""

    def __init__(self, row):
        self.row = row

    def prompt(self):
        return [{"role": "user", "content": self.row.prompt}]

    def step(self, turn):
        if turn.index == 2:
            return Step(done=True, reward=float(len(turn.ids) % 2 == 0))
        return Step([{"role": "tool", "content": str(turn.index)}])
'''


def test_episodes_train_with_r3_dynamic_sampling_and_rollouts_one_step_ahead(chat_model,
                                                                            tmp_path):  # fmt: skip
    """GRPO+R3 on episodes, generated one step ahead, groups without a spread dropped: the run
    finishes; on the first step (no staleness yet) the trainer's log-probs of the model's tokens
    are the servers' (R3 replays the stitched routing of every position, the environment's
    tokens included)."""
    path = tmp_path / "good_env.py"
    path.write_text(GOOD_ENV)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}*{i} ?", "answer": "a"}) + "\n"
                            for i in range(40)))  # fmt: skip
    run_dir = tmp_path / "run"
    rc, out = train("tiny_moe_grpo_r3.yaml", run_dir, chat_model, f"env.fn={path}:Env",
                    f"data.train={data}", "train.eval_every=0", "rollout.max_new_tokens=5",
                    "rollout.max_staleness=1", "algo.dynamic_sampling=true",
                    steps=3)  # fmt: skip
    assert rc == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["env/turns_mean"] == 3.0 and r["env/errors"] == 0.0, r
        assert r["env/env_tokens_mean"] > 2 * 10, r  # two template turns of > 10 tokens each
        assert r["env/reward_given"] == r["rollout/samples"], r
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    # step 1's batch comes from the trainer's own weights (later ones from one version behind)
    assert rows[0]["mismatch/logprob_abs_diff"] < 1e-3, rows[0]
    assert rows[0]["routing/rollout_train_agreement"] > 0.99, rows[0]


KILL_ENV = '''
import os, time
from pathlib import Path
from megatron_gspo.rollout.env import Step

FLAGS = Path({flags!r})

class Env:
    """Three model turns, tool messages between them. Until the test has killed server 0
    (`killed`), every episode that reaches its second turn waits there, the first one saying
    so (`paused`): then all their next turns are sent at once, to both servers."""

    def __init__(self, row):
        self.row = row

    def prompt(self):
        return [{{"role": "user", "content": self.row.prompt}}]

    def step(self, turn):
        if turn.index == 1:
            (FLAGS / "paused").touch()
            deadline = time.monotonic() + 240
            while not (FLAGS / "killed").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        if turn.index == 2:
            return Step(done=True, reward=float(len(turn.ids) % 2 == 0))
        return Step([{{"role": "tool", "content": str(turn.index)}}])
'''


def test_a_server_killed_in_the_middle_of_episodes_leaves_them_whole(chat_model, tmp_path):
    """Two servers; server 0 is killed -9 while the first step's episodes are between turns
    (held there until the kill). Their next turns, sent to both servers, fail on server 0 and
    are retried on server 1 (or on server 0 once its supervisor has restarted it): every episode
    still has its three model turns, no environment error, and the run finishes with server 0
    restarted."""
    from tests.e2e.test_train import _wait_for, server_process

    flags = tmp_path / "flags"
    flags.mkdir()
    path = tmp_path / "kill_env.py"
    path.write_text(KILL_ENV.format(flags=str(flags)))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i} ?", "answer": "a"}) + "\n"
                            for i in range(40)))  # fmt: skip
    run_dir = tmp_path / "run"
    proc = train("tiny_moe_gspo.yaml", run_dir, chat_model, f"env.fn={path}:Env",
                 f"data.train={data}", "train.eval_every=0", "rollout.max_new_tokens=5",
                 "rollout.servers=2", "env.timeout_s=300", steps=2, wait=False)  # fmt: skip
    try:
        _wait_for(lambda: (flags / "paused").exists(), proc)
        server0 = server_process(proc, run_dir)
        port = server0.cmdline()[server0.cmdline().index("--port") + 1]
        server0.kill()
        server0.wait(timeout=30)
        (flags / "killed").touch()
        assert proc.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        proc.kill()
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["env/errors"] == 0.0 and r["env/turns_mean"] == 3.0, r
        assert r["rollout/samples"] == 16.0 and r["env/reward_given"] == 16.0, r
        assert r.get("rollout/stale_samples", 0.0) == 0.0, r
    assert "start #1" in (run_dir / "logs" / "server-0.log").read_text()
    assert f"failed on http://127.0.0.1:{port}" in (tmp_path / "run.log").read_text()


SLOW_ENV = '''
import os, time
from pathlib import Path
from megatron_gspo.rollout.env import Step

METRICS = Path({metrics!r})
STARTED = Path({started!r})  # one file per episode started, in any worker process

{number_fn}

class Env:
    """Three model turns. The episodes of step 2's batch (the 17th to 32nd started: 16 a step)
    wait before their last turn until step 1 is logged, that is until after the weight sync
    that ends step 1 (at most 120 s)."""

    def __init__(self, row):
        self.row, self.k = row, _number(STARTED)

    def prompt(self):
        return [{{"role": "user", "content": self.row.prompt}}]

    def step(self, turn):
        if turn.index == 1 and 16 <= self.k < 32:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (
                METRICS.exists() and '"step": 1,' in METRICS.read_text()
            ):
                time.sleep(0.05)
        if turn.index == 2:
            return Step(done=True, reward=float(len(turn.ids) % 2 == 0))
        return Step([{{"role": "tool", "content": str(turn.index)}}])
'''


def test_partial_rollouts_go_on_across_a_weight_sync_on_the_new_weights(chat_model, tmp_path):
    """rollout.partial with max_staleness 1: step 2's episodes, generated during step 1, are
    between turns when step 1's weight sync comes (their environment holds them there); the sync
    does not wait for them, and their last turn is written by the new weights. So every sample of
    step 2 has tokens from versions 0 and 1 (partial_fraction 1, staleness between 0 and 1 on
    average over tokens, 1 at most); step 1 (synchronous) has none. (The contract tier checks the
    per-token versions and log-probs of a request cut in the middle.)"""
    run_dir = tmp_path / "run"
    path = tmp_path / "slow_env.py"
    (tmp_path / "started").mkdir()
    path.write_text(SLOW_ENV.format(number_fn=NUMBER_FN, metrics=str(run_dir / "metrics.jsonl"),
                                    started=str(tmp_path / "started")))  # fmt: skip
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}-{i} ?", "answer": "a"}) + "\n"
                            for i in range(40)))  # fmt: skip
    rc, out = train("tiny_moe_gspo.yaml", run_dir, chat_model, f"env.fn={path}:Env",
                    f"data.train={data}", "train.eval_every=0", "rollout.max_new_tokens=5",
                    "rollout.max_staleness=1", "rollout.partial=true", "env.timeout_s=300",
                    steps=3)  # fmt: skip
    assert rc == 0, out[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # (step 3's batch is held too if its generation is still going at step 2's sync: a loaded
    # machine's timing, so only its oldest version is fixed)
    assert [r["rollout/partial_fraction"] for r in rows[:2]] == [0.0, 1.0]
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert 0.0 < rows[1]["rollout/staleness_mean"] < 1.0, rows[1]
    for r in rows:
        assert r["env/turns_mean"] == 3.0 and r["env/errors"] == 0.0, r
        assert r.get("rollout/stale_groups_dropped", 0.0) == 0.0, r
