"""Start the built-in rollout server as a real subprocess on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys


@contextlib.contextmanager
def running_server(model, *flags: str, env: dict | None = None, stderr=None):
    """Yield the server's URL ("http://127.0.0.1:PORT"); terminate it on exit. `stderr`: where
    its log goes (a file object; default this process's stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "megatron_gspo.server", "--model", str(model)]
    cmd += ["--port", "0", "--threads", "1", *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        line = proc.stdout.readline()  # "serving DIR on http://127.0.0.1:PORT"
        assert " on http://127.0.0.1:" in line, f"server did not start: {line!r}"
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
