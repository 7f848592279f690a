"""A worker process of a bounded pool (pool.py): `python -m megatron_gspo.bounded.worker REQ RESP PARENT`.

It reads frames from fd REQ and answers on fd RESP (wire.py), so the user's code keeps stdin,
stdout and stderr to itself. The first frame names a loader ("module:function") and its spec;
the worker imports the loader, calls it once (`loader(spec)` returns the handler: this imports
the user's code once per worker) and answers {"ready": true}, or {"failed": why}. Then, for each
request (a pickled tuple of arguments, from the trainer only), it calls handler(*args) and
answers, as JSON (never a pickle: the trainer reads no object of the user's making):

    {"value": v}                    the handler's result (plain data: numbers, text, lists, dicts)
    {"refused": why}                the handler said the result is wrong (`Refused`), or v is not
                                    plain data, or its answer is longer than the pool's limit
    {"raised": "Type: message", "traceback": text}   anything raised, BaseException included
                                    (SystemExit, KeyboardInterrupt raised by the user's code; an
                                    exception whose str() fails too, by its type)

Whatever the user's code raises or returns, the worker answers and lives on: only a call's time
limit, or the user's code ending the process, takes it down (and with it the state it holds).

The worker dies with the trainer: Linux's parent-death signal, and a check that the parent is
still the one that started it.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import signal
import sys
import traceback

from megatron_gspo.bounded.outcome import Refused, one_line
from megatron_gspo.bounded.wire import read_frame, write_frame

MAX_TRACEBACK = 8000  # characters of a traceback sent back (its end: where it was raised)


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the thread that started this process ends (Linux), and an exit now if the
    parent is already gone (it may have died before the signal was armed)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _contain(req: int, resp: int) -> None:
    """What the user's code starts does not inherit the pipes (a background process holding
    the answer pipe hid this worker's death until the time limit), and this process is the
    kernel's first choice when memory runs out (the user's code rather than the trainer)."""
    for fd in (req, resp):
        os.set_inheritable(fd, False)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def _resolve(name: str):
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _message(e: BaseException) -> str:
    """str(e), read without trusting it: "" where its str() raises as well."""
    try:
        return str(e)
    except BaseException:
        return ""


def _raised(e: BaseException) -> bytes:
    """The answer for an exception: "Type: message", or its type alone."""
    message = _message(e)
    try:
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    except BaseException:
        text = ""
    raised = one_line(f"{type(e).__name__}: {message}" if message else type(e).__name__)
    return json.dumps({"raised": raised, "traceback": text[-MAX_TRACEBACK:]}).encode()


def _refused(why: str) -> bytes:
    return json.dumps({"refused": one_line(why)}).encode()


def _answer(handler, args: tuple, limit: int) -> bytes:
    try:
        value = handler(*args)
    except Refused as e:
        return _refused(str(e))
    except BaseException as e:  # the user's SystemExit and KeyboardInterrupt included
        return _raised(e)
    try:
        data = json.dumps({"value": value}).encode()
    except (TypeError, ValueError, RecursionError) as e:
        return _refused(f"returned {type(value).__name__}, not plain data ({e})")
    if len(data) > limit:  # (the trainer would refuse the frame, and could not say why)
        return _refused(f"returned {len(data)} bytes of {type(value).__name__}, over the limit "
                        f"of {limit}; return less")  # fmt: skip
    return data


def serve(req: int, resp: int) -> int:
    """The worker's life: load, answer ready, then answer each request until the trainer closes
    its end of the pipe."""
    init = pickle.loads(read_frame(req) or b"")
    sys.path[:] = init["sys_path"]  # the trainer's: its plugins import the same way here
    try:
        handler = _resolve(init["loader"])(init["spec"])
    except BaseException as e:
        write_frame(
            resp, json.dumps({"failed": one_line(_message(e) or type(e).__name__)}).encode()
        )
        return 1
    write_frame(resp, b'{"ready": true}')
    while True:
        frame = read_frame(req)
        if frame is None:
            return 0
        write_frame(resp, _answer(handler, pickle.loads(frame), init["max_answer"]))


def main(argv: list[str]) -> int:
    req, resp, parent = (int(a) for a in argv[1:4])
    _die_with_parent(parent)
    _contain(req, resp)
    try:
        return serve(req, resp)
    except (KeyboardInterrupt, BrokenPipeError):  # (a signal while idle; the trainer gone)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
