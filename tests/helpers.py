"""Helpers the tests import (fixtures stay in conftest.py): running the CLI and workers under
torchrun, independent references (an HF forward), holding a request on a server and holding a
training run at a step (to kill it there)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from megatron_gspo.train import checkpointing

# Overrides that make a tiny config's training run quick (a few seconds a step) in tests.
QUICK_TRAIN = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "train.micro_batch_size=4",
    "train.eval_prompts=8",
    "train.eval_every=2",
    "logging.tensorboard=false",
    "logging.console=false",
]


# what megatron-core writes as a dist-checkpoint's model/metadata.json
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}  # fmt: skip


def saved_checkpoint(run: Path, step: int) -> Path:
    """A checkpoint of `run` after `step` as `checkpointing.save` leaves it, as far as the files
    go (a resume's checks read them; no model is loaded)."""
    d = run / "checkpoints" / f"step_{step}"
    (d / "model").mkdir(parents=True)
    state = {"step": step, "weight_version": step, "sampler": {"epoch": 0}}
    (d / "trainer_state.json").write_text(json.dumps(state))
    (d / "model" / "shard.distcp").write_bytes(bytes(range(256)) * 16)
    (d / "model" / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
    checkpointing.write_manifest(d)
    return d


def cli_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def run_cli(args: list[str], nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `megatron-gspo ARGS`, under torchrun with `nproc` processes when nproc > 1."""
    target = ["-m", "megatron_gspo.cli", *args]
    cmd = [sys.executable, *target] if nproc == 1 else torchrun(nproc, *target)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cli_env())


# sitecustomize.py of `stopped_mid_write`'s command: renaming its temporary output onto the
# output waits (an injected delay), so the test's signal finds the temporary output there however
# fast it was written; SIGINT raises KeyboardInterrupt as at a terminal (a shell without job
# control starts a background command with SIGINT ignored, and Python then leaves it so).
_HOLD_RENAME = """
import os
import signal
import time

_OUT, _replace = os.environ["MEGATRON_GSPO_TEST_HOLD"], os.replace
signal.signal(signal.SIGINT, signal.default_int_handler)


def _held_replace(src, dst, *args, **kwargs):
    if os.path.abspath(dst) == _OUT:
        time.sleep(600)
    return _replace(src, dst, *args, **kwargs)


os.replace = _held_replace
"""


def stopped_mid_write(args: list[str], out: Path, sig: int) -> tuple[int, str]:
    """Run `megatron-gspo ARGS`, which writes `out`, and send it `sig` as soon as its temporary
    output (.OUT.tmp-*) appears beside `out`: (its exit status, its stderr)."""
    with tempfile.TemporaryDirectory() as hook:
        (Path(hook) / "sitecustomize.py").write_text(_HOLD_RENAME)
        env = cli_env()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [hook, env.get("PYTHONPATH")]))
        env["MEGATRON_GSPO_TEST_HOLD"] = str(out.absolute())
        cmd = [sys.executable, "-m", "megatron_gspo", *args]
        err = Path(hook) / "stderr"  # (a file: a pipe nobody reads until the end could fill)
        with open(err, "w") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=f)
        try:
            deadline = time.monotonic() + 240
            while not list(out.parent.glob(f".{out.name}.tmp-*")):
                assert proc.poll() is None, f"ended first: {err.read_text()[-2000:]}"
                assert time.monotonic() < deadline, "no temporary output in 240 s"
                time.sleep(0.01)
            proc.send_signal(sig)
            proc.wait(timeout=120)
        finally:
            proc.kill()
        return proc.returncode, err.read_text()


# The command's process: SIGINT as at a terminal (a background job of a shell without job
# control would have it ignored), then HOOK, then `megatron-gspo ARGS` (or `python -m MODULE`).
PRELUDE = """
import os, runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
{hook}
{command}
"""
CLI = "from megatron_gspo.cli import main\nmain(sys.argv[1:])"

# `run_hooked`'s hook: the first torch.save to a stream (DCP's writer saves each item so) gets a
# SIGINT on its second write, so the KeyboardInterrupt is raised inside torch's C++ zip writer
# (which calls that write), as a Ctrl-C during a checkpoint's write is; torch then raises
# "RuntimeError: ... unexpected pos" (on a first write it lets the KeyboardInterrupt out).
CTRL_C_IN_WRITER = """
import torch
_save = torch.save

class _Stream:
    writes = 0
    def __init__(self, f):
        self.f = f
    def __getattr__(self, name):
        return getattr(self.f, name)
    def write(self, b):
        _Stream.writes += 1
        if _Stream.writes == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return self.f.write(b)

def _saving(obj, f, *args, **kwargs):
    return _save(obj, f if isinstance(f, (str, os.PathLike)) else _Stream(f), *args, **kwargs)

torch.save = _saving
"""


def run_hooked(
    hook: str, args: list[str], timeout: int = 120, module: str | None = None
) -> tuple[int | None, str]:
    """`megatron-gspo ARGS` (`python -m MODULE ARGS` with `module`) with `hook` run first in its
    process: (exit status, stderr); None when it was still running after `timeout` seconds
    (then killed)."""
    command = CLI if module is None else f"runpy.run_module({module!r}, run_name='__main__')"
    cmd = [sys.executable, "-c", PRELUDE.format(hook=hook, command=command), *args]
    proc = subprocess.Popen(cmd, env=cli_env(), cwd=Path(__file__).resolve().parents[1], text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None, proc.communicate()[1]
    return proc.returncode, err


def hf_token_logprobs(checkpoint: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Independent reference: log p(token_t | prefix) from a transformers forward, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            logp = model(torch.tensor([s])).logits[0].float().log_softmax(-1)
            out.append(logp[:-1].gather(-1, torch.tensor(s[1:]).unsqueeze(-1)).squeeze(-1))
    return out


def random_sequences(vocab: int, lengths=(5, 17, 9, 12, 3), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def write_jsonl(path: Path, seqs) -> Path:
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    return path


def read_logprobs(path: Path) -> list[list[float | None]]:
    return [json.loads(line)["logprobs"] for line in path.read_text().splitlines()]


def serving(handler_do: Callable) -> tuple[str, object]:
    """A local HTTP server whose GET and POST run `handler_do(handler)`, in a thread; (its URL,
    the server: `.shutdown()` it)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            handler_do(self)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def authorization_recorder() -> tuple[str, list, object]:
    """A local HTTP server that answers 200 `{}` and records each request's Authorization
    header: (its URL, what it saw, the server)."""
    seen: list[str | None] = []

    def record(h) -> None:
        seen.append(h.headers.get("Authorization"))
        h.send_response(200)
        h.send_header("Content-Length", "2")
        h.end_headers()
        h.wfile.write(b"{}")

    url, server = serving(record)
    return url, seen, server


def redirector(to: str, code: int = 307) -> tuple[str, list, object]:
    """A local HTTP server that answers every request with `code`, pointing at `to` plus its
    path: (its URL, the paths it was asked, the server)."""
    asked: list[str] = []

    def redirect(h) -> None:
        h.rfile.read(int(h.headers.get("Content-Length") or 0))
        asked.append(h.path)
        h.send_response(code)
        h.send_header("Location", to + h.path)
        h.send_header("Content-Length", "0")
        h.end_headers()

    url, server = serving(redirect)
    return url, asked, server


def torchrun_sh(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """`launch/torchrun.sh ARGS` with this python (PYTHON) and `env` added to the environment."""
    full = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(Path(__file__).resolve().parents[1] / "launch/torchrun.sh"), *args],
        capture_output=True, text=True, env=full, timeout=120, cwd=cwd,
    )  # fmt: skip


def servers_killed_python(directory: Path) -> Path:
    """A PYTHON for torchrun.sh: the real python, but launch/serve_node.py is killed at once
    (as the kernel's OOM killer would), so the launch stops before torchrun starts."""
    python = directory / "python"
    python.write_text(
        '#!/bin/bash\ncase "$1" in */serve_node.py) echo Killed; exit 137 ;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    return python


def torchrun(nproc: int, *target: str) -> list[str]:
    """The command running `target` (a script and its arguments, or "-m", module, ...) under
    torchrun with `nproc` ranks on this machine."""
    # --standalone: torchrun's agent binds a free port itself and holds it (a port picked
    # here could be taken by a parallel test before the ranks bind it)
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", *target,
    ]  # fmt: skip


def run_distributed(
    worker: Path, nproc: int, *args: str, out: Path | None, log: Path | None = None,
    timeout: int = 400, expect_rc: int = 0,
) -> dict | None:  # fmt: skip
    """Run the worker script under torchrun with `nproc` ranks; returns the JSON it wrote to
    `out` (None when it wrote none, or `out` is None: workers that write results of their own).
    Its output goes to `log` when given: a file, not a pipe, for workers whose children
    (torch's shared-memory manager) may outlive them."""
    cmd = torchrun(nproc, str(worker), *args)
    if log is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cli_env())
        tail = proc.stderr[-4000:]
    else:
        with open(log, "w") as f:
            proc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=cli_env()
            )
        tail = log.read_text()[-4000:]
    assert proc.returncode == expect_rc, tail
    return json.loads(out.read_text()) if out is not None and out.exists() else None


async def running_requests(client, url: str) -> int:
    return (await client.get(url, "/server_info"))["internal_states"][0]["num_running_reqs"]


async def hold_running(
    client, url: str, start: Callable[[], Awaitable], n: int = 1, attempts: int = 20
) -> asyncio.Task:
    """`start()`'s requests, running on the server at `url` and held there by an in-place pause:
    a state that stays until the caller resumes, aborts or updates (the task it returns ends
    then). A request of the tiny model can end between two looks (the built-in server's C
    kernel writes thousands of tokens a second), so it is started again, at most `attempts`
    times, until `n` requests are seen running and are still running once the pause is in."""
    for _ in range(attempts):
        task = asyncio.create_task(start())
        while not task.done():
            if await running_requests(client, url) >= n:
                await client.pause("in_place")
                await asyncio.sleep(0.05)  # the engine reads the pause before its next step
                if not task.done() and await running_requests(client, url) >= n:
                    return task
                await client.resume()
                break
            await asyncio.sleep(0.002)
        await task
    raise AssertionError(f"{n} request(s) were never seen running in {attempts} tries")


_GATE = """
import time
from pathlib import Path

from megatron_gspo.rewards.exact import exact_answer

RUN, HOLD, AFTER = Path({run!r}), Path({hold!r}), {after}


def reward(prompt, response, answer):
    metrics = RUN / "metrics.jsonl"
    while (HOLD.exists() and (RUN / "checkpoints" / f"step_{{AFTER}}" / "trainer_state.json").is_file()
           and metrics.is_file() and len(metrics.read_text().splitlines()) > AFTER):
        (HOLD.parent / "held").touch()
        time.sleep(0.1)
    return exact_answer(prompt, response, answer)
"""


class StepGate:
    """A reward plugin ("exact", the same rewards) that holds the training run in `run` inside
    step AFTER + 1, once step AFTER's checkpoint and metrics are written, for as long as the gate
    is closed: a deterministic point to kill a run at, whatever the machine's speed (a tiny
    step can end between two looks at the checkpoint directory)."""

    def __init__(self, tmp: Path, run: Path, after: int):
        tmp.mkdir(parents=True, exist_ok=True)
        self.hold, self.held, path = tmp / "hold", tmp / "held", tmp / "gate.py"
        path.write_text(_GATE.format(run=str(run), hold=str(self.hold), after=after))
        self.override = f"reward.fn={path}:reward"
        self.hold.touch()

    @property
    def holding(self) -> bool:
        return self.held.is_file()

    def open(self) -> None:
        self.hold.unlink(missing_ok=True)


# The source of `_number(directory)` for the user code (reward plugins, environments) a test
# writes: the k-th call, in any worker process, gets k (it creates directory/k exclusively).
NUMBER_FN = """
def _number(directory):
    k = 0
    while True:
        try:
            os.close(os.open(directory / str(k), os.O_CREAT | os.O_EXCL))
            return k
        except FileExistsError:
            k += 1
"""
