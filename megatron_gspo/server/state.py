"""What the built-in server's handlers share: the engine (which owns the model), the served paths,
the tokenizer and the weight endpoints' state between requests."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.hf.config import load_hf_config
from megatron_gspo.rollout import weight_payload
from megatron_gspo.server import safe_unpickle
from megatron_gspo.server.engine import Engine
from megatron_gspo.server.model import RolloutModel
from megatron_gspo.server.validate import Limits

MAX_PENDING_INITS = 32  # group inits waiting at once (each holds a thread until it ends)


class TooManyInits(Exception):
    """MAX_PENDING_INITS group inits are waiting already."""


@dataclass
class WeightUpdates:
    """What the weight endpoints keep between requests."""

    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one transfer at a time
    released: set[str] = field(default_factory=set)
    session: str | None = None  # the selector of the open begin/end_weight_update session
    senders: frozenset[int] = frozenset()  # the session's shared-memory senders (their pids)
    group_timeout_s: float = 300.0  # a group init's bound, and its collectives' timeout
    recv_free: list[torch.Tensor] = field(default_factory=list)  # distributed receive buffers
    model_numel: int = 0  # the most elements one update may carry (the model's)
    pending: set[str] = field(default_factory=set)  # groups whose init has not ended

    async def open_group(
        self, address: str, port: int, world: int, rank: int, name: str, backend: str
    ) -> dist.ProcessGroup:
        """Join update group `name` as `rank` (weight_payload.open_update_group) on a thread of
        its own, so that inits waiting on a master never hold up other
        requests (asyncio's shared worker threads carry tensor decoding and receives). Waits at
        most group_timeout_s (TimeoutError): torch's store handshake waits on a silent master
        for ever, whatever its timeout. A thread that ends after that lets its group go."""
        if len(self.pending) >= MAX_PENDING_INITS:
            raise TooManyInits
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def finish(group, error) -> None:  # on the event loop
            self.pending.discard(name)
            if done.cancelled():  # the wait gave up: nobody will use the group
                if group is not None:
                    _in_thread(dist.destroy_process_group, group)
            elif error is not None:
                done.set_exception(error)
            else:
                done.set_result(group)

        def run() -> None:
            group, error = None, None
            try:
                group = weight_payload.open_update_group(
                    address, port, world, rank, name, backend, self.group_timeout_s
                )
            except Exception as e:  # noqa: BLE001 - reported to the request
                error = e
            with contextlib.suppress(RuntimeError):  # (the loop closed: the server stopped)
                loop.call_soon_threadsafe(finish, group, error)

        self.pending.add(name)
        _in_thread(run)
        return await asyncio.wait_for(done, self.group_timeout_s)

    def take_buffer(self, nbytes: int) -> torch.Tensor:
        """A receive buffer of at least `nbytes`: a kept one, else a new one. Two are kept, so
        one bucket can be received while the one before is loaded."""
        for i, buf in enumerate(self.recv_free):
            if buf.numel() >= nbytes:
                return self.recv_free.pop(i)
        if len(self.recv_free) >= 2:
            self.recv_free.pop(0)  # too small: let it go before allocating
        return torch.empty(nbytes, dtype=torch.uint8)

    def give_buffer(self, buf: torch.Tensor) -> None:
        self.recv_free = sorted([*self.recv_free, buf], key=torch.Tensor.numel)[-2:]

    def end_session(self) -> None:
        self.session, self.senders = None, frozenset()

    def drop_buffers(self) -> None:
        self.recv_free = []
        safe_unpickle.forget_mappings()

    def close(self) -> None:
        for group in self.groups.values():
            dist.destroy_process_group(group)
        self.groups.clear()
        self.drop_buffers()


def _in_thread(fn, *args) -> None:
    threading.Thread(target=fn, args=args, daemon=True, name="weights-update-group").start()


class ServerState:
    """What the handlers share: the engine (which owns the model) and the served paths."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.model_path = str(Path(args.model).resolve())
        self.served_path = self.model_path  # (model_path follows disk updates)
        dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
        model = RolloutModel.from_pretrained(self.model_path, dtype, args.quantization)
        model.batch_invariant = args.enable_deterministic_inference
        self.spec = model.spec
        self.hf_config = load_hf_config(self.model_path)
        self.tokenizer = _load_tokenizer(Path(self.model_path))
        self.engine = Engine(
            model,
            eos_ids=_eos_ids(Path(self.model_path), self.hf_config),
            decode=self.decode if self.tokenizer else None,
            max_running=args.max_running_requests,
            record_routing=args.enable_return_routed_experts,
            seed=args.random_seed,
            weight_version=args.weight_version,
            decode_kernel=args.decode_kernel,
        )
        self.weights = WeightUpdates(group_timeout_s=float(args.weight_group_timeout))
        self.weights.model_numel = model.numel()
        self.limits = Limits(max_n=args.max_n, max_batch=args.max_batch_size)
        self.ignored_fields: set[str] = set()  # unknown /generate fields already logged

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _load_tokenizer(path: Path):
    if not (path / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def _eos_ids(path: Path, cfg: dict) -> set[int]:
    gen = path / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    eos = cfg.get("eos_token_id") if eos is None else eos
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
