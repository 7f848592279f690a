"""The request floor of one RL step's rollout: real SGLang against the built-in server, each
started as the trainer starts it (rollout/server_config.py), on the tiny task model.

A step of the tiny configs is 8 prompts x 8 samples of a few tokens, so its rollout time is
almost all per-request cost (HTTP, tokenizer manager, scheduler passes), not compute. Each server
gets the same step sent two ways, side by side over --reps (harness.measure, after 3 warm-up calls
each): as 8 concurrent requests of one prompt group each (`rollout.group_requests`, the trainer's
way), and as one request of all 64 samples. Prints the median wall time of each, the ratio SGLang /
built-in of each way, and what one request per step would save.

    .venv/bin/python bench/bench_request_floor.py --model runs/task_model [--reps 15]
        [--sglang-python ~/.cache/megatron-gspo/sglang-venv/bin/python] [--new-tokens 3]
        [--json OUT]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

# (bench/ on the path)
from harness import Result, Variant, finish, markdown_table, measure, parser

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


def time_server(server: ServerConfig, reps: int, new: int, logs: Path) -> Result:
    """The two ways side by side on one server: each sample the step's wall seconds."""
    with ServerGroup([server], logs / server.kind, health_timeout_s=300) as group:
        url = group.urls[0]
        ways = [Variant(w, lambda g=g: {"seconds": asyncio.run(_step(url, g, new))})
                for w, g in (("groups", True), ("one", False))]  # fmt: skip
        return measure(ways, reps, warmup=3, name=f"request_floor {server.kind}")


def main() -> None:
    ap = parser(__doc__, reps=15, warmup=None)
    ap.add_argument("--model", required=True)
    default = Path.home() / ".cache" / "megatron-gspo" / "sglang-venv" / "bin" / "python"
    ap.add_argument("--sglang-python", default=str(default))
    ap.add_argument("--new-tokens", type=int, default=3)
    a = ap.parse_args()
    cfg = load_config(ROOT / "configs" / "tiny_moe_gspo.yaml", [f"model.path={a.model}"])
    builtin = ServerConfig(model_path=a.model, threads=1)
    sglang = ServerConfig(model_path=a.model, kind="sglang", python=a.sglang_python)
    size_sglang(sglang, cfg, Path(a.model), longest_prompt=16, gpu=False)
    res = Result("request_floor")
    with tempfile.TemporaryDirectory() as logs:
        for s in (builtin, sglang):
            res.include(time_server(s, a.reps, a.new_tokens, Path(logs)), s.kind)
    print(f"one step: {PROMPTS} prompts x {GROUP} samples x {a.new_tokens} new tokens")
    rows = [[k, f"{res.median(f'{k} groups'):.4f}s", f"{res.median(f'{k} one'):.4f}s"]
            for k in ("builtin", "sglang")]  # fmt: skip
    print(markdown_table(["server", "8 group requests", "1 request"], rows))
    for way in ("groups", "one"):
        print(f"sglang / builtin, {way}: {res.ratio(f'sglang {way}', f'builtin {way}'):.2f}x")
    saved = res.median("sglang groups") - res.median("sglang one")
    print(f"one request per step would save SGLang {saved * 1000:.1f} ms a step")
    finish(res, a)


if __name__ == "__main__":
    main()
