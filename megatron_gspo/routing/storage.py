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


class SampleRouting:
    """One sample's routing for this stage's MoE layers (`layers`, global ids).

    recorded: [n, L, k] the natural routing of the old-log-prob pass.
    rollout:  [r, L, k] the rollout server's routing (R3), r = n - 1 (or n).
    Under R3 `recorded` is kept as a patch on `rollout`: one bit per (token, layer) saying whether
    the two top-k SETS differ, and the recorded ids where they do (where they agree the rollout's
    ids come back, maybe in another order: replay and drift only use the set). Where the engines mostly agree that costs
    a small fraction of a second full array: (L/8 + f L k itemsize) bytes per token for a share
    f of differing positions, against L k itemsize."""

    def __init__(self, layers, recorded: np.ndarray | None = None, rollout=None):
        self.layers: tuple[int, ...] = tuple(layers)
        self.rollout: np.ndarray | None = rollout
        # R3: [n] bool, position p's trainer routing (natural, in the old-log-prob pass) differs
        # from the rollout server's in at least one MoE layer of the whole model
        self.rollout_differs: np.ndarray | None = None
        self._full: np.ndarray | None = None
        self._patch: tuple[tuple[int, ...], np.ndarray, np.ndarray] | None = (
            None  # shape, bits, ids
        )
        self.recorded = recorded

    @property
    def recorded(self) -> np.ndarray | None:
        if self._patch is None:
            return self._full
        shape, bits, ids = self._patch
        out = self._base(shape[0])
        flat = out.reshape(-1, shape[-1])
        flat[np.unpackbits(bits, count=len(flat)).astype(bool)] = ids
        return out

    @recorded.setter
    def recorded(self, arr: np.ndarray | None) -> None:
        if arr is None or self.rollout is None:
            self._full, self._patch = arr, None
            return
        k = arr.shape[-1]
        flat = arr.reshape(-1, k)
        base = self._base(arr.shape[0]).reshape(-1, k)
        differs = (np.sort(flat, axis=-1) != np.sort(base, axis=-1)).any(-1)
        self._full, self._patch = None, (arr.shape, np.packbits(differs), flat[differs])

    @property
    def has_recorded(self) -> bool:
        return self._full is not None or self._patch is not None

    def _base(self, n: int) -> np.ndarray:
        r = self.rollout
        out = np.zeros((n, *r.shape[1:]), dtype=r.dtype)
        out[: min(n, len(r))] = r[:n]
        return out

    @property
    def nbytes(self) -> int:
        parts = [self.rollout, self._full, *(self._patch[1:] if self._patch else ())]
        return sum(a.nbytes for a in parts if a is not None)


def microbatch_targets(
    arrays: dict[int, np.ndarray | None],
    rows_N: np.ndarray,
    pos_N: np.ndarray,
    cols: list[int],
    topk: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """int64 [L, N, k]: `cols` (columns of the per-sample [n, L_stage, k] arrays) at each router
    token's (sample row `rows_N`, position `pos_N`) (layout.token_map); -1 where there is no id
    (padding, row -1, a sample's last token under R3): those positions route naturally
    (taps.py), so they match an unreplayed forward of the same microbatch."""
    ids = np.full((len(cols), len(rows_N), topk), -1, dtype=np.int64)
    for i in np.unique(rows_N[rows_N >= 0]).tolist():
        arr = arrays.get(i)
        if arr is None:
            continue
        sel = (rows_N == i) & (pos_N < arr.shape[0])
        ids[:, sel] = arr[pos_N[sel]][:, cols].transpose(1, 0, 2)
    return torch.from_numpy(ids).to(device)
