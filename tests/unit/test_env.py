"""Environments of multi-turn rollouts: calls into the user's code (timeouts, failures, checked
results), the built-in tool environment's turns, the reward an episode gets, and the policy loss
over a loss mask with the environment's tokens masked out, against formulas written out."""

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_gspo.algo.policy_loss import policy_loss
from megatron_gspo.config import Config, load_config
from megatron_gspo.data.prompts import PromptRow
from megatron_gspo.errors import UserError
from megatron_gspo.hf.tiny import build_tokenizer
from megatron_gspo.rollout.env import EnvCalls, EnvError, Step, Turn, load_env
from megatron_gspo.rollout.episodes import ChatRender, EpisodeRunner, Limits
from megatron_gspo.rollout.sample import Sample
from megatron_gspo.rollout.tool_env import tool_env
from megatron_gspo.train.generate import Generation
from megatron_gspo.train.samples import reward_failures, to_batch

pytestmark = pytest.mark.unit

ROW = PromptRow("what is 2*3 ?", "6")


ENV = "tests.unit.user_code:"  # the environments the worker processes import (user_code.py)


def _turn(text: str, index: int = 0) -> Turn:
    return Turn(text, [1, 2], "stop", index)


def _step(name, text="abc", timeout_s=5.0, row=ROW):
    calls = EnvCalls(ENV + name, timeout_s=timeout_s, vocab_size=100, workers=1)

    async def go():
        episode = await calls.start(row)
        return await calls.step(episode, _turn(text))

    try:
        return asyncio.run(go())
    finally:
        calls.close()


@pytest.mark.parametrize("name", ["Echo", "AsyncEcho", "echo"])
def test_plain_async_and_function_environments_answer_a_turn(name):
    assert _step(name) == Step("cba", done=False, reward=None)


def _returns(value) -> PromptRow:
    return PromptRow("p", "a", extra={"value": value})


GIVE = (
    "give text (a str), chat messages (a list of dicts) or token ids (a list of ints in [0, 100))"
)


@pytest.mark.parametrize(
    "name, row, message",
    [
        ("raises", ROW, "starting the episode raised RuntimeError: broken env"),
        ("Misbehaves", PromptRow("p", "hang"), "step() ran past env.timeout_s (0.3 s)"),
        ("AsyncHangs", ROW, "step() ran past env.timeout_s (0.3 s)"),
        ("Returns", _returns(None), "step() returned NoneType None; return a Step"),
        ("Returns", _returns(("obs", True)), "step() returned tuple"),
        ("Returns", _returns(Step(done=1)), "Step.done is int 1"),  # type: ignore[arg-type]
        ("Returns", _returns(Step(reward=math.nan)), "Step.reward is float nan"),
        ("Returns", _returns(Step(reward=10**400)), "Step.reward is int 1000"),
        ("Returns", _returns(Step(reward="1")), "Step.reward is str '1'"),  # type: ignore[arg-type]
        ("Returns", _returns(Step([1, 100])), "Step.observation is list [1, 100]"),
        ("Returns", _returns(Step([{"role": "tool"}])), "Step.observation is list"),
        ("Returns", _returns(Step(b"bytes")), "Step.observation is bytes"),  # type: ignore[arg-type]
        ("Returns", _returns(Step(np.array([1, 2]))),  # type: ignore[arg-type]
         f"Step.observation is ndarray array([1, 2]); {GIVE}; convert the ndarray with .tolist()"),
        ("Returns", _returns(Step((1, 2))),  # type: ignore[arg-type]
         f"Step.observation is tuple (1, 2); {GIVE}; convert the tuple with list(...)"),
        ("Returns", _returns(Step(list(np.array([1, 2])))),  # type: ignore[arg-type]
         f"{GIVE}; give Python ints, not numpy or torch scalars"),
        ("NoStep", ROW, "has no step(turn) method"),
    ],
)  # fmt: skip
def test_what_the_environment_gets_wrong_fails_its_episode(name, row, message):
    t0 = time.perf_counter()
    with pytest.raises(EnvError) as e:
        _step(name, timeout_s=0.3, row=row)
    assert message in str(e.value)
    assert time.perf_counter() - t0 < 5  # a hang ends at the timeout, not when it returns


def test_prompt_may_be_text_or_messages_and_nothing_else():
    async def go(value):
        calls = EnvCalls(ENV + "Returns", timeout_s=5.0, vocab_size=100, workers=1)
        try:
            return await calls.prompt(await calls.start(PromptRow("p", "a", {"prompt": value})))
        finally:
            calls.close()

    assert asyncio.run(go("hi")) == "hi"
    assert asyncio.run(go([{"role": "user", "content": "hi"}])) == [
        {"role": "user", "content": "hi"}
    ]
    assert asyncio.run(go(None)) is None
    with pytest.raises(EnvError, match="prompt\\(\\) returned int 3"):
        asyncio.run(go(3))


def test_load_env_names_the_fix(tmp_path):
    with pytest.raises(UserError, match="environment 'nosuch_mod:Env': cannot import"):
        load_env("nosuch_mod:Env")
    path = tmp_path / "envs.py"
    path.write_text("X = 3\nclass Env:\n    def __init__(self, row):\n        pass\n")
    assert load_env(f"{path}:Env").__name__ == "Env"
    with pytest.raises(UserError, match="'X' is a int, not callable"):
        load_env(f"{path}:X")


@pytest.mark.parametrize(
    "fn, tools, message",
    [
        ("{path}:Env", [], "environment '{path}:Env': importing '{path}' raised SystemExit: 0"),
        (ENV + "reward", [], "environment 'tests.unit.user_code:reward': it takes (prompt: 'str', "
         "response: 'str', answer: 'str') -> 'float' (missing a required argument: 'response'); "
         "it must be callable as fn(row) -> an episode with step(turn)"),
        ("tools", ["{module}:f"], "tool '{module}:f': importing '{module}' raised SystemExit: 0"),
        ("tools", ["{path}:f"], "tool '{path}:f': importing '{path}' raised SystemExit: 0"),
    ],
)  # fmt: skip
def test_environment_code_that_does_not_load_fails_at_start_and_the_trainer_goes_on(
    tmp_path, monkeypatch, fn, tools, message
):
    """The check at start loads the environment (its tools) in a worker, not in the trainer: a
    module that exits when imported is a UserError, not the trainer's exit."""
    path = tmp_path / "exits_on_import.py"
    path.write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = {"path": str(path), "module": "exits_on_import"}
    with pytest.raises(UserError) as e:
        EnvCalls(fn.format(**names), [t.format(**names) for t in tools], timeout_s=5.0,
                 vocab_size=100, workers=1)  # fmt: skip
    assert str(e.value).startswith(message.format(**names))


@pytest.mark.parametrize(
    "keys, message",
    [
        (["env.fn=nomodule"], "env.fn 'nomodule' is neither tools"),
        (["env.fn=envs.py:"], "env.fn 'envs.py:' is neither tools nor module:function_or_class"),
        (["env.fn=tools"], "env.fn tools needs env.tools"),
        (["env.tools=[calc]"], "env.tools is used by env.fn=tools only"),
        (["env.fn=a:b", "env.max_turns=0"], "env.max_turns"),
        (["env.fn=a:b", "env.timeout_s=.nan"], "env.timeout_s"),
        (["env.fn=a:b", "env.start_timeout_s=0"], "env.start_timeout_s must be a finite number"),
        (
            ["env.fn=a:b", "env.timeout_s=1e-9"],  # (every call would time out)
            r"^env.timeout_s must be a finite number in \[0.01, 1e\+09\], not 1e-09$",
        ),
    ],
)
def test_env_config_errors(keys, message):
    with pytest.raises(UserError, match=message):
        load_config(None, ["model.path=m", *keys]).check()


def test_tool_episode_runs_the_calls_of_a_turn_and_ends_on_an_answer():
    episode = tool_env(["calc"])(ROW)
    assert episode.prompt() == [{"role": "user", "content": "what is 2*3 ?"}]
    assert [t["function"]["name"] for t in episode.tools] == ["calc"]
    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "37*48"}}\n</tool_call>'
    step = episode.step(_turn(call + "\n" + call.replace("37*48", "2+")))
    assert step.done is False
    assert step.observation[0] == {"role": "tool", "content": "1776"}
    assert step.observation[1]["role"] == "tool"
    assert step.observation[1]["content"].startswith("error:")
    bad = episode.step(_turn("<tool_call>\n{not json\n</tool_call>"))
    assert bad.observation[0]["content"].startswith("error:")
    assert episode.step(_turn("1776<|im_end|>")) == Step(done=True)


ROLES = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unexpected role ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}"
)


def test_messages_the_chat_template_refuses_end_their_episode_not_the_run():
    """A template that raises on a role it does not know (as many models' do): the episode
    fails with the template's reason; the exception does not reach the step's rollout."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(128, "chars"),
                                  chat_template=ROLES, eos_token="<|im_end|>")  # fmt: skip
    calls = EnvCalls(ENV + "Returns", timeout_s=5.0, vocab_size=len(tok), workers=1)
    runner = EpisodeRunner(calls, ChatRender(tok), Limits(2, 8, 32))
    row = PromptRow("p", "a", extra={"prompt": [{"role": "judge", "content": "x"}]})
    try:
        sample = asyncio.run(runner.run(None, row, [1, 2], {}, False, (0, 0), 1))  # type: ignore[arg-type]
    finally:
        calls.close()
    assert sample.env_error == (
        "the tokenizer's chat template refused the environment's messages (TemplateError: "
        "Unexpected role judge); give messages it renders, or text"
    )
    with pytest.raises(EnvError, match="chat template refused .*Unexpected role observer"):
        ChatRender(tok).continuation([{"role": "observer", "content": "y"}])


def test_an_episode_that_failed_to_start_was_written_by_no_weights_and_is_never_stale():
    """Its constructor raised: no model turn, no weight version (it used to keep the default
    "", read as version 0: stale from step 2 on, and the step generated again). A server that
    does not report its weights ("") is still older than any step's."""
    from transformers import PreTrainedTokenizerFast

    from megatron_gspo.rollout.sample import older_than
    from megatron_gspo.train.results import Collected

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(128, "chars"),
                                  chat_template=ROLES, eos_token="<|im_end|>")  # fmt: skip
    calls = EnvCalls(ENV + "raises", timeout_s=5.0, vocab_size=len(tok), workers=1)
    runner = EpisodeRunner(calls, ChatRender(tok), Limits(2, 8, 32))
    try:
        sample = asyncio.run(runner.run(None, ROW, [1, 2], {}, False, (0, 0), 1))  # type: ignore[arg-type]
    finally:
        calls.close()
    assert "broken env" in (sample.env_error or "")
    assert (sample.tokens, sample.turns, sample.weight_version) == ([], 0, None)
    assert not older_than(sample, "7")
    assert older_than(Sample(0, 1, [1], [5], weight_version=""), "1")
    assert older_than(Sample(0, 1, [1], [5], weight_version="1"), "2")
    assert not older_than(Sample(0, 1, [1], [5], weight_version="2"), "2")
    # every sample weights wrote is stale: the batch is all stale, the failed episode aside
    assert Collected(None, {}, samples=3, stale_samples=2, unwritten=1).all_stale
    assert not Collected(None, {}, samples=3, stale_samples=1, unwritten=1).all_stale


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "prompt() returned an empty prompt; return text, chat messages, or None for the "
         "row's prompt"),
        ("x" * 21, "prompt() returned 21 tokens, over data.max_prompt_tokens (20 tokens); return "
         "a shorter prompt or raise data.max_prompt_tokens"),
        ([{"role": "user", "content": "x" * 10**7}], "prompt() returned 10000000 characters, "
         "over data.max_prompt_tokens (20 tokens); return a shorter prompt or raise "
         "data.max_prompt_tokens"),
    ],
)  # fmt: skip
def test_a_first_prompt_the_servers_would_refuse_ends_its_episode_not_the_run(prompt, message):
    """Empty, or past data.max_prompt_tokens (what the context and the servers are sized for):
    the servers answer 400, which ended the step's rollout and the run."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(128, "chars"),
                                  chat_template=ROLES, eos_token="<|im_end|>")  # fmt: skip
    calls = EnvCalls(ENV + "Returns", timeout_s=5.0, vocab_size=len(tok), workers=1)
    runner = EpisodeRunner(calls, ChatRender(tok), Limits(2, 8, 32, max_prompt_tokens=20))
    row = PromptRow("p", "a", extra={"prompt": prompt})
    try:
        sample = asyncio.run(runner.run(None, row, [1, 2], {}, False, (0, 0), 1))  # type: ignore[arg-type]
    finally:
        calls.close()
    assert (sample.env_error, sample.tokens) == (message, [])


def test_env_log_stops_growing_at_its_budget_and_says_so_once(tmp_path):
    """An environment that fails every episode wrote a traceback per episode without end."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(128, "chars"),
                                  chat_template=ROLES, eos_token="<|im_end|>")  # fmt: skip
    calls = EnvCalls(ENV + "Returns", timeout_s=5.0, vocab_size=len(tok), workers=1)
    log = tmp_path / "env.log"
    runner = EpisodeRunner(calls, ChatRender(tok), Limits(2, 8, 32), log, log_bytes=3000)
    row = PromptRow("p", "a", extra={"prompt": ""})
    try:
        samples = [asyncio.run(runner.run(None, row, [1, 2], {}, False, (0, i), 1))  # type: ignore[arg-type]
                   for i in range(8)]  # fmt: skip
    finally:
        calls.close()
    assert all(s.env_error is not None for s in samples)
    text = log.read_text()
    *written, last = text.splitlines()
    assert last.endswith(" env.log reached 3000 bytes: further failures are not written here, "
                         "only counted (env/errors in metrics.jsonl)")  # fmt: skip
    assert text.startswith("episode episode-(0, 0) (prompt 'p'): prompt() returned an empty")
    assert "reached" not in "".join(written) and len(text.encode()) - len(last) - 1 <= 3000
    entries = [line for line in written if line.startswith("episode episode-(0, ")]
    assert len(entries) >= 1 and runner.log.unwritten == 8 - len(entries)


def test_an_async_tool_s_result_is_what_the_model_is_shown():
    """Not "<coroutine object ...>": the call is awaited in the episode's worker."""
    calls = EnvCalls("tools", [ENV + "async_echo"], timeout_s=5.0, vocab_size=100, workers=1)
    turn = _turn('<tool_call>{"name": "async_echo", "arguments": {"text": "hi"}}</tool_call>')

    async def go():
        return [await calls.step(await calls.start(ROW), turn) for _ in range(2)]

    try:
        steps = asyncio.run(go())
    finally:
        calls.close()
    assert [s.observation for s in steps] == [[{"role": "tool", "content": "echo hi"}]] * 2


MY_TOOLS = """
from megatron_gspo.rollout.tools import tool


def mul(a: int, b: int) -> int:
    \"\"\"Multiply two integers.\"\"\"
    return a * b


@tool(name="neg", description="Negate an integer")
def negate(x: int) -> int:
    return -x
"""


def test_a_tool_given_as_a_py_file_is_run_in_the_episode_s_worker(tmp_path, monkeypatch):
    """env.tools=[calc, my_tools.py:mul] (my_tools.py in the current directory, not on the
    path) loads as env.fn=my_envs.py:Guess does: the file is imported in the worker, once for
    its two tools, and the model's calls of them are answered there; "my_tools:mul" names the
    fix."""
    (tmp_path / "my_tools.py").write_text(MY_TOOLS)
    monkeypatch.chdir(tmp_path)
    specs = ["calc", "my_tools.py:mul", "my_tools.py:negate"]
    calls = EnvCalls("tools", specs, timeout_s=5.0, vocab_size=100, workers=1)
    turn = _turn(
        '<tool_call>{"name": "mul", "arguments": {"a": 37, "b": 48}}</tool_call>'
        '<tool_call>{"name": "neg", "arguments": {"x": 5}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": {"expr": "2**10"}}</tool_call>'
    )

    async def go():
        episode = await calls.start(ROW)
        return episode, await calls.step(episode, turn)

    try:
        episode, step = asyncio.run(go())
    finally:
        calls.close()
    assert [t["function"]["name"] for t in episode.tools] == ["calc", "mul", "neg"]
    assert episode.tools[1]["function"]["parameters"]["required"] == ["a", "b"]
    assert step.observation == [
        {"role": "tool", "content": str(37 * 48)},
        {"role": "tool", "content": "-5"},
        {"role": "tool", "content": str(2**10)},
    ]
    with pytest.raises(UserError) as e:
        EnvCalls("tools", ["my_tools:mul"], timeout_s=5.0, vocab_size=100, workers=1)
    assert str(e.value).startswith(
        "tool 'my_tools:mul': cannot import 'my_tools' (No module named 'my_tools'); put its "
        "package on PYTHONPATH or give the path of a .py file"
    )


class _Tok:
    """Decodes ids as letters (id 0 is the end-of-turn token, skipped as special)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids if i or not skip_special_tokens)


class _SizedTok(_Tok):
    def __len__(self):
        return 128


def test_an_environment_slower_to_load_than_env_start_timeout_s_names_the_key_to_raise(tmp_path):
    path = tmp_path / "slow_env.py"
    path.write_text("import time\ntime.sleep(60)\nclass Env:\n    pass\n")
    cfg = load_config(None, ["model.path=m", f"env.fn={path}:Env", "env.workers=1",
                             "env.start_timeout_s=1"])  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        Generation(cfg, _SizedTok(), run_dir=None)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 30
    assert str(e.value) == (
        f"environment '{path}:Env' could not be loaded: a worker did not start within "
        "env.start_timeout_s (1 s); raise it if the code takes longer to load; its module must "
        "import without exiting, hanging or ending its process"
    )


def _sample(tokens, mask=None, **kw) -> Sample:
    return Sample(0, 0, [1, 2], list(tokens), loss_mask=mask, turns=1 if mask else 0,
                  finish_reason="stop", **kw)  # fmt: skip


def test_an_episode_is_scored_by_its_environment_else_reward_fn_on_its_last_turn():
    gen = Generation(Config(), _Tok(), run_dir=None)  # type: ignore[arg-type]
    rows = [PromptRow("p", "cd")]
    samples = [
        _sample([1, 1, 9, 9, 3, 4, 0], [1, 1, 0, 0, 1, 1, 1]),  # last turn "cd": right
        _sample([3, 4, 9, 1, 1], [1, 1, 0, 1, 1]),  # last turn "aa": wrong
        _sample([1], [1], env_reward=0.25),
        _sample([1], [1], env_reward=0.25, env_error="step() raised"),  # failed: 0
        _sample([], None, env_error="starting the episode raised"),  # no tokens: failed
        _sample([3, 4]),  # a single-turn sample: all of it
    ]
    assert [gen.text(s) for s in samples] == ["cd", "aa", "a", "a", "", "cd"]
    scored = gen.score(rows, samples)
    assert scored.rewards == [1.0, 0.0, 0.25, 0.0, None, 1.0]
    assert scored.failed == [4]
    assert "starting the episode raised" in scored.failures[0]


class _EnvTok(_SizedTok):
    eos_token = None


def test_a_step_on_which_every_sample_failed_at_any_stage_ends_the_run_naming_the_logs(tmp_path):
    """An episode whose step() failed, after a model turn, is trained on at reward 0, its group
    kept; but a step on which every episode failed so trained on rewards all 0 and the run went
    on, where a reward failing on every sample ends it. Every sample failed, whatever the stage
    (step(), the episode's start, its reward): an error naming the logs with the tracebacks."""
    cfg = load_config(None, ["model.path=m", f"env.fn={ENV}Echo", "env.workers=1",
                             "reward.fn=tests.unit.user_code:reward", "reward.workers=1"])  # fmt: skip
    gen = Generation(cfg, _EnvTok(), tmp_path)  # type: ignore[arg-type]
    rows = [PromptRow("p", "cd"), PromptRow("raise", "cd")]
    after = _sample([1], [1], env_error="step() raised ValueError: bad turn")
    before = _sample([], None, env_error="starting the episode raised RuntimeError: no")
    reward_raised = _sample([3, 4], [1, 1])
    reward_raised.prompt_index = 1
    try:
        partly = gen.score(rows, [after, _sample([3, 4], [1, 1])])
        every = gen.score(rows, [after, before, reward_raised])
    finally:
        gen.close()
    assert partly.rewards == [0.0, 1.0] and reward_failures(partly, 3) == []
    assert every.rewards == [0.0, None, None]
    with pytest.raises(UserError) as e:
        reward_failures(every, 3)
    logs = tmp_path / "logs"
    assert str(e.value) == (
        f"environment '{ENV}Echo' failed: step() raised ValueError: bad turn (all 3 samples of "
        f"step 3 failed; {logs / 'env.log'} and {logs / 'reward.log'} have each, with its "
        "traceback)"
    )


def test_an_episode_becomes_a_row_with_the_environment_masked_out():
    s = _sample([5, 6, 7, 8, 9], [1, 1, 0, 0, 1], logprobs=[-0.1, -0.2, None, None, -0.3])
    batch = to_batch([s, _sample([5, 6], logprobs=[-1.0, -2.0])], [1.0, -1.0])
    assert batch.row_values("tokens") == [[1, 2, 5, 6, 7, 8, 9], [1, 2, 5, 6]]
    assert batch.row_values("loss_mask") == [[0, 0, 1, 1, 0, 0, 1], [0, 0, 1, 1]]
    want = [[None, None, -0.1, -0.2, None, None, -0.3], [None, None, -1.0, -2.0]]
    got = batch.row_values("rollout_logprobs")  # (float32)
    assert [[v is None for v in r] for r in got] == [[v is None for v in r] for r in want]
    assert [v for r in got for v in r if v is not None] == pytest.approx(
        [v for r in want for v in r if v is not None]
    )


@pytest.mark.parametrize("kind", ["gspo", "gspo_token", "grpo"])
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_loss_counts_model_tokens_only(kind, agg):
    """A multi-turn row (model, environment, model tokens) against the same formula over the
    model tokens alone: the environment's tokens add nothing, to the GSPO length normalization
    |y_i| included."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1], [0, 1, 1, 0, 1, 0, 0, 0]], dtype=torch.bool)
    logp = (torch.randn(2, 8) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(2, 8) * 0.2
    adv = torch.tensor([1.0, -0.5])
    eps_lo, eps_hi = 0.2, 0.27
    loss, _ = policy_loss(logp, old, adv, mask, kind=kind, clip_low=eps_lo, clip_high=eps_hi,
                          agg=agg)  # fmt: skip
    terms, counts = [], []
    for i in range(2):
        lp, o = logp[i][mask[i]], old[i][mask[i]]  # the model's tokens only
        n = len(lp)
        if kind == "grpo":
            ratio = torch.exp(lp - o)
        else:
            s_i = torch.exp((lp - o).sum() / n)  # |y_i| = n: model tokens
            ratio = s_i.expand(n) if kind == "gspo" else s_i.detach() * torch.exp(lp - lp.detach())
        obj = torch.minimum(ratio * adv[i], ratio.clamp(1 - eps_lo, 1 + eps_hi) * adv[i])
        terms.append(obj)
        counts.append(n)
    if agg == "seq-mean-token-mean":
        want = -sum(t.sum() / n for t, n in zip(terms, counts)) / 2
    elif agg == "token-mean":
        want = -sum(t.sum() for t in terms) / sum(counts)
    else:
        want = -sum(t.sum() for t in terms) / 2
    torch.testing.assert_close(loss, want)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[~mask].abs().max() == 0  # no gradient through the environment's tokens


def test_documented_example_environment_plays_its_game(tmp_path):
    """The example in docs/training.md, as written there: higher/lower hints, reward 1 when found."""
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    code = readme.split("```python\n")[1].split("```")[0]
    assert len(code.splitlines()) <= 24
    path = tmp_path / "guess.py"
    path.write_text(code)
    calls = EnvCalls(f"{path}:Guess", timeout_s=5.0, vocab_size=100, workers=1)

    async def play(guesses):
        episode = await calls.start(PromptRow("?", "42"))
        prompt = await calls.prompt(episode)
        steps = [await calls.step(episode, _turn(g, i)) for i, g in enumerate(guesses)]
        return prompt, steps

    try:
        prompt, steps = asyncio.run(play(["50", "hm", "7", "42<|im_end|>"]))
    finally:
        calls.close()
    assert prompt == [{"role": "user", "content": "guess my number between 0 and 99"}]
    hints = [s.observation[0]["content"] for s in steps[:3]]
    assert hints == ["lower", "say a number", "higher"]
    assert steps[3] == Step(done=True, reward=1.0)


def _tool_turn(kind: str) -> Turn:
    call = json.dumps({"name": "act", "arguments": {"kind": kind}})
    return _turn(f"<tool_call>\n{call}\n</tool_call>")


@pytest.mark.parametrize(
    "kind, message",
    [
        ("hang", "step() ran past env.timeout_s (0.5 s)"),
        ("spin", "step() ran past env.timeout_s (0.5 s)"),
        ("exit", "step() raised SystemExit: 3"),
        ("interrupt", "step() raised KeyboardInterrupt"),
        ("die", "the worker process died during step() (exited with code 7)"),
    ],
)
def test_a_tool_that_hangs_spins_or_exits_ends_its_episode_and_the_next_ones_run(kind, message):
    """`env.fn: tools` with a tool that misbehaves: its episode ends within the limit (plus a
    worker's start), and more such calls than there are workers starve nothing after them."""
    calls = EnvCalls("tools", ["calc", "tests.unit.user_code:act"], timeout_s=0.5,
                     vocab_size=100, workers=1)  # fmt: skip

    async def go():
        for _ in range(3):  # (a thread pool of 1 would be used up by the first)
            t0 = time.perf_counter()
            with pytest.raises(EnvError) as e:
                await calls.step(await calls.start(ROW), _tool_turn(kind))
            assert message in str(e.value)
            assert time.perf_counter() - t0 < 15  # at the limit (plus a start), not in an hour
        episode = await calls.start(ROW)
        return await calls.step(episode, _tool_turn("fine"))

    try:
        step = asyncio.run(go())
    finally:
        calls.close()
    assert step.observation == [{"role": "tool", "content": "done"}]


def test_a_call_that_hangs_ends_the_episodes_of_its_worker_only_and_the_others_keep_state():
    calls = EnvCalls(ENV + "Misbehaves", timeout_s=0.5, vocab_size=100, workers=2)

    async def go():
        answers = ["hang", "ok", "ok", "ok"]  # placed in turn: workers 0, 1, 0, 1
        episodes = [await calls.start(PromptRow("p", a)) for a in answers]
        assert [e.worker for e in episodes] == [0, 1, 0, 1]
        first = await asyncio.gather(*(calls.step(e, _turn("ab")) for e in episodes[1:]))
        got = await asyncio.gather(*(calls.step(e, _turn("cd")) for e in episodes),
                                   return_exceptions=True)  # fmt: skip
        return first, got

    try:
        first, (hung, kept1, lost, kept3) = asyncio.run(go())
    finally:
        calls.close()
    assert [s.done for s in first] == [False] * 3
    assert "step() ran past env.timeout_s (0.5 s)" in str(hung)
    assert "the episode's worker was replaced before step()" in str(lost)
    assert [kept1, kept3] == [Step("dc", done=True, reward=0.5)] * 2  # 2nd turn: state kept


def test_a_worker_that_cannot_start_again_gets_no_new_episode_while_another_can(
    tmp_path, monkeypatch
):
    """New episodes go to the worker holding the fewest: after a worker died, that is the dead
    one, and while it waits out its failed start's backoff every episode sent there would fail
    at once. They go to the other worker instead."""
    loads = tmp_path / "loads"
    monkeypatch.setenv("USER_CODE_LOADS", f"{loads}:3+")  # (user_code.py: 3rd load on raises)
    calls = EnvCalls(ENV + "Misbehaves", timeout_s=5.0, vocab_size=100, workers=2)
    assert calls.pool.wait_ready(timeout_s=60) and len(loads.read_text().splitlines()) == 2

    async def go():
        dead = await calls.start(PromptRow("p", "die"))
        with pytest.raises(EnvError, match="the worker process died during step"):
            await calls.step(dead, _turn("ab"))
        calls.end(dead)
        with pytest.raises(EnvError, match="could not load the code: .*load 3: data.bin is"):
            await calls.start(PromptRow("p", "ok"))  # (worker 0's restart)
        episodes = [await calls.start(PromptRow("p", "ok")) for _ in range(3)]
        return episodes, [await calls.step(e, _turn("ab")) for e in episodes]

    try:
        episodes, steps = asyncio.run(go())
    finally:
        calls.close()
    assert [e.worker for e in episodes] == [1, 1, 1]
    assert steps == [Step("ba", done=False, reward=None)] * 3


HUNG_TOOL_RUN = """
import asyncio
from megatron_gspo.data.prompts import PromptRow
from megatron_gspo.rollout.env import EnvCalls, EnvError, Turn

calls = EnvCalls("tools", ["tests.unit.user_code:act"], timeout_s=0.5, vocab_size=100,
                 workers=2)
turn = Turn('<tool_call>{"name": "act", "arguments": {"kind": "hang"}}</tool_call>', [1], "stop", 0)

async def go():
    for _ in range(4):
        try:
            await calls.step(await calls.start(PromptRow("p", "a")), turn)
        except EnvError as e:
            print(e, flush=True)

asyncio.run(go())
calls.close()
print("closed", flush=True)
"""


def test_the_process_exits_after_its_environment_hung(tmp_path):
    """The end of a run whose tool hung: nothing left behind keeps the process alive."""
    script = tmp_path / "run.py"
    script.write_text(HUNG_TOOL_RUN)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=root, env=dict(os.environ, PYTHONPATH=str(root)))  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("ran past env.timeout_s (0.5 s)") == 4 and "closed" in out.stdout
