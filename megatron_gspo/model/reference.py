"""The reference policy of a KL penalty: the run's starting weights, frozen, in the actor's layout.

A reference model is usually a second model. Here it is a second copy of the weights only: the
policy's own model chunks run the reference forward with the reference values swapped into their
parameters, then swapped back (slime keeps its reference the same way). So the reference has the
policy's layout on every parallelism (TP, PP/VPP, EP shards) by construction, costs one copy of
the parameters (in the model's dtype; no gradients, no optimizer state) and nothing when the KL
is off (no `ReferenceWeights` is made).

The swap exchanges values tensor by tensor through a temporary of one parameter, so the policy's
values come back bit for bit and the transient memory is one parameter's. With `offload` the
reference copy lives in (pinned) host memory between uses (`algo.ref_offload`): on a GPU that
frees one model's worth of device memory for two host<->device copies per use.

The copy is taken from the chunks as built from the run's starting checkpoint, before a resume
loads a training checkpoint into them; so on resume the reference is again the run's recorded
starting model, never a checkpoint of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _params(chunks) -> list[torch.Tensor]:
    return [p for c in chunks for p in c.parameters()]


class ReferenceWeights:
    """A frozen copy of the chunks' parameters; `swapped_in(chunks)` runs code under it."""

    def __init__(self, chunks, offload: bool = False):
        self.offload = offload
        pin = offload and torch.cuda.is_available()
        self.saved: list[torch.Tensor] = []
        with torch.no_grad():
            for p in _params(chunks):
                if offload:
                    copy = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                    copy.copy_(p.detach())
                else:
                    copy = p.detach().clone()
                self.saved.append(copy)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved)

    def _exchange(self, chunks) -> None:
        params = _params(chunks)
        if len(params) != len(self.saved):
            raise RuntimeError("the reference weights were taken from another model layout")
        with torch.no_grad():
            for p, ref in zip(params, self.saved, strict=True):
                held = p.detach().to(ref.device, copy=True)
                p.detach().copy_(ref, non_blocking=False)
                ref.copy_(held)

    @contextmanager
    def swapped_in(self, chunks) -> Iterator[None]:
        """The chunks hold the reference values inside the block, the policy's after it (also
        when the block raises)."""
        self._exchange(chunks)
        try:
            yield
        finally:
            self._exchange(chunks)
