"""Worker for test_layouts.py: one process changing layouts (tp2 -> tp1 -> pp2 -> tp2 -> tp1 ->
pp2, as test workers do), a collective on each layout's groups each time, and what came back.

torchrun --nproc-per-node 2 tests/distributed/layout_worker.py OUT.json
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megatron_gspo.model.parallel import ParallelDims, init_distributed, world_size_from_env

LAYOUTS = {"tp2": dict(tp=2), "tp1": dict(tp=1), "pp2": dict(pp=2)}


def enter(name: str) -> dict:
    init_distributed(ParallelDims(**LAYOUTS[name], world_size=world_size_from_env()))
    x = torch.ones(1)
    dist.all_reduce(x, group=mpu.get_tensor_model_parallel_group())
    y = torch.ones(1)
    dist.all_reduce(y, group=mpu.get_data_parallel_group())
    return {
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "dp": mpu.get_data_parallel_world_size(),
        "tp_sum": x.item(),
        "dp_sum": y.item(),
        "tp_group": id(mpu.get_tensor_model_parallel_group()),
        "threads": len(os.listdir("/proc/self/task")),
    }


def main() -> None:
    rounds = [{name: enter(name) for name in LAYOUTS} for _ in range(3)]
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(rounds, f)


if __name__ == "__main__":
    main()
