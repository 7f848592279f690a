"""`megatron-gspo score`: per-token log-probs of JSONL token sequences under any parallel layout.

Input lines are {"input_ids": [...]}; output lines are the same object plus "logprobs" (the
log-probability of every token given its prefix, the first entry null), in input order.
Data-parallel replicas split the lines; the output file appears only when complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from megatron_gspo.errors import UserError
from megatron_gspo.model.parallel import ParallelDims, init_distributed
from megatron_gspo.model.policy import checkpoint_spec, load_policy


def read_sequences(path: Path, vocab_size: int) -> list[dict]:
    if not path.is_file():
        raise UserError(f"input file {path} does not exist")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not JSON ({e.msg}); fix or remove the line") from None
        ids = row.get("input_ids") if isinstance(row, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise UserError(f'{path}:{n}: needs a non-empty list of ints under "input_ids"')
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise UserError(f"{path}:{n}: token id outside the vocabulary [0, {vocab_size})")
        rows.append(row)
    if not rows:
        raise UserError(f"{path} holds no sequences")
    return rows


def run_score(
    checkpoint: str,
    input_path: str,
    output_path: str,
    dims: ParallelDims,
    micro_batch_size: int = 8,
) -> None:
    from megatron.core import parallel_state as mpu

    from megatron_gspo.model.forward import score

    out = Path(output_path)
    if out.exists():
        raise UserError(f"output file {out} exists; remove it or choose another --output")
    spec, meta = checkpoint_spec(checkpoint)
    dims.validate(spec)
    if meta is None:
        from megatron_gspo.hf.io import HFReader

        HFReader(checkpoint)  # a missing or truncated weight file fails before any work
    rows = read_sequences(Path(input_path), spec.vocab_size)
    init_distributed(dims)
    chunks = load_policy(checkpoint, dims)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mine = list(range(dp_rank, len(rows), dp))
    # Every replica runs the same number of microbatches: expert-parallel collectives span
    # replicas, so a replica with fewer lines scores copies of line 0 and drops them.
    per_rank = -(-len(rows) // dp)
    seqs = [rows[i]["input_ids"] for i in mine] + [rows[0]["input_ids"]] * (per_rank - len(mine))
    logprobs = score(chunks, seqs, micro_batch_size=micro_batch_size)[: len(mine)]
    gathered = [None] * dp
    dist.all_gather_object(gathered, list(zip(mine, logprobs)), group=mpu.get_data_parallel_group())
    if dist.get_rank() == 0:
        for part in gathered:
            for i, lp in part:
                rows[i]["logprobs"] = lp
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, out)
    dist.barrier()
