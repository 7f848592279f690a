"""SGLang's `sampling_params`: parsing with SGLang's defaults, and sampling from logits.

Log-probs follow SGLang's default: for temperature > 0 they are taken from the
temperature-scaled distribution (after penalties and logit bias, before top-k/top-p/min-p
filtering); for greedy requests (temperature 0) from the raw logits.
Constrained decoding (json_schema, regex, ebnf) is not implemented: such requests get a 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_gspo.server.validate import (
    DEFAULT_LIMITS,
    INT32_MAX,
    SEED_END,
    TOP_K_ALL,
    BadRequest,
    Limits,
    flag,
    integer,
    number,
)

if TYPE_CHECKING:
    from megatron_gspo.server.kernels import CompiledDecode

KNOWN_KEYS = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "sampling_seed",
    "min_new_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "json_schema",
    "regex",
    "ebnf",
    "spaces_between_special_tokens",
    "stream_interval",
    "custom_params",
}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )


def parse_sampling_params(
    raw: object, vocab_size: int, limits: Limits = DEFAULT_LIMITS
) -> SamplingParams:
    """Validate a request's `sampling_params` dict as SGLang does: unknown keys are a 400, and so
    is a value of the wrong type or out of range (the message names the key)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be a JSON object")
    unknown = sorted(set(raw) - KNOWN_KEYS)
    if unknown:
        raise BadRequest(f"unknown sampling_params keys: {', '.join(map(str, unknown))}")
    for key in ("json_schema", "regex", "ebnf"):
        if raw.get(key) is not None:
            raise BadRequest(
                f"{key} (constrained decoding) is not supported by the built-in server"
            )
    sp = SamplingParams()
    _fill(sp, {k: v for k, v in raw.items() if v is not None}, vocab_size, limits)
    return sp


# key -> (lowest, highest, lowest excluded): SGLang's ranges, all finite
_FLOATS = {
    "temperature": (0.0, math.inf, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "repetition_penalty": (0.0, 2.0, True),
}
MAX_STOP_STRINGS = 256
MAX_LOGIT_BIAS = 1e9  # beyond it a bias adds nothing, and +/-inf in fp32 logits is a NaN


def _fill(sp: SamplingParams, raw: dict, vocab_size: int, limits: Limits) -> None:
    def key(name: str) -> str:
        return f"sampling_params.{name}"

    for name in ("max_new_tokens", "min_new_tokens"):
        if name in raw:
            setattr(sp, name, integer(raw[name], key(name), 0, INT32_MAX))
    if sp.min_new_tokens > sp.max_new_tokens:  # SGLang's SamplingParams.verify, the default too
        raise BadRequest(
            f"{key('min_new_tokens')} must be in [0, max_new_tokens ({sp.max_new_tokens})], "
            f"got {sp.min_new_tokens}"
        )
    if "n" in raw:
        sp.n = integer(raw["n"], key("n"), 1, limits.max_n)
    if "top_k" in raw:
        sp.top_k = integer(raw["top_k"], key("top_k"), None, None)
        if sp.top_k != -1 and not 1 <= sp.top_k <= TOP_K_ALL:
            raise BadRequest(f"{key('top_k')} must be -1 (off) or in [1, 2^30], got {sp.top_k}")
    if "sampling_seed" in raw:
        sp.sampling_seed = integer(raw["sampling_seed"], key("sampling_seed"), 0, SEED_END - 1)
    for name, (lo, hi, open_lo) in _FLOATS.items():
        if name in raw:
            setattr(sp, name, number(raw[name], key(name), lo, hi, open_lo))
    for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        if name in raw:
            setattr(sp, name, flag(raw[name], key(name)))
    sp.stop = _stop_strings(raw.get("stop", []), key("stop"))
    ids = raw.get("stop_token_ids", [])
    if not isinstance(ids, list):
        raise BadRequest(f"{key('stop_token_ids')} must be a list of token ids")
    top = vocab_size - 1
    sp.stop_token_ids = [integer(t, key("stop_token_ids"), 0, top) for t in ids]
    sp.logit_bias = _logit_bias(raw.get("logit_bias", {}), key("logit_bias"), vocab_size)
    _check_unused(raw, key)


def _check_unused(raw: dict, key) -> None:
    """Keys SGLang takes that change nothing here (no streaming, no custom logit processors,
    no detokenizer spacing option): checked by type all the same, as SGLang does."""
    if "stream_interval" in raw:
        integer(raw["stream_interval"], key("stream_interval"), 1, INT32_MAX)
    if "spaces_between_special_tokens" in raw:
        flag(raw["spaces_between_special_tokens"], key("spaces_between_special_tokens"))
    if "custom_params" in raw and not isinstance(raw["custom_params"], dict):
        raise BadRequest(f"{key('custom_params')} must be a JSON object")


def _stop_strings(stop: object, key: str) -> list[str]:
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest(f"{key} must be a string or a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"{key} holds {len(stop)} strings; at most {MAX_STOP_STRINGS}")
    return stop


def _logit_bias(raw: object, key: str, vocab_size: int) -> dict[int, float]:
    if not isinstance(raw, dict):
        raise BadRequest(f"{key} must be a JSON object of token id -> bias")
    out = {}
    for k, v in raw.items():
        try:
            token = int(k)
        except ValueError:
            raise BadRequest(f"{key} has key {k!r}, not a token id") from None
        token = integer(token, f"{key} key", 0, vocab_size - 1)
        out[token] = number(v, f"{key}[{k!r}]", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return out


def adjust_logits(
    logits_V: torch.Tensor, sp: SamplingParams, context: list[int], output: list[int], eos: set[int]
) -> torch.Tensor:
    """Penalties, logit bias and min_new_tokens on one row of fp32 logits (a new tensor)."""
    x = logits_V.clone()
    if sp.penalised and (output or sp.repetition_penalty != 1.0):
        if output:
            ids, counts = torch.tensor(output).unique(return_counts=True)
            x[ids] -= sp.frequency_penalty * counts.float() + sp.presence_penalty
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(context) | set(output)))
            vals = x[seen]
            x[seen] = torch.where(
                vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty
            )
    for t, b in sp.logit_bias.items():
        x[t] += b
    if len(output) < sp.min_new_tokens:
        banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos)
        if banned:
            x[torch.tensor(sorted(banned))] = float("-inf")
    return x


def sample(
    logits_V: torch.Tensor, sp: SamplingParams, generator: torch.Generator | None
) -> tuple[int, float]:
    """Pick the next token from one row of adjusted fp32 logits; returns (token, logprob)."""
    tokens, logprobs = sample_batch(logits_V[None], [sp], [generator], None)
    return tokens[0], logprobs[0]


def sample_batch(
    logits_BV: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    fallback: torch.Generator | None,
    kernel: CompiledDecode | None = None,
) -> tuple[list[int], list[float]]:
    """Next tokens for a batch of adjusted fp32 logit rows, by inverse-CDF sampling.

    Each sampled row takes one uniform draw u and picks the first token whose cumulative
    (filtered) probability exceeds u times the row's total. A row with its own generator (a
    `sampling_seed`) draws from it alone, so its tokens do not depend on what else is in the
    batch; other rows share `fallback`. With a compiled `kernel`, batches without top-k/top-p/
    min-p filters are sampled by it in one call (the same draws, the same rule).
    """
    B = len(params)
    greedy = [sp.greedy for sp in params]
    rows = [i for i, g in enumerate(greedy) if not g]
    if kernel is not None and not _keep_mask_needed(params):
        if len(rows) == B:
            u_B = _uniforms(generators, fallback)
        else:
            u_B = torch.zeros(B)
            if rows:
                u_B[rows] = _uniforms([generators[i] for i in rows], fallback)
        temps = [0.0 if g else sp.temperature for g, sp in zip(greedy, params)]
        return kernel.sample(logits_BV, temps, u_B)
    temps = [1.0 if g else sp.temperature for g, sp in zip(greedy, params)]
    if all(t == 1.0 for t in temps):
        logp_BV = torch.log_softmax(logits_BV, -1)
    else:
        logp_BV = torch.log_softmax(logits_BV / torch.tensor(temps)[:, None], -1)
    if len(rows) == B:
        tokens_B = _draw(logp_BV, params, generators, fallback)
    else:
        tokens_B = logp_BV.argmax(-1)
        if rows:
            picks = [params[i] for i in rows], [generators[i] for i in rows]
            tokens_B[rows] = _draw(logp_BV[rows], *picks, fallback)
    logprobs_B = logp_BV.gather(1, tokens_B[:, None])[:, 0]
    return tokens_B.tolist(), logprobs_B.tolist()


def _uniforms(generators: list[torch.Generator | None], fallback: torch.Generator | None):
    """One uniform draw per row: rows with their own generator from it, the others from one
    draw of `fallback` for all of them."""
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        return torch.rand(len(generators), generator=fallback)
    u_B = torch.empty(len(generators))
    if shared:
        u_B[shared] = torch.rand(len(shared), generator=fallback)
    for i, g in enumerate(generators):
        if g is not None:
            u_B[i] = torch.rand(1, generator=g)[0]
    return u_B


def _draw(
    logp_BV: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    fallback: torch.Generator | None,
) -> torch.Tensor:
    """One token per row from exp(logp) restricted to the top-k/top-p/min-p filters."""
    probs_BV = logp_BV.exp()
    keep = _keep_mask(probs_BV, params)
    if keep is not None:
        probs_BV = probs_BV.masked_fill_(~keep, 0.0)
    u_B = _uniforms(generators, fallback)
    cdf_BV = torch.cumsum(probs_BV, -1)
    target_B1 = u_B[:, None] * cdf_BV[:, -1:]
    tokens_B = torch.searchsorted(cdf_BV, target_B1, right=True)[:, 0]
    # u * total can round up to the total itself; such a row falls back to its likeliest token
    # (so a token of probability 0 is never picked).
    bad = tokens_B >= logp_BV.shape[1]
    if bad.any():
        tokens_B = torch.where(bad, probs_BV.argmax(-1), tokens_B)
    return tokens_B


def _keep_mask_needed(params: list[SamplingParams]) -> bool:
    """Whether any row filters (top-k, top-p or min-p)."""
    return not all(sp.top_k <= 0 and sp.top_p >= 1 and sp.min_p <= 0 for sp in params)


def _keep_mask(probs_BV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """top-k, top-p and min-p filters (the most likely token always stays); None: keep all."""
    B, V = probs_BV.shape
    if not _keep_mask_needed(params):
        return None
    top_k = torch.tensor([sp.top_k if sp.top_k > 0 else V for sp in params])
    top_p = torch.tensor([sp.top_p for sp in params])
    min_p = torch.tensor([sp.min_p for sp in params])
    sorted_p, order = torch.sort(probs_BV, -1, descending=True)
    keep_sorted = torch.arange(V)[None, :] < top_k[:, None]
    keep_sorted &= (torch.cumsum(sorted_p, -1) - sorted_p) <= top_p[:, None]
    keep_sorted &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
