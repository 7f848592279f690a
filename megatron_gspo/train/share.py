"""Rank 0 and the other ranks: the one place that decides who does what on the rollout side.

Global rank 0 owns the rollouts: it starts (or finds) the servers (fleet.py) and produces every
step's batch (producer.py). Every other rank learns the servers' URLs and key (for the weight
sync) and receives, per step, rank 0's facts and metrics: the batch's rows themselves go to each
rank sharded by the actor (`Actor.shard`), never whole. So every rank takes the same turns
(the collectives of the loop, the weight sync and the checkpoint) on the same facts.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from megatron_gspo.comm import bcast, from_rank0
from megatron_gspo.config import Config
from megatron_gspo.train.fleet import ServerFleet
from megatron_gspo.train.generate import Generation
from megatron_gspo.train.io_thread import IoThread
from megatron_gspo.train.producer import BatchProducer, PromptSet
from megatron_gspo.train.results import Collected


class SharedRollouts:
    """Every rank's handle on rank 0's batch producer (`producer`: None on the other ranks)."""

    def __init__(self, producer: BatchProducer | None):
        self.producer = producer
        self.rank0 = producer is not None
        self.n_train_prompts: int = bcast(producer.n_train_prompts if producer else None)

    def collect(self, prompt_index: list[int], step: int, version: str | None = None) -> Collected:
        """G responses for each prompt, scored: the batch on rank 0 (the actor's `shard` sends
        every rank its rows), its metrics and size on every rank."""
        return self.share(self.gather(prompt_index, step, version) if self.rank0 else None)

    def gather(self, prompt_index: list[int], step: int, version: str | None = None) -> Collected:
        """Rank 0: the step's batch and metrics (any thread: ahead.py runs it on one of its own
        while the trainer trains)."""
        assert self.producer is not None, "only rank 0 produces batches"
        return self.producer.produce(prompt_index, step, version)

    def share(self, result: Collected | None) -> Collected:
        """Rank 0's `gather` result -> the batch on rank 0, its metrics and size everywhere."""
        if result is not None:
            result.rows = 0 if result.batch is None else len(result.batch)
        if dist.get_world_size() == 1:
            assert result is not None  # one process: it is rank 0
            return result
        box = [None if result is None else replace(result, batch=None)]
        dist.broadcast_object_list(box, src=0)  # (the step's facts and metrics, not its rows)
        shared = box[0]
        assert shared is not None  # rank 0's, on every rank
        return replace(shared, batch=result.batch if result is not None else None)

    def evaluate(self) -> float:
        """Mean greedy reward on the held-out prompts (every rank gets it)."""
        return bcast(self.producer.evaluate() if self.producer else 0.0)

    def hold_generation(self, on: bool) -> None:
        """Rank 0, rollout.partial: hold the generation in flight around a weight sync."""
        if self.producer is not None:
            self.producer.hold(on)

    def abort_generation(self) -> None:
        """Rank 0: abort every request in flight, for good (the run is ending)."""
        if self.producer is not None:
            self.producer.abort()


def rollout_side(
    cfg: Config,
    run_dir: Path,
    hf_dir: Path,
    stack: ExitStack,
    inputs_checked: Callable[[int], None] = lambda n_train_prompts: None,
) -> tuple[ServerFleet, SharedRollouts]:
    """The fleet and the batches, as this rank holds them: rank 0 loads the prompts, starts the
    reward workers, calls `inputs_checked` (with the number of train prompts), then starts the
    servers and their clients (`stack` closes them, last started first); the other ranks get a
    view of the fleet (URLs and key, no supervisor) and receive batches. What rank 0 refuses
    on the way (a dataset's rows, the reward, the servers) every rank says (`from_rank0`)."""
    held: dict = {}  # rank 0's fleet and producer

    def start() -> tuple[list[str], str | None]:
        held["fleet"], held["producer"] = _rank0_side(cfg, run_dir, hf_dir, stack, inputs_checked)
        return held["fleet"].urls, held["fleet"].api_key

    urls, key = from_rank0(start)
    fleet = held.get("fleet") or ServerFleet(urls, key, release_memory=cfg.rollout.release_memory)
    return fleet, SharedRollouts(held.get("producer"))


def _rank0_side(
    cfg: Config,
    run_dir: Path,
    hf_dir: Path,
    stack: ExitStack,
    inputs_checked: Callable[[int], None],
) -> tuple[ServerFleet, BatchProducer]:
    """Rank 0's side of `rollout_side`: the prompts, the reward, the servers, the producer."""
    prompts = PromptSet(cfg, hf_dir)
    io = IoThread()
    stack.callback(io.close)
    gen = Generation(cfg, prompts.tokenizer, run_dir)  # (a broken reward fails before servers)
    stack.callback(gen.close)
    inputs_checked(len(prompts.train.rows))
    fleet = ServerFleet.start(cfg, run_dir, hf_dir, io, prompts.longest)
    stack.callback(fleet.close)
    assert fleet.generator is not None  # (started: connected)
    return fleet, BatchProducer(cfg, prompts, gen, fleet.generator, io)
