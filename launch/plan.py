"""Where the processes of one run go: trainer ranks, rollout servers and the router.

Both launch scripts (launch/torchrun.sh on one node, launch/slurm/train.sbatch on many) read the
same YAML config through this file, so a layout that cannot work, a model.path that is not
there, or an SGLang mode its nodes cannot serve, fails before anything starts:

    python launch/plan.py --config CFG --nnodes 2 --gpus-per-node 8 [key.sub=value ...]

prints shell assignments (`eval "$(python launch/plan.py ...)"`). launch/serve_node.py imports
`make_layout` to start this node's servers on the GPUs the layout gives them. torchrun.sh also
passes train's own flags (--run-dir, --steps, --resume, --allow-config-change): --steps is
checked here, and a --resume of a run with no step left is answered here, before any server
starts (NOTHING_TO_TRAIN, the line `train` prints; the script prints it and exits 0), as is a
--resume with a config the run was not trained with (`train`'s refusal, exit 2).

Placement (`rollout.placement`):
  colocated      every node trains and serves: its servers share the trainer's GPUs (SGLang
                 releases its memory while the trainer trains; `rollout.release_memory`). On
                 several nodes sync.method=tensor relays each node's weights through a trainer
                 rank there; disaggregated nodes that only serve need sync.method=distributed.
  disaggregated  the last `rollout_nodes` nodes serve, the others train. On one node the GPUs
                 are split: the trainer takes the first nproc_per_node, the servers the rest.
On a CPU-only machine a node runs `servers_per_node` servers (default 1) and nproc_per_node ranks.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.config import Config, load_config
from megatron_gspo.data.task_model import check_model_path, check_server_weights
from megatron_gspo.errors import UserError
from megatron_gspo.rollout.modes import Backend, Placement
from megatron_gspo.rollout.server_config import check_sglang_modes
from megatron_gspo.train.flags import ALLOW_WITHOUT_RESUME, check_steps
from megatron_gspo.weight_sync.config import SyncMethod


@dataclass(frozen=True)
class Layout:
    placement: str  # colocated | disaggregated
    backend: str  # builtin | sglang
    nnodes: int  # nodes in the job
    rollout_nodes: int  # disaggregated: nodes set aside for servers (the last ones)
    gpus_per_node: int  # 0: CPU only
    nproc_per_node: int  # trainer ranks on each training node
    servers_per_node: int  # rollout servers on each serving node
    server_tp: int

    @property
    def train_nodes(self) -> int:
        return self.nnodes - self.rollout_nodes

    @property
    def world_size(self) -> int:
        return self.train_nodes * self.nproc_per_node

    @property
    def serving_nodes(self) -> list[int]:
        if self.placement == Placement.COLOCATED or self.rollout_nodes == 0:
            return list(range(self.nnodes))
        return list(range(self.train_nodes, self.nnodes))

    @property
    def total_servers(self) -> int:
        return len(self.serving_nodes) * self.servers_per_node

    @property
    def router(self) -> bool:
        """sglang-router in front when there are several SGLang servers."""
        return self.backend == Backend.SGLANG and self.total_servers > 1

    def role(self, node_rank: int) -> str:
        """train | serve | both."""
        trains = node_rank < self.train_nodes
        serves = node_rank in self.serving_nodes
        return "both" if trains and serves else ("train" if trains else "serve")

    def trainer_gpus(self) -> list[int]:
        """GPU indices (on the node) of the trainer ranks; empty on a CPU."""
        return list(range(self.nproc_per_node)) if self.gpus_per_node else []

    def server_gpus(self, node_rank: int) -> list[list[int]]:
        """GPU indices of each server on this node ([] per server on a CPU)."""
        if not self.gpus_per_node:
            return [[] for _ in range(self.servers_per_node)]
        first = 0
        if self.placement == Placement.DISAGGREGATED and self.role(node_rank) == "both":
            first = self.nproc_per_node  # one node, split: the servers take the GPUs after
        tp = self.server_tp
        return [
            list(range(first + i * tp, first + (i + 1) * tp)) for i in range(self.servers_per_node)
        ]


def make_layout(
    cfg: Config,
    nnodes: int = 1,
    gpus_per_node: int = 0,
    nproc_per_node: int | None = None,
    rollout_nodes: int | None = None,
    servers_per_node: int | None = None,
) -> Layout:
    """The layout of one job, checked: raises UserError naming the fix."""
    r = cfg.rollout
    if nnodes < 1:
        raise UserError(f"the job needs at least one node, not {nnodes}")
    _check_counts(gpus_per_node, nproc_per_node, servers_per_node)
    if r.placement == Placement.COLOCATED:
        if rollout_nodes:
            raise UserError(
                f"ROLLOUT_NODES={rollout_nodes} sets nodes aside for servers, but "
                "rollout.placement is colocated; set rollout.placement=disaggregated or unset it"
            )
        rollout_nodes = 0
    elif rollout_nodes is None:
        rollout_nodes = 1 if nnodes > 1 else 0
    if nnodes > 1 and r.placement == Placement.DISAGGREGATED and not 1 <= rollout_nodes < nnodes:
        raise UserError(
            f"disaggregated on {nnodes} nodes needs 1..{nnodes - 1} rollout nodes, not "
            f"{rollout_nodes}; set ROLLOUT_NODES"
        )
    if nnodes == 1 and rollout_nodes:
        raise UserError("one node cannot set whole nodes aside for servers; unset ROLLOUT_NODES")
    layout = Layout(
        placement=r.placement,
        backend=r.backend,
        nnodes=nnodes,
        rollout_nodes=rollout_nodes,
        gpus_per_node=gpus_per_node,
        nproc_per_node=nproc_per_node or _default_nproc(r, nnodes, gpus_per_node),
        servers_per_node=servers_per_node or _default_servers(r, nnodes, gpus_per_node),
        server_tp=r.server_tp,
    )
    _check(cfg, layout)
    return layout


def _check_counts(gpus: int, nproc: int | None, servers: int | None) -> None:
    """Counts given on the command line: a zero or negative one is refused, not replaced by
    the default (NPROC_PER_NODE=0 started one rank per GPU) or planned with (-1 ranks)."""
    if gpus < 0:
        raise UserError(f"GPUS_PER_NODE={gpus}: a node has 0 (CPU only) or more GPUs")
    for name, value in (("NPROC_PER_NODE", nproc), ("SERVERS_PER_NODE", servers)):
        if value is not None and value < 1:
            raise UserError(f"{name}={value} must be at least 1 (or unset for the default)")


def _default_nproc(r, nnodes: int, gpus: int) -> int:
    if not gpus:
        return 1
    if r.placement == Placement.DISAGGREGATED and nnodes == 1:
        return max(gpus - r.server_tp, 1)  # the rest of the node serves
    return gpus


def _default_servers(r, nnodes: int, gpus: int) -> int:
    if not gpus:
        return 1
    if r.placement == Placement.DISAGGREGATED and nnodes == 1:
        gpus -= _default_nproc(r, nnodes, gpus)
    return max(gpus // r.server_tp, 1)


def _check(cfg: Config, lay: Layout) -> None:
    p = cfg.parallel
    etp = p.tp if p.etp is None else p.etp
    if lay.world_size % (p.tp * p.pp) or lay.world_size % (etp * p.ep * p.pp):
        raise UserError(
            f"{lay.train_nodes} training node(s) x {lay.nproc_per_node} ranks = {lay.world_size} "
            f"ranks, not a multiple of tp*pp={p.tp * p.pp} and etp*ep*pp={etp * p.ep * p.pp}; "
            "change the node count, NPROC_PER_NODE or parallel.*"
        )
    if lay.gpus_per_node:
        _check_gpus(cfg, lay)
    multi_host = lay.nnodes > 1
    serve_only = [n for n in lay.serving_nodes if lay.role(n) == "serve"]
    if cfg.sync.method == SyncMethod.TENSOR and serve_only:
        # Tensor handles only open on their own host: a trainer rank on each serving node relays
        # the buckets to its servers (weight_sync/relay.py). A node that only serves has none.
        raise UserError(
            f"sync.method=tensor needs a trainer rank on every serving node to relay the weights "
            f"to its servers, and rollout node(s) {' '.join(map(str, serve_only))} only serve; "
            "set sync.method=distributed"
        )
    if cfg.sync.method == SyncMethod.DISK and multi_host:
        pass  # works when RUN_DIR is on a filesystem every node mounts (it must be anyway)


def _check_gpus(cfg: Config, lay: Layout) -> None:
    gpus = lay.gpus_per_node
    used_by_servers = lay.servers_per_node * lay.server_tp
    if lay.placement == Placement.COLOCATED and (
        lay.nproc_per_node > gpus or used_by_servers > gpus
    ):
        raise UserError(
            f"colocated on {gpus} GPUs per node: {lay.nproc_per_node} trainer ranks and "
            f"{lay.servers_per_node} servers x rollout.server_tp {lay.server_tp} do not fit; "
            "lower NPROC_PER_NODE, SERVERS_PER_NODE or rollout.server_tp"
        )
    if lay.placement == Placement.DISAGGREGATED:
        trainer = lay.nproc_per_node if lay.nnodes == 1 else 0
        if lay.nproc_per_node > gpus or trainer + used_by_servers > gpus:
            raise UserError(
                f"disaggregated on {gpus} GPUs per node: {trainer or lay.nproc_per_node} trainer "
                f"GPUs and {lay.servers_per_node} servers x rollout.server_tp {lay.server_tp} do "
                "not fit; lower NPROC_PER_NODE, SERVERS_PER_NODE or rollout.server_tp"
            )
    r = cfg.rollout
    if (
        lay.placement == Placement.COLOCATED
        and r.backend == Backend.SGLANG
        and not r.release_memory
    ):
        print(
            "warning: colocated SGLang on GPUs without rollout.release_memory keeps its weights "
            "and KV cache on the GPUs while the trainer trains",
            file=sys.stderr,
        )


def shell_assignments(cfg: Config, lay: Layout, nothing_to_train: str | None = None) -> str:
    values = {
        "PLACEMENT": lay.placement,
        "BACKEND": lay.backend,
        "TRAIN_NODES": lay.train_nodes,
        "ROLLOUT_NODES": lay.rollout_nodes,
        "NPROC_PER_NODE": lay.nproc_per_node,
        "SERVERS_PER_NODE": lay.servers_per_node,
        "SERVING_NODES": " ".join(map(str, lay.serving_nodes)),
        "TOTAL_SERVERS": lay.total_servers,
        "START_ROUTER": int(lay.router),
        "TRAINER_GPUS": ",".join(map(str, lay.trainer_gpus())),
        "SYNC_METHOD": cfg.sync.method,
        # (the config's, else the environment's: torchrun.sh evaluates these lines, and an
        # empty value would erase the SGLANG_PYTHON that the image or the user set)
        "SGLANG_PYTHON": cfg.rollout.sglang_python or os.environ.get("SGLANG_PYTHON", ""),
        "HEALTH_TIMEOUT_S": int(cfg.rollout.health_timeout_s),
        "NOTHING_TO_TRAIN": nothing_to_train or "",
    }
    return "\n".join(f"{k}={shlex.quote(str(v))}" for k, v in values.items())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layout_args(p)
    # train's own flags, as torchrun.sh passes them on (not serve_node.py's)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--steps", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--allow-config-change", action="store_true")
    return p.parse_args(argv)


def add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--nproc-per-node", type=int, default=None)
    p.add_argument("--rollout-nodes", type=int, default=None)
    p.add_argument("--servers-per-node", type=int, default=None)
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")


def layout_from_args(args: argparse.Namespace) -> tuple[Config, Layout]:
    for o in args.overrides:
        if "=" not in o:  # (was dropped without a word: the layout planned without it)
            raise UserError(f"{o!r} is not an override; write key.sub=value")
    cfg = load_config(args.config, args.overrides)
    return cfg, make_layout(
        cfg,
        nnodes=args.nnodes,
        gpus_per_node=args.gpus_per_node,
        nproc_per_node=args.nproc_per_node,
        rollout_nodes=args.rollout_nodes,
        servers_per_node=args.servers_per_node,
    )


def check_model(cfg: Config) -> None:
    """model.path must be there before any server or rank starts: the servers would otherwise
    start first and each fail on its own (no config.json), far from the fix. The same one-line
    error as `train`'s, naming the command that makes a built-in task's starting model (from a
    module without torch or Megatron: this runs before every launch)."""
    check_model_path(cfg.model.path, cfg.data.train)
    check_server_weights(cfg.model.path, cfg.rollout.urls)


def check_server_modes(cfg: Config, lay: Layout) -> None:
    """The rollout modes SGLang cannot serve on this layout's nodes (fp8, deterministic
    inference on a node without GPUs), refused in `train`'s one line before any server starts,
    not by each server's failed start."""
    if cfg.rollout.backend == Backend.SGLANG:
        check_sglang_modes(cfg, gpu=lay.gpus_per_node > 0)


def steps_arg(text: str | None) -> int | None:
    """--steps as torchrun.sh got it: a whole number (0: step 0's eval only), else the one-line
    error (`abc` or `-3` used to start the servers and torchrun, whose ranks then failed)."""
    if text is None:
        return None
    if not text.isascii() or not text.isdigit():
        raise UserError(f"--steps {text} must be a whole number of steps (0 or more)")
    return int(text)


def nothing_to_train_line(cfg: Config, args: argparse.Namespace) -> str | None:
    """On --resume, `train`'s nothing-to-train line for a run with no step left (None: train
    on), asked before any server starts. Only then are the trainer's modules (torch) imported:
    a plain launch plans without them."""
    steps = steps_arg(args.steps)
    check_steps(steps, cfg.train.steps)  # (train's line)
    if args.allow_config_change and not args.resume:
        raise UserError(ALLOW_WITHOUT_RESUME)  # (train's line)
    if not args.resume:
        return None
    from megatron_gspo.train.finished import launch_line

    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)
    line = launch_line(cfg, run_dir, steps, args.allow_config_change)
    if line is None:
        check_resume_config(cfg, run_dir, args.allow_config_change)
    return line


def check_resume_config(cfg: Config, run_dir: Path, allow_config_change: bool) -> None:
    """--resume of a run that has a checkpoint, with a config that computes something else than
    its config.yaml (another layout, algorithm, data...): `train`'s refusal (train/run_dir.py
    `prepare`, the same rule and line), before any server starts, not from the trainer once the
    servers are up. Reads two files: the checkpoints themselves are the trainer's to verify."""
    from megatron_gspo.train import checkpointing
    from megatron_gspo.train.run_dir import check_config

    if checkpointing.latest(run_dir) is not None:
        check_config(run_dir, cfg, allow_config_change)


def main(argv=None) -> None:
    try:
        args = parse_args(argv)
        cfg, layout = layout_from_args(args)
        said = nothing_to_train_line(cfg, args)
        if said is None:
            check_model(cfg)
            check_server_modes(cfg, layout)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(shell_assignments(cfg, layout, said))


if __name__ == "__main__":
    main()
