"""The built-in server's flags (`megatron-gspo serve`, `python -m megatron_gspo.server`) and
their checks before anything loads: a mistake is one line, not a traceback from the socket or
torch call that would take the value. Free of torch and aiohttp, so that building the command
line's parser (and every `--help`) stays fast; serve.py runs the server."""

from __future__ import annotations

import argparse
import logging
import os

from megatron_gspo.errors import UserError
from megatron_gspo.rollout.server_config import API_KEY_ENV
from megatron_gspo.server.validate import SEED_END, is_loopback, show

DECODE_KERNEL_ENV = "MEGATRON_GSPO_DECODE_KERNEL"
KERNEL_MODES = ("auto", "c", "torch")  # --decode-kernel (kernels.py)
QUANTIZATIONS = ("fp8",)  # --quantization (quantize.py)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "--model-path", dest="model", required=True, help="HF dir")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (default ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="answer each token's MoE expert ids (meta_info.routed_experts: R3)",
    )
    add_limit_args(parser)
    add_numerics_args(parser)
    parser.add_argument(
        "--random-seed",
        type=int,
        default=0,
        help="seed of the sampling of requests without a sampling_seed",
    )
    parser.add_argument(
        "--weight-version",
        default="default",
        help="the weight version answered until a weight update sets one",
    )
    parser.add_argument("--log-level", default="warning", help="python logging level")


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """What one server takes on: requests at once, samples and sequences per request, and how
    long a connection, a weight group and a shutdown may take."""
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=64,
        help="sequences decoded at once; more wait for a slot",
    )
    parser.add_argument(
        "--max-n", type=int, default=256, help="most samples of one prompt (sampling_params.n)"
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=1024,
        help="most sequences one /generate makes (prompts x n); larger requests get a 400",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=60.0,
        help="seconds a connection may sit without a complete request, or a body take to arrive",
    )
    parser.add_argument(
        "--weight-group-timeout",
        type=float,
        default=300.0,
        help="seconds a /init_weights_update_group may take (it fails after), and the "
        "timeout of the group's broadcasts",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=15.0,
        help="seconds SIGTERM waits for a clean stop before the process exits anyway",
    )


def add_numerics_args(parser: argparse.ArgumentParser) -> None:
    """How the model computes: dtype, fp8 weights, threads, the decode kernel, batch
    invariance."""
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="the model's compute dtype (auto: the checkpoint's config.json dtype)",
    )  # fmt: skip
    parser.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="fp8: the linear weights rounded to float8 e4m3 on every load, computed in --dtype",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    parser.add_argument(
        "--decode-kernel",
        default=os.environ.get(DECODE_KERNEL_ENV, "auto"),
        choices=KERNEL_MODES,
        help=f"decode steps in compiled C, torch, or auto (default ${DECODE_KERNEL_ENV} or auto)",
    )
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant numerics (SGLang's flag): a request's tokens and log-probs do not "
        "depend on what it is batched with, so seeded requests give the same answers at any "
        "load; the torch forward then runs in parts (decode steps by position, each prefill)",
    )


def check_host(host: str, api_key: str | None) -> None:
    if api_key or is_loopback(host):
        return
    raise UserError(
        f"refusing to serve on non-loopback host {host!r} without an API key; "
        f"pass --api-key (or set ${API_KEY_ENV}) or bind 127.0.0.1"
    )


def check_serve_args(args: argparse.Namespace) -> None:
    """Range-check the flags before anything loads, so a typo is one line, not a traceback
    from deep inside the socket or torch calls that would take the value."""
    bounds: dict[str, tuple[int, int | None]] = {
        "port": (0, 65535),
        "threads": (0, 4096),
        "random_seed": (0, SEED_END - 1),
    }
    bounds |= dict.fromkeys(("max_running_requests", "max_n", "max_batch_size"), (1, None))
    for flag, (lo, hi) in bounds.items():
        value = getattr(args, flag)
        if value < lo or (hi is not None and value > hi):
            where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise UserError(f"--{flag.replace('_', '-')} must be {where}, got {show(value)}")
    for flag in ("read_timeout", "shutdown_timeout", "weight_group_timeout"):
        if not 0 < getattr(args, flag) <= 1e9:
            raise UserError(f"--{flag.replace('_', '-')} must be in (0, 1e9] seconds")
    if args.log_level.upper() not in logging.getLevelNamesMapping():
        raise UserError(f"--log-level {args.log_level!r} is not a level; use info or warning")
