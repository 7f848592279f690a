"""Verification: the servers' log-probs of a fixed probe batch against the trainer's.

The probe is a few random token sequences fixed by the config's seed. The trainer scores it with
`model.forward.score` (every rank, a collective); the coordinator asks each server for the same
sequences' prompt log-probs (/generate, `logprob_start_len: 0`, one greedy token) and compares
token by token. A server on another weight_version than the one just synced also fails.

The test is the mean |server - trainer| log-prob over the probe's tokens against a tolerance
that follows the server's numerics (its dtype, from /get_server_info; `sync.verify_tolerance`
overrides it): an fp32 server reproduces the fp32 trainer to ~1e-6, while a 16-bit one differs
by rounding alone, most on the rare tokens a random probe is full of. Measured on the task
models here (2 and 6 MoE layers, built-in server): bf16 mean 0.09-0.10 (max 1.3-2.7), fp16 mean
0.005-0.013 (max 0.05-0.64); the default tolerance is 100 x the dtype's unit roundoff (bf16
0.39, fp16 0.049), a few times those means, while wrong weights move the mean by far more. The
max is reported, not tested: for 16-bit servers it is a rounding outlier. A server that reports
`quantization: fp8` (rollout.quantization; SGLang's server args say it the same way) is held to
1.5 whatever its dtype: its probe means were 0.30-0.40 on the same models (bf16, fp16 and fp32
compute).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gspo.weight_sync.config import SyncConfig
from megatron_gspo.weight_sync.servers import Servers


def probe_batch(vocab_size: int, config: SyncConfig) -> list[list[int]]:
    g = torch.Generator().manual_seed(config.probe_seed)
    lengths = [max(2, config.probe_length - 5 * i) for i in range(config.probe_sequences)]
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


# unit roundoff: 2^-(mantissa bits + 1)
DTYPE_TOLERANCE = {
    "float32": 1e-4,
    "float16": 100 * 2.0**-11,
    "bfloat16": 100 * 2.0**-8,
    "fp8": 1.5,  # fp8 weights (quantization), any compute dtype
}
_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


@dataclass
class ProbeResult:
    url: str
    version: str | None = None
    max_diff: float | None = None
    error: str | None = None
    mean_diff: float | None = None
    dtype: str | None = None  # the server's, as it reports it (None: it did not say)


def server_logprobs(servers: Servers, i: int, seqs: list[list[int]]) -> tuple[list, str]:
    """Per-token prompt log-probs of `seqs` on server i (first entry None), and its version."""
    body = {
        "input_ids": seqs,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    out = servers.post(i, "/generate", body)
    items = out["data"] if "data" in out else [out]
    logprobs = [[e[0] for e in item["meta_info"]["input_token_logprobs"]] for item in items]
    versions = {str(item["meta_info"].get("weight_version")) for item in items}
    return logprobs, ",".join(sorted(versions))


def max_abs_diff(a: list[list[float | None]], b: list[list[float | None]]) -> float:
    return abs_diffs(a, b)[0]


def abs_diffs(a: list[list[float | None]], b: list[list[float | None]]) -> tuple[float, float]:
    """(max, mean) |a - b| over the tokens (the first of each sequence has no log-prob)."""
    worst, total, n = 0.0, 0.0, 0
    for x, y in zip(a, b, strict=True):
        if len(x) != len(y):
            return float("inf"), float("inf")
        for u, v in zip(x[1:], y[1:]):
            d = abs(float(u) - float(v))
            worst, total, n = max(worst, d), total + d, n + 1
    return worst, total / max(n, 1)


def server_dtype(servers: Servers, i: int) -> str | None:
    """The dtype server i computes in, by its /get_server_info (None: "auto" or not said), or
    fp8 when it quantizes its weights so."""
    try:
        info = servers.get(i, "/get_server_info")
    except Exception:  # noqa: BLE001 - an older server: the tolerance falls back
        return None
    if str(info.get("quantization") or "").lower() == "fp8":
        return "fp8"
    name = str(info.get("dtype") or "").removeprefix("torch.").lower()
    name = _DTYPE_NAMES.get(name, name)
    return name if name in DTYPE_TOLERANCE else None


def tolerance_for(dtype: str | None, configured: float | None) -> tuple[float, str]:
    """The tolerance a server is held to, and where it comes from (for the message)."""
    if configured is not None:
        return configured, "sync.verify_tolerance"
    if dtype is None:
        return DTYPE_TOLERANCE["bfloat16"], "its dtype unknown: bfloat16's"
    return DTYPE_TOLERANCE[dtype], f"{dtype}'s"


def check_servers(
    servers: Servers, indices: list[int], seqs: list[list[int]], reference: list
) -> list[ProbeResult]:
    results = []
    for i in indices:
        r = ProbeResult(servers.url(i))
        try:
            got, r.version = server_logprobs(servers, i, seqs)
            r.max_diff, r.mean_diff = abs_diffs(got, reference)
            r.dtype = server_dtype(servers, i)
        except Exception as e:  # noqa: BLE001 - reported per server
            r.error = f"{type(e).__name__}: {e}"
        results.append(r)
    return results


def problems(
    results: list[ProbeResult], version: str | None, tolerance: float | None = None
) -> list[str]:
    """What is wrong with each server's probe (none: every one passed). `tolerance` None: by
    each server's dtype."""
    out = []
    for r in results:
        if r.error:
            out.append(f"{r.url}: probe failed: {r.error}")
            continue
        if version is not None and r.version != version:
            out.append(f"{r.url}: serves weight_version {r.version!r}, expected {version!r}")
            continue
        tol, source = tolerance_for(r.dtype, tolerance)
        mean = r.mean_diff if r.mean_diff is not None else r.max_diff
        if not mean <= tol:
            dtype = r.dtype or "unknown-dtype"
            out.append(
                f"{r.url}: its probe log-probs differ from the trainer's by {mean:.3g} on "
                f"average (max {r.max_diff:.3g}), above the tolerance {tol:.3g} ({source}). "
                "Its weights may not be the trainer's (a failed or partial update), or its "
                f"numerics ({dtype}) differ from the trainer's more than rounding explains; "
                "if they are known to, raise sync.verify_tolerance"
            )
    return out
