"""`megatron-gspo serve` started wrongly: a one-line error naming the fix and exit status 2,
never a Python traceback (a flag out of range, a host that does not resolve, a port in use, a
decode kernel that cannot serve the model). Real processes, real sockets."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from tests.helpers import run_cli

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(TinySpec(layers=1), tmp_path_factory.mktemp("serve") / "m")


def assert_one_line_error(proc, words: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and words in lines[0], proc.stderr[-2000:]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--port", "-1"], "--port must be in [0, 65535], got -1"),
        (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
        (["--threads", "-3"], "--threads must be in [0, 4096], got -3"),
        (["--random-seed", "99999999999999999999999"], "--random-seed must be in [0, "),
        (["--log-level", "loud"], "--log-level 'loud' is not a level"),
        (["--host", "not.a.host.example", "--api-key", "k"],
         "--host 'not.a.host.example' is not an address of this machine"),
        (["--decode-kernel", "c", "--dtype", "bfloat16"],
         "unavailable (dtype torch.bfloat16); pass --decode-kernel auto or torch"),
    ],
)  # fmt: skip
def test_bad_serve_flags_are_one_line_errors(model, flags, words):
    proc = run_cli(["serve", "--model", str(model), "--port", "0", *flags], timeout=120)
    assert_one_line_error(proc, words)


def test_a_port_in_use_is_a_one_line_error(model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli(["serve", "--model", str(model), "--port", str(port)], timeout=120)
    assert_one_line_error(proc, f"cannot listen on 127.0.0.1:{port}: ")
    assert "--port 0 picks a free one" in proc.stderr
