"""`python -m megatron_gspo.server --model HF_DIR --port 0`: the built-in server (see app.py),
started as `megatron-gspo serve` is (entry.py): its flags read without torch, the server's
import (torch: seconds) with SIGINT and SIGTERM held, a Ctrl-C before it serves the one line
"interrupted", exit 130 (once it serves, a clean stop: serve.py)."""

from __future__ import annotations

import argparse

from megatron_gspo.entry import run_command
from megatron_gspo.outputs import signals_held
from megatron_gspo.server.args import add_serve_args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatron_gspo.server")
    add_serve_args(parser)
    run_command(lambda: serve(parser.parse_args(argv)))


def serve(args: argparse.Namespace) -> None:
    """Run the server `args` describe (`megatron-gspo serve` runs this too): torch's import,
    seconds, with SIGINT and SIGTERM held (they take effect once it ends)."""
    with signals_held():
        from megatron_gspo.server.serve import serve_main

    serve_main(args)


if __name__ == "__main__":
    main()
