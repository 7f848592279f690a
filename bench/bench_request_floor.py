"""The request floor of one RL step's rollout: real SGLang against the built-in server, each
started as the trainer starts it (rollout/server_config.py), on the tiny task model.

A step of the tiny configs is 8 prompts x 8 samples of a few tokens, so its rollout time is
almost all per-request cost (HTTP, tokenizer manager, scheduler passes), not compute. Each
server gets the same step sent two ways, interleaved over --reps: as 8 concurrent requests of one
prompt group each (`rollout.group_requests`, the trainer's way), and as one request of all 64
samples. Prints the median wall time of each, the ratio SGLang / built-in of each way, and what
one request per step would save.

    .venv/bin/python bench/bench_request_floor.py --model runs/task_model [--reps 15]
        [--sglang-python ~/.cache/megatron-gspo/sglang-venv/bin/python] [--new-tokens 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_gspo.config import load_config  # noqa: E402
from megatron_gspo.rollout.launcher import ServerConfig, ServerGroup  # noqa: E402
from megatron_gspo.rollout.server_config import size_sglang  # noqa: E402

PROMPTS, GROUP = 8, 8


async def _post(session, url: str, items: list[tuple[list[int], int]], new: int) -> None:
    body = {
        "input_ids": [p for p, _ in items],
        "sampling_params": [
            {"max_new_tokens": new, "temperature": 1.0, "sampling_seed": seed} for _, seed in items
        ],
        "return_logprob": True,
    }
    async with session.post(url + "/generate", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:200]}")
        await r.read()


async def _step(url: str, grouped: bool, new: int) -> float:
    items = [([5 + i, 6, 7, 8, 9], 100 * i + j) for i in range(PROMPTS) for j in range(GROUP)]
    async with aiohttp.ClientSession() as s:
        t = time.perf_counter()
        if grouped:
            groups = [items[GROUP * i : GROUP * (i + 1)] for i in range(PROMPTS)]
            await asyncio.gather(*(_post(s, url, g, new) for g in groups))
        else:
            await _post(s, url, items, new)
        return time.perf_counter() - t


def measure(server: ServerConfig, reps: int, new: int, logs: Path) -> dict[str, float]:
    with ServerGroup([server], logs / server.kind, health_timeout_s=300) as group:
        url = group.urls[0]
        for _ in range(3):  # warm up both paths
            asyncio.run(_step(url, True, new))
            asyncio.run(_step(url, False, new))
        times: dict[str, list[float]] = {"groups": [], "one": []}
        for _ in range(reps):
            times["groups"].append(asyncio.run(_step(url, True, new)))
            times["one"].append(asyncio.run(_step(url, False, new)))
    return {way: statistics.median(v) for way, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    default = Path.home() / ".cache" / "megatron-gspo" / "sglang-venv" / "bin" / "python"
    ap.add_argument("--sglang-python", default=str(default))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--new-tokens", type=int, default=3)
    a = ap.parse_args()
    cfg = load_config(ROOT / "configs" / "tiny_moe_gspo.yaml", [f"model.path={a.model}"])
    builtin = ServerConfig(model_path=a.model, threads=1)
    sglang = ServerConfig(model_path=a.model, kind="sglang", python=a.sglang_python)
    size_sglang(sglang, cfg, Path(a.model), longest_prompt=16, gpu=False)
    with tempfile.TemporaryDirectory() as logs:
        med = {s.kind: measure(s, a.reps, a.new_tokens, Path(logs)) for s in (builtin, sglang)}
    print(f"one step: {PROMPTS} prompts x {GROUP} samples x {a.new_tokens} new tokens")
    print(f"{'server':10s} {'8 group requests':>18s} {'1 request':>10s}")
    for kind, m in med.items():
        print(f"{kind:10s} {m['groups']:17.4f}s {m['one']:9.4f}s")
    for way in ("groups", "one"):
        print(f"sglang / builtin, {way}: {med['sglang'][way] / med['builtin'][way]:.2f}x")
    saved = med["sglang"]["groups"] - med["sglang"]["one"]
    print(f"one request per step would save SGLang {saved * 1000:.1f} ms a step")


if __name__ == "__main__":
    main()
