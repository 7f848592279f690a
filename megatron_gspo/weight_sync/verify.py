"""Verification: the servers' log-probs of a fixed probe batch against the trainer's.

The probe is a few random token sequences fixed by the config's seed. The trainer scores it with
`model.forward.score` (every rank, a collective); the coordinator asks each server for the same
sequences' prompt log-probs (/generate, `logprob_start_len: 0`, one greedy token) and compares
token by token. A server on another weight_version than the one just synced also fails.
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


@dataclass
class ProbeResult:
    url: str
    version: str | None = None
    max_diff: float | None = None
    error: str | None = None


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
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if len(x) != len(y):
            return float("inf")
        for u, v in zip(x[1:], y[1:]):
            worst = max(worst, abs(float(u) - float(v)))
    return worst


def check_servers(
    servers: Servers, indices: list[int], seqs: list[list[int]], reference: list
) -> list[ProbeResult]:
    results = []
    for i in indices:
        r = ProbeResult(servers.url(i))
        try:
            got, r.version = server_logprobs(servers, i, seqs)
            r.max_diff = max_abs_diff(got, reference)
        except Exception as e:  # noqa: BLE001 - reported per server
            r.error = f"{type(e).__name__}: {e}"
        results.append(r)
    return results


def problems(results: list[ProbeResult], version: str | None, tolerance: float) -> list[str]:
    out = []
    for r in results:
        if r.error:
            out.append(f"{r.url}: probe failed: {r.error}")
        elif version is not None and r.version != version:
            out.append(f"{r.url}: serves weight_version {r.version!r}, expected {version!r}")
        elif not r.max_diff <= tolerance:
            out.append(
                f"{r.url}: probe log-probs differ from the trainer's by {r.max_diff:.3g} "
                f"> tolerance {tolerance:g}; the server's weights are not the trainer's"
            )
    return out
