"""Where a microbatch's tokens sit on a rank, in the order megatron's router sees them.

The router flattens its input [s_local, b, hidden] sequence-major: router token j is sequence
position positions[j // b] of microbatch row j % b. `positions` are the sequence positions this
rank holds: all of them, or under context parallelism (cp ranks) the load-balanced pair of chunks
megatron gives each cp rank (the sequence cut into 2*cp chunks; rank r holds chunks r and
2*cp - 1 - r), then under sequence parallelism (tp ranks) the tp_rank-th of tp equal contiguous
parts of that.

Legend: s padded sequence length, b microbatch rows, N = len(positions) * b router tokens,
L MoE layers, k top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLayout:
    tp_rank: int = 0
    tp: int = 1
    sequence_parallel: bool = False
    cp_rank: int = 0
    cp: int = 1

    def positions(self, seq_len: int) -> np.ndarray:
        """The sequence positions this rank's router sees, in its order."""
        pos = np.arange(seq_len)
        if self.cp > 1:
            chunks = np.array_split(pos, 2 * self.cp)
            pos = np.concatenate([chunks[self.cp_rank], chunks[2 * self.cp - 1 - self.cp_rank]])
        if self.sequence_parallel and self.tp > 1:
            pos = np.array_split(pos, self.tp)[self.tp_rank]
        return pos

    @property
    def counts_tokens(self) -> bool:
        """Whether this rank's router tokens are its own (not a TP duplicate): with tp > 1 and no
        sequence parallelism every TP rank routes the same tokens, so only TP rank 0 counts."""
        return self.sequence_parallel or self.tp == 1 or self.tp_rank == 0


def token_map(mb, layout: TokenLayout) -> tuple[np.ndarray, np.ndarray]:
    """(sample row, position) of each of this rank's router tokens of microbatch `mb`, in
    router order (-1, -1: padding or an empty row). A padded microbatch [b, s]: token j is
    position positions[j // b] of row j % b. A packed one [1, t] (train/packing.py) maps its
    packed positions to its sequences' (its `token_map`)."""
    b, s = mb.tokens.shape
    positions = layout.positions(s)
    if hasattr(mb, "token_map"):
        return mb.token_map(positions)
    index = mb.index.cpu().numpy().astype(np.int64)
    rows = np.tile(index, len(positions))
    pos = np.repeat(positions, b)
    return rows, np.where(rows >= 0, pos, -1)


def current_layout(sequence_parallel: bool) -> TokenLayout:
    """This rank's layout from megatron's parallel state."""
    from megatron.core import parallel_state as mpu

    return TokenLayout(
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        tp=mpu.get_tensor_model_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        cp_rank=mpu.get_context_parallel_rank(),
        cp=mpu.get_context_parallel_world_size(),
    )
