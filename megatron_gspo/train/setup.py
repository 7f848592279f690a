"""What a training run stands on: process groups, the run directory (locked; see run_dir.py for
what a start does with what it finds there), the policy and its optimizer, the prompt sampler,
the weight sync, and the restore of a checkpoint on `--resume`."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from megatron_gspo.comm import from_rank0
from megatron_gspo.config import Config, dump_config
from megatron_gspo.data.task_model import check_model_path, check_server_weights
from megatron_gspo.errors import UserError
from megatron_gspo.train import checkpointing
from megatron_gspo.train.metrics import check_wandb
from megatron_gspo.train.run_dir import RunDirLock, StartPlan, prepare
from megatron_gspo.train.state import TrainState

log = logging.getLogger(__name__)


class TrainerSetup:
    def __init__(self, cfg: Config, run_dir: Path, resume: bool, allow_config_change: bool = False):
        self.cfg = cfg
        self.run_dir = run_dir
        self.resume = resume
        self.allow_config_change = allow_config_change
        self.resume_from: Path | None = None
        self.lock: RunDirLock | None = None
        self.plan: StartPlan | None = None
        self.resumed: TrainState | None = None  # the checkpoint's trainer state, once loaded
        self.made = self.committed = False

    def __enter__(self) -> TrainerSetup:
        import torch.distributed as dist

        from megatron_gspo.model.parallel import init_distributed, world_size_from_env
        from megatron_gspo.model.policy import checkpoint_spec, hf_files_dir

        cfg = self.cfg
        # Inputs every rank checks alike before the ranks first meet (each says the same line);
        # what only rank 0 can check comes after, its refusal shared (comm.from_rank0).
        check_model_path(cfg.model.path, cfg.data.train)
        check_prompt_sources(cfg)
        check_wandb(cfg.logging.wandb)
        check_server_weights(cfg.model.path, cfg.rollout.urls)
        spec, _ = checkpoint_spec(cfg.model.path)
        cfg.check_context(
            spec.max_position_embeddings, str(hf_files_dir(cfg.model.path) / "config.json")
        )
        dims = cfg.parallel.dims(world_size_from_env())
        dims.validate(spec, keys=True)
        init_distributed(dims, seed=cfg.seed)
        self.rank0 = dist.get_rank() == 0
        from_rank0(lambda: check_sglang_start(cfg))
        self.made = self.rank0 and not self.run_dir.exists()  # this start makes the directory
        try:
            self.plan = self._claim_run_dir()
            self.resume_from = self.plan.checkpoint
            self.hf_dir = hf_files_dir(cfg.model.path).resolve()
            self.actor = self._build_actor(dims)
            if self.resume_from is not None:  # (before the directory is written: see commit)
                self.actor.check_checkpoint(self.resume_from / "model")  # adapters' shapes
                state = checkpointing.load(self.actor, self.resume_from)
                self.resumed = TrainState.from_state_dict(state)
        except BaseException:
            self.abandon()
            raise
        return self

    def commit(self, n_train_prompts: int) -> None:
        """Rank 0, once the start's inputs are checked (the checkpoint loaded, the prompts and
        the reward loaded: `n_train_prompts` of them): carry out the run directory's plan
        (run_dir.py) and write the config. Until then the directory is as this start found it."""
        assert self.plan is not None
        if self.resumed is not None:  # the saved prompt order fits this dataset (else: why not)
            self._new_sampler(n_train_prompts).load_state_dict(self.resumed.sampler)
        self.plan.carry_out(self.run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        dump_config(self.cfg, self.run_dir / "config.yaml")
        self.committed = True

    def abandon(self) -> None:
        """A start refused before `commit`: remove the run directory if this start made it
        (it holds only the lock file), and let it go."""
        if self.made and self.lock is not None and not self.committed:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self.__exit__()

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _claim_run_dir(self) -> StartPlan:
        """Rank 0 locks the run directory for this trainer's lifetime and decides what the start
        does there; every rank learns the checkpoint to resume from, or the error."""

        def claim() -> StartPlan:
            self.lock = RunDirLock(self.run_dir).acquire()
            change = self.allow_config_change
            return prepare(self.run_dir, self.resume, self.cfg, change, new=self.made)

        return from_rank0(claim)

    def _build_actor(self, dims):
        import torch

        from megatron_gspo.model.builder import BuildOptions
        from megatron_gspo.model.policy import load_policy
        from megatron_gspo.train.actor import Actor

        m = self.cfg.model
        opts = BuildOptions(
            params_dtype=torch.bfloat16 if m.dtype == "bfloat16" else None,
            recompute=m.recompute,
            moe_grouped_gemm=m.moe_grouped_gemm.resolve(),
            routing_replay=True,
            lm_head_chunk_tokens=m.lm_head_chunk,
            lm_head_keep_mb=m.lm_head_keep_mb,
        )
        chunks = load_policy(m.path, dims, opts, self.cfg.lora, self.cfg.seed)
        t = self.cfg.train  # packed microbatches under a token budget, or padded rows
        actor = Actor(chunks, self.cfg.optim, routing_replay=self.cfg.algo.routing_replay,
                      max_tokens_per_microbatch=t.max_tokens_per_microbatch if t.pack else None)  # fmt: skip
        if self.cfg.algo.kl_coef > 0:  # the starting weights, before a resume loads others
            actor.keep_reference(offload=self.cfg.algo.ref_offload)
        return actor

    def sampler(self, n_rows: int):
        self._sampler = self._new_sampler(n_rows)
        return self._sampler

    def _new_sampler(self, n_rows: int):
        from megatron_gspo.data.prompts import PromptSampler

        return PromptSampler(n_rows, self.cfg.rollout.prompts_per_step, self.cfg.seed)

    def weight_sync(self, urls: list[str], api_key: str | None = None):
        from megatron_gspo.weight_sync.config import ServerRef
        from megatron_gspo.weight_sync.sync import WeightSync

        r = self.cfg.rollout
        nodes = r.url_nodes if r.urls and r.url_nodes else [None] * len(urls)
        refs: list[str | ServerRef] = [
            ServerRef(u, r.server_tp, api_key, node) for u, node in zip(urls, nodes, strict=True)
        ]
        self.sync = WeightSync(
            self.actor.chunks,
            refs,
            self.cfg.sync.with_run_dir(self.run_dir),
            base_model=self.hf_dir,
            node=_launcher_node(),
        )
        if self.rank0 and self.sync.relay is not None:
            print(f"weight sync: {self.sync.relay.describe(self.sync.servers)}", flush=True)
        return self.sync

    def restore(self, sampler, sync, fleet) -> TrainState:
        """Fresh run: step 0. Resume: load the newest complete checkpoint and bring the rollout
        servers to its weights (they started from the base model)."""
        if self.resume_from is None or self.resumed is None:
            return TrainState(sampler=sampler.state_dict())
        state = self.resumed  # (loaded at the start, see __enter__)
        checkpointing.restore_rng(self.resume_from)
        sampler.load_state_dict(state.sampler)
        version = str(state.weight_version)
        report = sync.sync(version)
        if not report.ok:
            raise UserError(report.message().splitlines()[0])
        fleet.weights_at(sync.restore_point)
        if self.rank0:
            log.info("resumed from %s (step %d)", self.resume_from, state.step)
        return state


def _launcher_node() -> int | None:
    """The launcher's index of this rank's node (launch/torchrun.sh exports it), if given."""
    from megatron_gspo.weight_sync.relay import NODE_ENV

    value = os.environ.get(NODE_ENV)
    if value is None:
        return None
    if not value.isdigit():
        raise UserError(f"{NODE_ENV}={value!r} must be this node's index (0, 1, ...)")
    return int(value)


def check_prompt_sources(cfg: Config) -> None:
    """data.train and data.eval name a built-in task or a file that is there, of a known
    format (no row is read: rank 0 reads the rows later)."""
    from megatron_gspo.data.prompts import check_source

    check_source(cfg.data.train, "train")
    check_source(cfg.data.eval or cfg.data.train, "eval")


def check_sglang_start(cfg: Config) -> None:
    """Where the trainer will start SGLang itself (rank 0, no rollout.urls), that it can serve
    the rollout modes asked for on this machine and that its python imports it: refused in one
    line before the run directory is made, not by each server's failed start after it (rank 0
    checks, every rank says it: see `TrainerSetup.__enter__`)."""
    import torch

    from megatron_gspo.rollout.modes import Backend
    from megatron_gspo.rollout.server_config import (
        check_sglang_modes,
        check_sglang_python,
        sglang_python,
    )

    r = cfg.rollout
    if r.backend == Backend.SGLANG and not r.urls:
        check_sglang_modes(cfg, torch.cuda.is_available())
        check_sglang_python(sglang_python(r.sglang_python))
