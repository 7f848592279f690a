"""`megatron-gspo score`: per-token log-probs of JSONL token sequences under any parallel layout.

Input lines are {"input_ids": [...]}; output lines are the same object plus "logprobs" (the
log-probability of every token given its prefix, the first entry null), in input order.
Data-parallel replicas split the lines; the output file (and any missing directory above it)
appears only when complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from megatron_gspo.errors import UserError
from megatron_gspo.hf.config import ModelSpec
from megatron_gspo.model.parallel import ParallelDims, init_distributed
from megatron_gspo.model.policy import checkpoint_spec, load_policy
from megatron_gspo.outputs import check_new_output, temp_file_for


def read_sequences(path: Path, spec: ModelSpec) -> list[dict]:
    if path.is_dir():
        raise UserError(f"input {path} is a directory; point --input at a JSONL file")
    if not path.is_file():
        raise UserError(f"input file {path} does not exist")
    rows = []
    for n, raw in enumerate(path.read_bytes().splitlines(), 1):
        row = _parse_line(raw, f"{path}:{n}")
        if row is None:
            continue
        ids = row["input_ids"]
        if min(ids) < 0 or max(ids) >= spec.vocab_size:
            raise UserError(f"{path}:{n}: token id outside the vocabulary [0, {spec.vocab_size})")
        if len(ids) > spec.max_position_embeddings:
            raise UserError(
                f"{path}:{n}: {len(ids)} tokens exceed the model's context of "
                f"{spec.max_position_embeddings} tokens (max_position_embeddings); shorten or remove "
                "the line"
            )
        rows.append(row)
    if not rows:
        raise UserError(f"{path} holds no sequences")
    return rows


def _parse_line(raw: bytes, where: str) -> dict | None:
    """One input line as an object with a non-empty list of token ids (None for a blank line).
    JSON's true and false are not token ids, though Python counts them as ints."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{where}: not UTF-8 text; save the file as UTF-8") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg}); fix or remove the line") from None
    ids = row.get("input_ids") if isinstance(row, dict) else None
    if isinstance(ids, list) and any(isinstance(i, bool) for i in ids):
        raise UserError(f'{where}: "input_ids" holds true or false; token ids are ints')
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise UserError(f'{where}: needs a non-empty list of ints under "input_ids"')
    return row


def run_score(
    checkpoint: str,
    input_path: str,
    output_path: str,
    dims: ParallelDims,
    micro_batch_size: int = 8,
) -> int:
    """Score every line of `input_path` into `output_path` (collective); returns the number of
    sequences scored."""
    from megatron.core import parallel_state as mpu

    from megatron_gspo.model.forward import score

    if micro_batch_size < 1:
        raise UserError(f"--micro-batch-size must be >= 1, not {micro_batch_size}")
    out = check_new_output(output_path, "--output")
    spec, meta = checkpoint_spec(checkpoint)
    dims.validate(spec)
    if meta is None:
        from megatron_gspo.hf.io import HFReader

        HFReader(checkpoint)  # a missing or truncated weight file fails before any work
    rows = read_sequences(Path(input_path), spec)
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
        out.parent.mkdir(parents=True, exist_ok=True)
        with temp_file_for(out) as tmp, open(tmp, "w") as f:  # (SIGINT, SIGTERM: removed)
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    return len(rows)
