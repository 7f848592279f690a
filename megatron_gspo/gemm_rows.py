"""A fact about a CPU's BLAS that row-exact numerics rest on, for the trainer's head and the
rollout server alike.

MKL computes a product of fewer than `MIN_GEMM_ROWS` rows with another kernel (a GEMV-like path)
than one of that many or more, and the two round differently; from `MIN_GEMM_ROWS` rows on,
each row of a product has the same bits whatever other rows share it (checked for fp32 at
widths 8-2048, one and two threads). So a row whose bits must not depend on its company is
computed among at least `MIN_GEMM_ROWS` rows: the others real ones or zero padding.
"""

from __future__ import annotations

import torch

MIN_GEMM_ROWS = 4


def at_least_gemm_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` [n, ...] with zero rows appended up to `MIN_GEMM_ROWS` where 0 < n < that (else `x`
    itself); a product's first n rows are then `x`'s."""
    n = x.shape[0]
    if n == 0 or n >= MIN_GEMM_ROWS:
        return x
    return torch.cat([x, x.new_zeros((MIN_GEMM_ROWS - n, *x.shape[1:]))])


def padded_blocks(counts: torch.Tensor, block_of_row: torch.Tensor):
    """Blocks of rows (N rows in block order, `block_of_row` [N] each one's; `counts` [B] rows
    per block) each padded to at least `MIN_GEMM_ROWS` rows, an empty one left empty: where each
    row goes among the padded blocks [N], and the padded blocks' sizes [B]."""
    padded = torch.where(counts > 0, counts.clamp(min=MIN_GEMM_ROWS), counts)
    pad = padded - counts
    before = torch.cumsum(pad, 0) - pad  # padding rows ahead of each block
    return torch.arange(len(block_of_row)) + before[block_of_row], padded
