"""Start this node's rollout servers (or the sglang-router in front of all of them) and hold them.

    python launch/serve_node.py servers --config CFG --node-rank R --host H --log-dir DIR \
        --urls-file FILE [layout flags as launch/plan.py] [key.sub=value ...]
    python launch/serve_node.py router --worker-urls U1 U2 ... --host H --port P \
        --log-dir DIR --urls-file FILE

`servers` starts the servers the layout (launch/plan.py) gives this node, each on its own GPUs
(CUDA_VISIBLE_DEVICES; a colocated SGLang server sees the node's GPUs and starts at its own with
--base-gpu-id, so that it can open the trainer's CUDA IPC handles), through
rollout.launcher.ServerGroup: each in its own process group, tracked by PID, its output in
LOG_DIR/server-<i>.log. When every one answers /health their URLs are written to URLS_FILE
(atomically: the trainer nodes wait for it). Then it holds them:

- SIGTERM / SIGINT: stop every server by PID (SIGTERM, then SIGKILL) and exit 0;
- a server that exits: stop the others and exit 1 with a one-line message naming its log.
  Servers are not restarted here: one restarted from the base model would serve stale weights
  until the next sync without the trainer knowing; the job stops and resumes from a checkpoint.

`router` does the same for `python -m sglang_router.launch_router` in front of several SGLang
servers (SGLANG_PYTHON, the python of SGLang's environment, runs it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan import add_layout_args, check_model, check_server_modes, layout_from_args  # noqa: E402

from megatron_gspo.comm import free_port  # noqa: E402
from megatron_gspo.errors import UserError  # noqa: E402
from megatron_gspo.no_redirect import OPENER, is_redirect, redirect_refusal  # noqa: E402
from megatron_gspo.rollout.modes import Backend, Placement  # noqa: E402
from megatron_gspo.rollout.server_config import (  # noqa: E402
    API_KEY_ENV,
    check_sglang_python,
    sglang_python,
)
from megatron_gspo.routing.modes import ReplayMode  # noqa: E402


class Stop(Exception):
    """SIGTERM / SIGINT: leave the hold loop and stop everything."""


def _on_signal(signum, frame) -> None:
    raise Stop(signal.Signals(signum).name)


def server_configs(cfg, layout, node_rank: int, host: str, port_base: int):
    from megatron_gspo.model.policy import hf_files_dir
    from megatron_gspo.rollout.launcher import ServerConfig

    r = cfg.rollout
    extra = list(r.extra_server_args)
    gpu_sets = layout.server_gpus(node_rank)
    visible = _visible_devices()
    memory_saver = (
        r.backend == Backend.SGLANG
        and layout.placement == Placement.COLOCATED
        and r.release_memory
        and layout.gpus_per_node > 0
        and "--enable-memory-saver" not in extra
    )
    # A colocated SGLang server sees all of the node's GPUs and starts at its own
    # (--base-gpu-id): the tensor sync hands it CUDA IPC handles of the trainer ranks' GPUs,
    # which it can open only if it sees them. Otherwise each server sees its own GPUs alone.
    see_node = r.backend == Backend.SGLANG and layout.placement == Placement.COLOCATED
    configs = []
    for i, gpus in enumerate(gpu_sets):
        seen = range(layout.gpus_per_node) if see_node else gpus
        env = {"CUDA_VISIBLE_DEVICES": ",".join(visible[g] for g in seen)} if gpus else {}
        configs.append(
            ServerConfig(
                model_path=str(hf_files_dir(cfg.model.path)),
                kind=r.backend,
                host=host,
                port=port_base + i if port_base else 0,
                python=sglang_python(r.sglang_python)
                if r.backend == Backend.SGLANG
                else sys.executable,
                api_key=os.environ.get(API_KEY_ENV) or None,
                enable_return_routed_experts=cfg.algo.routing_replay == ReplayMode.R3,
                tp_size=r.server_tp,
                enable_memory_saver=memory_saver,
                base_gpu_id=gpus[0] if gpus and see_node else None,
                threads=1 if r.backend == Backend.BUILTIN else 0,
                extra_args=extra,
                env=env,
            )
        )
    return configs


def _visible_devices() -> list[str]:
    """Node GPU index -> the id to put in CUDA_VISIBLE_DEVICES (Slurm may have narrowed it)."""
    current = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [d for d in current.split(",") if d.strip()]
    return ids if ids else [str(i) for i in range(1024)]


def write_urls(path: Path, urls: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(u + "\n" for u in urls))
    tmp.replace(path)


def cmd_servers(args) -> int:
    from megatron_gspo.rollout.launcher import ServerFailed, ServerGroup

    cfg, layout = layout_from_args(args)
    if not 0 <= args.node_rank < layout.nnodes:
        raise UserError(
            f"--node-rank {args.node_rank} is not a node of this {layout.nnodes}-node job"
        )
    if args.node_rank not in layout.serving_nodes:
        raise UserError(f"node {args.node_rank} serves nothing in this layout ({layout.placement})")
    _check_port("--port-base", args.port_base, last=args.port_base + layout.servers_per_node - 1)
    check_model(cfg)
    check_server_modes(cfg, layout)
    configs = server_configs(cfg, layout, args.node_rank, args.host, args.port_base)
    if cfg.rollout.backend == Backend.SGLANG:
        check_sglang_python(configs[0].python)
    group = ServerGroup(
        configs, args.log_dir, health_timeout_s=cfg.rollout.health_timeout_s, monitor=False
    )
    try:
        group.start()
    except ServerFailed as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        head = lines[0].removesuffix(" ends with:").rstrip(";")
        last = f"; it ends with: {lines[-1].strip()}" if len(lines) > 1 else ""
        print(f"error: node {args.node_rank}: {head}{last}", file=sys.stderr)
        return 1
    try:
        write_urls(Path(args.urls_file), group.urls)
        pids = ", ".join(str(s.pid) for s in group.servers)
        print(f"node {args.node_rank}: {len(configs)} {cfg.rollout.backend} server(s) ready "
              f"(pids {pids}): {' '.join(group.urls)}", flush=True)  # fmt: skip
        while True:
            for s in group.servers:
                if not s.alive():
                    print(f"error: node {args.node_rank}: rollout server {s.index} (pid {s.pid}) "
                          f"exited with code {s.proc.returncode}; see {s.log_path}",
                          file=sys.stderr)  # fmt: skip
                    return 1
            time.sleep(1.0)
    except Stop:
        return 0
    finally:
        group.stop()


def _check_port(flag: str, port: int, last: int | None = None) -> None:
    """A port (0: a free one), and the last of the range it starts, within 0..65535."""
    if not 0 <= port <= 65535 or (port and last is not None and last > 65535):
        raise UserError(f"{flag} {port} leaves the port numbers (0..65535); pick a lower one")


def cmd_router(args) -> int:
    _check_port("--port", args.port)
    python = sglang_python()
    cmd = [python, "-m", "sglang_router.launch_router", "--worker-urls", *args.worker_urls]
    cmd += ["--host", args.host, "--port", str(args.port), "--policy", args.policy]
    # The router's metrics exporter: on the router's own address (its default is 0.0.0.0:29000,
    # which a second router on the host, or another job, would collide with).
    metrics_port = args.prometheus_port or free_port()
    cmd += ["--prometheus-host", args.host, "--prometheus-port", str(metrics_port)]
    log_path = Path(args.log_dir) / "router.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as f:
        f.write(f"==== {' '.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    try:
        _wait_healthy(proc, url, args.timeout_s, log_path)
        write_urls(Path(args.urls_file), [url])
        print(f"router ready (pid {proc.pid}): {url} -> {' '.join(args.worker_urls)}", flush=True)
        while proc.poll() is None:
            time.sleep(1.0)
        print(f"error: sglang-router (pid {proc.pid}) exited with code {proc.returncode}; "
              f"see {log_path}", file=sys.stderr)  # fmt: skip
        return 1
    except Stop:
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        _stop_group(proc)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UserError(f"sglang-router exited with code {proc.returncode}; see {log_path}")
        try:
            with OPENER.open(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            if is_redirect(e):  # (refused, not followed: see megatron_gspo/no_redirect.py)
                what = redirect_refusal("/health", e, with_key=False)
                raise UserError(f"sglang-router at {url}: {what}; see {log_path}") from None
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise UserError(f"sglang-router was not healthy after {timeout_s:.0f} s; see {log_path}")


def _stop_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)  # its own session: pgid == pid
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("servers", help="this node's rollout servers")
    add_layout_args(s)
    s.add_argument("--node-rank", type=int, default=0)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    s.add_argument("--port-base", type=int, default=0, help="server i listens on BASE+i (0: free)")
    s.add_argument("--log-dir", required=True)
    s.add_argument("--urls-file", required=True)
    r = sub.add_parser("router", help="sglang-router in front of the servers")
    r.add_argument("--worker-urls", nargs="+", required=True)
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--policy", default="cache_aware")
    r.add_argument("--prometheus-port", type=int, default=0, help="router metrics (0: free)")
    r.add_argument("--timeout-s", type=float, default=120.0)
    r.add_argument("--log-dir", required=True)
    r.add_argument("--urls-file", required=True)
    return p.parse_args(argv)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    args = parse_args(argv)
    try:
        code = cmd_servers(args) if args.cmd == "servers" else cmd_router(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except OSError as e:  # a log directory or a server's python that cannot be used
        what = (
            f"node {args.node_rank}: cannot start a rollout server"
            if args.cmd == "servers"
            else "cannot start sglang-router"
        )
        print(f"error: {what}: {e}", file=sys.stderr)
        code = 1
    except Stop:
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main()
