"""The built-in server's KV cache: per layer k/v tensors, grown in blocks on demand."""

from __future__ import annotations

import torch

from megatron_gspo.hf.config import ModelSpec

# KV-cache capacity grows in blocks of this many positions; a tight capacity keeps the rows a
# decode step reads close together in memory (measured faster than doubling from 256 on CPU).
_CACHE_BLOCK = 64


class KVCache:
    """Per layer k/v tensors [slots, G, capacity, Dh]; grown (copied) on demand."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, slots: int = 8, capacity: int = 256):
        self.spec, self.dtype = spec, dtype
        self.slots, self.capacity = 0, 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.ensure(slots, capacity)

    def ensure(self, slots: int, capacity: int) -> None:
        if slots <= self.slots and capacity <= self.capacity:
            return
        new_s = max(slots, self.slots)
        new_c = self.capacity
        if capacity > self.capacity:  # a quarter more at least, rounded up to a whole block
            grown = max(capacity, self.capacity + self.capacity // 4)
            new_c = -(-grown // _CACHE_BLOCK) * _CACHE_BLOCK
        shape = (new_s, self.spec.num_kv_heads, new_c, self.spec.head_dim)
        layers = self.spec.num_layers
        k = [torch.zeros(shape, dtype=self.dtype) for _ in range(layers)]
        v = [torch.zeros(shape, dtype=self.dtype) for _ in range(layers)]
        for old, new in ((self.k, k), (self.v, v)):
            for o, n in zip(old, new):
                n[: o.shape[0], :, : o.shape[2]] = o
        self.k, self.v, self.slots, self.capacity = k, v, new_s, new_c

    @torch.inference_mode()  # the tensors may have been made by a forward (inference tensors)
    def copy_prefix(self, src: int, dst: list[int], n: int) -> None:
        """Copy the first n positions of slot src into each slot of dst, in every layer.

        The source rows are cloned first: they are a view of the tensor written to, and torch
        refuses an indexed write from a view of its own target whenever it can tell that the two
        share memory (when n is the whole capacity: a prompt as long as the cache), as it cannot
        prove that the write leaves what it reads alone."""
        self.ensure(max(dst) + 1, n)
        for t in (*self.k, *self.v):
            t[dst, :, :n] = t[src, :, :n].clone()
