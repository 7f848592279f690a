"""The engine's sampling step: one token for each request from its row of logits (penalties and
logit bias where asked, the batched draw, a row-by-row fallback), and whether it stops."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from megatron_gspo.server.model import RolloutModel
from megatron_gspo.server.request import Request
from megatron_gspo.server.sampling import adjust_logits, sample_batch

log = logging.getLogger("megatron_gspo.server.engine")


class SamplingSteps:
    """The sampling half of `Engine` (its base class); the engine provides these."""

    model: RolloutModel
    eos_ids: set[int]
    decode: Callable[[list[int]], str] | None
    context_len: int
    generator: torch.Generator

    def _fail(self, req: Request, message: str) -> None:
        raise NotImplementedError

    def _finish(self, req: Request, reason: dict) -> None:
        raise NotImplementedError

    def _sample(self, reqs: list[Request], logits_BV: torch.Tensor) -> None:
        """Sample one token for each request from its row of logits; finish those that stop."""
        if any(r.params.max_new_tokens == 0 for r in reqs):
            keep = [i for i, r in enumerate(reqs) if r.params.max_new_tokens > 0]
            for req in reqs:
                if req.params.max_new_tokens == 0:
                    self._finish(req, {"type": "length", "length": 0})
            reqs, logits_BV = [reqs[i] for i in keep], logits_BV[keep]
        if not reqs:
            return
        reqs, logits_BV = self._adjust(reqs, logits_BV)
        for req, token, logprob in zip(reqs, *self._draw(reqs, logits_BV)):
            if token is None:  # failed in _draw
                continue
            if math.isnan(logprob):  # the validation should make this impossible: a bug
                self._fail(req, "sampling failed: the token's log-prob is NaN")
                continue
            req.output_ids.append(token)
            req.output_logprobs.append(logprob)
            n, sp = len(req.output_ids), req.params
            may_stop = (token in req.stop_ids or bool(sp.stop)) and n >= sp.min_new_tokens
            if may_stop or n >= req.limit:  # the full check only where it can stop
                reason = self._stop_reason(req, token)
                if reason is not None:
                    self._finish(req, reason)

    def _adjust(self, reqs: list[Request], logits_BV: torch.Tensor):
        """Penalties, logit bias and min_new_tokens on the rows that need them; a request whose
        adjustment fails is failed and left out."""
        adjust = [
            i
            for i, r in enumerate(reqs)
            if r.adjusted or len(r.output_ids) < r.params.min_new_tokens
        ]
        if not adjust:
            return reqs, logits_BV
        logits_BV = logits_BV.clone()
        for i in adjust:
            r = reqs[i]
            try:
                logits_BV[i] = adjust_logits(
                    logits_BV[i], r.params, r.input_ids, r.output_ids, self.eos_ids
                )
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self._fail(r, f"sampling failed: {type(e).__name__}: {e}")
        keep = [i for i, r in enumerate(reqs) if r.error is None]
        if len(keep) < len(reqs):
            return [reqs[i] for i in keep], logits_BV[keep]
        return reqs, logits_BV

    def _draw(self, reqs: list[Request], logits_BV: torch.Tensor) -> tuple[list, list]:
        """Tokens and log-probs for the batch; should a request's parameters break the batched
        draw, row by row, with None as the token of the rows that fail."""
        args = [r.params for r in reqs], [r.generator for r in reqs]
        try:
            return sample_batch(logits_BV, *args, self.generator, self.model.decode_kernel)
        except Exception:  # noqa: BLE001 - find the row that did it
            log.exception("batched sampling failed; sampling row by row")
        tokens, logprobs = [], []
        for i, r in enumerate(reqs):
            try:
                [t], [lp] = sample_batch(
                    logits_BV[i : i + 1], [r.params], [r.generator], self.generator
                )
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                t, lp = None, math.nan
                self._fail(r, f"sampling failed: {type(e).__name__}: {e}")
            tokens.append(t)
            logprobs.append(lp)
        return tokens, logprobs

    def _stop_reason(self, req: Request, token: int) -> dict | None:
        sp, n = req.params, len(req.output_ids)
        if n >= sp.min_new_tokens:
            if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_ids):
                return {"type": "stop", "matched": token}
            if sp.stop and self.decode is not None:
                text = self.decode(req.output_ids)
                for s in sp.stop:
                    if s and s in text:
                        return {"type": "stop", "matched": s}
        if n >= sp.max_new_tokens or len(req.input_ids) + n >= self.context_len:
            return {"type": "length", "length": n}
        return None
