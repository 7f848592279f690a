"""A user's code, as the tests' worker processes import it (`tests.unit.user_code:NAME`): rewards,
environments and tools that behave, and ones that fail in every way user code can. Kept free of
heavy imports: each worker imports it once when it starts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

from megatron_gspo.rollout.env import Step
from megatron_gspo.rollout.tools import tool

CALLS = os.environ.get("USER_CODE_CALLS")  # a file each call appends a JSON line to, if set


def _load() -> None:
    """USER_CODE_LOADS="PATH:N" (or "PATH:N+"): each import of this module (one per worker) adds
    a line to the file PATH, and the N-th (N-th and later) raises: code that fails to load in a
    restarted worker, for a moment (a file briefly missing) or for good."""
    how = os.environ.get("USER_CODE_LOADS")
    if not how:
        return
    import fcntl

    path, _, fails = how.rpartition(":")
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # (workers start side by side)
        f.seek(0)
        n = len(f.read().splitlines()) + 1
        f.write(f"{os.getpid()}\n")
    first = int(fails.rstrip("+"))
    if n == first or (fails.endswith("+") and n > first):
        raise FileNotFoundError(f"load {n}: data.bin is missing")


_load()


def _record(**what) -> None:
    if CALLS:
        with open(CALLS, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **what}) + "\n")


def misbehave(kind: str) -> None:
    """Do what `kind` says: hang, spin, exit, and so on (nothing for any other word)."""
    if kind == "hang":
        time.sleep(3600)
    elif kind == "spin":
        while True:
            pass
    elif kind == "exit":
        sys.exit(3)
    elif kind == "interrupt":
        raise KeyboardInterrupt
    elif kind == "die":
        os._exit(7)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "raise":
        raise RuntimeError("broken")


# ---- rewards: fn(prompt, response, answer) --------------------------------------------------


def reward(prompt: str, response: str, answer: str) -> float:
    """The prompt names what to do ("hang", "exit", ...); else 1.0 when response == answer."""
    misbehave(prompt)
    return 1.0 if response == answer else 0.0


def slow_reward(prompt: str, response: str, answer: str) -> float:
    """Sleeps 0.3 s, recording when it started and ended (USER_CODE_CALLS)."""
    t0 = time.time()
    time.sleep(0.3)
    _record(prompt=prompt, start=t0, end=time.time())
    return float(len(response))


async def async_reward(prompt: str, response: str, answer: str) -> float:
    """A remote judge's shape: awaits, then scores."""
    await asyncio.sleep(0)
    return 1.0 if response == answer else 0.0


def junk_reward(prompt: str, response: str, answer: str):
    return {"nan": float("nan"), "str": "1.0", "none": None, "big": 10**400}.get(prompt, 0.5)


# ---- environments: fn(row) -> an episode ------------------------------------------------------


class Echo:
    """Answers each turn with its text reversed; done after two turns, reward 0.5."""

    def __init__(self, row):
        self.row, self.turns = row, 0

    def step(self, turn):
        self.turns += 1
        return Step(turn.text[::-1], done=self.turns == 2, reward=0.5 if self.turns == 2 else None)


class AsyncEcho(Echo):
    async def step(self, turn):
        await asyncio.sleep(0)
        return super().step(turn)


def echo(row):
    return Echo(row)


def raises(row):
    raise RuntimeError("broken env")


class Misbehaves(Echo):
    """step() does what the row's answer says (misbehave)."""

    def step(self, turn):
        misbehave(self.row.answer)
        return super().step(turn)


class AsyncHangs(Echo):
    async def step(self, turn):
        await asyncio.sleep(3600)


class Returns(Echo):
    """step() returns the row's extra["value"]; prompt() too, when extra["prompt"] is set."""

    def prompt(self):
        return self.row.extra.get("prompt")

    def step(self, turn):
        return self.row.extra["value"]


class NoStep:
    def __init__(self, row):
        pass


class Counts:
    """Counts its own turns: an episode keeps its state between calls (in its worker)."""

    def __init__(self, row):
        self.n = 0

    def step(self, turn):
        self.n += 1
        return Step(f"{self.n} in {os.getpid()}")


# ---- tools -------------------------------------------------------------------------------------


@tool
def act(kind: str) -> str:
    """Do what `kind` says (misbehave), then answer "done"."""
    misbehave(kind)
    return "done"


@tool
async def async_echo(text: str) -> str:
    """Echo the text, after awaiting (a remote service's shape)."""
    await asyncio.sleep(0)
    return f"echo {text}"


# ---- a pool's handler (bounded/worker.py: loader(spec) -> handler) ---------------------------


def handler(spec):
    """handler(kind) misbehaves as `kind` says, else answers {"pid": ..., "spec": spec};
    "object" returns something that is not plain data, "unprintable" raises an exception whose
    message cannot be read, "long" returns 2000 characters, "oom_score_adj" its process's,
    "orphan" leaves a shell's background process behind and exits, "child" starts a `sleep` in the
    background first (its pid in the file named by USER_CODE_CALLS) and then hangs. Spec
    "broken" fails to load, "slow" takes a minute to, "slow:PATH" takes a minute where the file
    PATH exists."""
    if spec == "broken":
        raise ImportError("no module named 'nothing_here'")
    if spec == "slow":  # (code that takes a minute to load: a judge model, say)
        time.sleep(60)
    if spec.startswith("slow:") and os.path.exists(spec[5:]):
        time.sleep(60)

    def call(kind: str, seconds: float = 0.0):
        if kind == "object":
            return object()
        if kind == "unprintable":
            raise Unprintable
        if kind == "long":
            return "x" * 2000
        if kind == "oom_score_adj":
            with open(f"/proc/{os.getpid()}/oom_score_adj") as f:
                return f.read().strip()
        if kind == "orphan":  # a background process of a shell, then the worker's end
            os.system("sleep 30 &")
            os._exit(7)
        if kind == "child":
            import subprocess

            child = subprocess.Popen(["sleep", "3600"])
            _record(child=child.pid)
            kind = "hang"
        time.sleep(seconds)
        misbehave(kind)
        return {"pid": os.getpid(), "spec": spec}

    return call


class Unprintable(Exception):
    """An exception whose message cannot be read: str() raises."""

    def __str__(self):
        raise RuntimeError("no message")
