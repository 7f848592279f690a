"""Per-sample routing on host memory, and the replay targets of one microbatch built from it.

A `SampleRouting` holds one sample's top-k expert ids for the MoE layers of this rank's pipeline
stage only (`layers`, global decoder layer ids), as the smallest integer type that holds an
expert id: uint8 up to 256 experts, int16 up to 32768 (a quarter / half of SGLang's int32).
`recorded` is the trainer's natural routing from the old-log-prob pass ([n, L, k], n = the
sample's tokens); `rollout` the rollout server's (R3, [r, L, k], r = n - 1: the server never
fed the last token).

Legend: n tokens of a sample, L MoE layers of this stage, k top-k, s padded sequence length,
b microbatch rows, N router tokens of this rank (see layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def index_dtype(num_experts: int) -> np.dtype:
    """uint8 up to 256 experts, else int16 (int32 past 32768)."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    return np.dtype(np.int16) if num_experts <= 32768 else np.dtype(np.int32)


def bytes_per_token(num_moe_layers: int, topk: int, num_experts: int) -> int:
    """Stored bytes per token over the whole model: MoE layers x k x itemsize."""
    return num_moe_layers * topk * index_dtype(num_experts).itemsize


@dataclass
class SampleRouting:
    layers: tuple[int, ...]  # global ids of the MoE layers held (this pipeline stage's)
    recorded: np.ndarray | None = None  # [n, L, k] natural routing of the old-log-prob pass
    rollout: np.ndarray | None = None  # [r, L, k] the rollout server's routing (R3)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.recorded, self.rollout) if a is not None)


def microbatch_targets(
    rows: list[np.ndarray | None],
    cols: list[int],
    positions: np.ndarray,
    topk: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """int64 [L, N, k]: `cols` (columns of the per-sample [n, L_stage, k] arrays) of microbatch
    `rows` (None: an empty row) at this rank's sequence `positions`, in router token order; -1
    where there is no id (padding, a sample's last token under R3): those positions route
    naturally (taps.py), so they match an unreplayed forward of the same microbatch."""
    b, s_loc, n_cols = len(rows), len(positions), len(cols)
    ids = np.full((n_cols, s_loc, b, topk), -1, dtype=np.int64)
    for r, arr in enumerate(rows):
        if arr is None:
            continue
        sel = positions < arr.shape[0]
        ids[:, sel, r] = arr[positions[sel]][:, cols].transpose(1, 0, 2)
    return torch.from_numpy(ids.reshape(n_cols, s_loc * b, topk)).to(device)
