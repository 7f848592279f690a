"""How to start one rollout server (built-in or SGLang): its command line, environment and
flags."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from megatron_gspo.rollout.modes import Backend

# the environment variable that holds the rollout servers' API key: read by the built-in server,
# the trainer (train/fleet.py) and the launch scripts, so the key stays off command lines
API_KEY_ENV = "MEGATRON_GSPO_API_KEY"


@dataclass
class ServerConfig:
    """One rollout server. Fields left None are not passed (the server's default applies)."""

    model_path: str
    kind: Backend = Backend.BUILTIN
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, kept across restarts
    python: str = sys.executable  # for SGLang: the python of its own venv
    api_key: str | None = None
    enable_return_routed_experts: bool = False
    dtype: str | None = None
    quantization: str | None = None
    random_seed: int | None = None
    max_running_requests: int | None = None
    deterministic: bool = False  # --enable-deterministic-inference (batch-invariant numerics)
    # SGLang only
    tp_size: int = 1
    device: str | None = None  # "cpu" for SGLang on a CPU-only host
    disable_cuda_graph: bool = False
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    enable_memory_saver: bool = False
    skip_server_warmup: bool = False
    sleep_on_idle: bool = False  # else an idle scheduler spins a core (on CPU: the trainer's)
    disable_overlap_schedule: bool = False  # on CPU its overlap thread competes for the cores
    base_gpu_id: int | None = None  # its first GPU among those visible (colocated: the node's)
    # built-in only
    threads: int = 0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in ("builtin", "sglang"):
            raise ValueError(f"ServerConfig.kind must be builtin or sglang, not {self.kind!r}")
        if not self.model_path:
            raise ValueError("ServerConfig.model_path is required")

    def command(self, port: int) -> list[str]:
        module = "sglang.launch_server" if self.kind == Backend.SGLANG else "megatron_gspo.server"
        cmd = [self.python, "-m", module, "--model-path", str(self.model_path)]
        cmd += ["--host", self.host, "--port", str(port)]
        flags: dict[str, object] = {
            "--dtype": self.dtype,
            "--quantization": self.quantization,
            "--random-seed": self.random_seed,
            "--max-running-requests": self.max_running_requests,
        }
        switches = {"--enable-return-routed-experts": self.enable_return_routed_experts,
                    "--enable-deterministic-inference": self.deterministic}  # fmt: skip
        if self.kind == Backend.SGLANG:
            flags |= {
                "--tp-size": self.tp_size,
                "--device": self.device,
                "--max-total-tokens": self.max_total_tokens,
                "--mem-fraction-static": self.mem_fraction_static,
                "--api-key": self.api_key,  # (hex: a value that starts with - is read as a flag)
                "--base-gpu-id": self.base_gpu_id,
            }
            if self.disable_cuda_graph:  # (0.5.23 deprecates --disable-cuda-graph for these)
                flags |= {"--cuda-graph-backend-decode": "disabled"}
                flags |= {"--cuda-graph-backend-prefill": "disabled"}
            switches |= {
                "--enable-memory-saver": self.enable_memory_saver,
                "--skip-server-warmup": self.skip_server_warmup,
                "--sleep-on-idle": self.sleep_on_idle,
                "--disable-overlap-schedule": self.disable_overlap_schedule,
            }
        else:
            flags["--threads"] = self.threads or None
        for flag, value in flags.items():
            if value is not None:
                cmd += [flag, str(value)]
        cmd += [flag for flag, on in switches.items() if on]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        if self.kind == Backend.BUILTIN and self.api_key:
            env[API_KEY_ENV] = self.api_key  # not on the command line
        return env


def redacted(cmd: list[str], secret: str | None) -> list[str]:
    """The command as the log shows it: the API key's value left out, wherever it appears, and
    that of any `--api-key K` or `--api-key=K` (e.g. from rollout.extra_server_args)."""
    out = []
    for i, a in enumerate(cmd):
        if i and cmd[i - 1] == "--api-key":
            a = "***"
        elif a.startswith("--api-key="):
            a = "--api-key=***"
        out.append(a.replace(secret, "***") if secret else a)
    return out


def copy_redacted(output: IO[bytes], log_path: Path, secret: str) -> None:
    """Append a server's output to its log, line by line, with `secret` shown as ***. SGLang
    logs its whole server_args at start, the API key's value included."""
    key = secret.encode()
    with output, open(log_path, "ab") as f:
        for line in iter(output.readline, b""):
            f.write(line.replace(key, b"***"))
            f.flush()


def size_sglang(server: ServerConfig, cfg, hf_dir, longest_prompt: int, gpu: bool) -> None:
    """What SGLang needs from the machine and the run, unless rollout.extra_server_args says
    it: on a host without a GPU the cpu device (SGLang looks for one otherwise and exits), no
    CUDA graphs, --sleep-on-idle (an idle scheduler spins a whole core, which the trainer needs:
    1.0 CPU-s/s idle without it, 0.03 with it) and --disable-overlap-schedule (its overlap
    thread hides GPU launches; on a CPU it competes with the forward and the trainer: steps
    1.09-1.27x faster without it in 3 of 3 runs of bench/bench_sglang_step.py); the
    checkpoint's dtype (SGLang's "auto" serves fp32 checkpoints in fp16 on CPU) unless
    rollout.dtype says otherwise; and on CPU a KV cache sized to the run: the most tokens a step
    or an eval keeps in flight, with headroom (its default takes a fraction of the machine's
    memory: 14 GB for a tiny model on a 24 GB host, and steps ~8x slower). fp8 quantization and
    deterministic inference are refused on a CPU: SGLang has no CPU kernels for them."""
    from megatron_gspo.hf.config import load_hf_config

    r = cfg.rollout
    given = {a.split("=", 1)[0] for a in r.extra_server_args if a.startswith("--")}
    check_sglang_modes(cfg, gpu)
    if not gpu and "--device" not in given:
        server.device = "cpu"
    graphs = {"--disable-cuda-graph", "--cuda-graph-backend-decode", "--cuda-graph-backend-prefill"}
    if not gpu and not graphs & given:
        server.disable_cuda_graph = True
    if not gpu:  # an idle scheduler polls without pause (one core, the trainer's here), and the
        # overlap thread only competes with the forward for the cores
        server.sleep_on_idle = server.disable_overlap_schedule = True
    if "--dtype" not in given:
        hf = load_hf_config(hf_dir)
        server.dtype = r.dtype or str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    if not gpu and not {"--max-total-tokens", "--mem-fraction-static"} & given:
        per_sequence = longest_prompt + r.max_new_tokens
        sequences = max(r.prompts_per_step * r.group_size, cfg.train.eval_prompts)
        tokens = int(1.5 * sequences * per_sequence)
        server.max_total_tokens = max(4096, -(-tokens // 1024) * 1024)
        if "--max-running-requests" not in given:
            server.max_running_requests = sequences


def check_sglang_modes(cfg, gpu: bool) -> None:
    """The rollout modes SGLang cannot serve on this machine, refused in one line naming the
    fix (train checks them before the run directory is made)."""
    from megatron_gspo.errors import UserError

    r = cfg.rollout
    if r.quantization and not gpu:  # (0.5.23 on a CPU: "sgl_per_tensor_quant_fp8 not defined")
        raise UserError(
            f"rollout.quantization={r.quantization} with SGLang needs a GPU: its CPU build has "
            "no fp8 kernels; on a CPU use rollout.backend=builtin, whose fp8 is weight-only"
        )
    if r.deterministic and not gpu:  # (0.5.23 on a CPU: "only ['ascend', 'fa3', 'fa4',
        # 'flashinfer', 'intel_xpu', 'triton'] attention backends are supported for ...")
        raise UserError(
            "rollout.deterministic with SGLang needs a GPU: its batch-invariant attention "
            "backends (fa3, flashinfer, triton) do not run on a CPU; on a CPU use "
            "rollout.backend=builtin, whose deterministic mode does"
        )
    if not gpu:
        check_sglang_on_cpu(r)


def check_sglang_on_cpu(r) -> None:
    """What SGLang's CPU build cannot start with (each a failure deep in its start otherwise,
    after a minute or two): its memory saver (it loads libcuda) and more tensor-parallel ranks
    than the machine has NUMA nodes (SGLang's rule, unless SGLANG_CPU_OMP_THREADS_BIND binds
    each rank's cores)."""
    from megatron_gspo.errors import UserError

    if r.release_memory or "--enable-memory-saver" in r.extra_server_args:
        what = "rollout.release_memory" if r.release_memory else "--enable-memory-saver"
        raise UserError(
            f"{what} with SGLang needs a GPU: SGLang's memory saver, which lends the servers' "
            "GPU memory to training, loads libcuda; on a CPU set rollout.release_memory=false "
            "and leave --enable-memory-saver out of rollout.extra_server_args"
        )
    nodes = numa_nodes()
    bound = os.environ.get("SGLANG_CPU_OMP_THREADS_BIND", "all") != "all"
    if nodes is not None and r.server_tp > nodes and not bound:
        raise UserError(
            f"rollout.server_tp={r.server_tp} with SGLang on a CPU needs as many NUMA nodes "
            f"(this machine has {nodes}), or SGLANG_CPU_OMP_THREADS_BIND naming each rank's "
            f"cores (e.g. 0-15|16-31 for 2); set rollout.server_tp={nodes}"
        )


def numa_nodes() -> int | None:
    """The NUMA nodes with a CPU this process may run on (None: not known here)."""
    root = Path("/sys/devices/system/node")
    try:
        allowed = os.sched_getaffinity(0)
        lists = [(d / "cpulist").read_text() for d in root.glob("node[0-9]*")]
        count = sum(bool(cpu_list(text) & allowed) for text in lists)
    except (OSError, AttributeError, ValueError):
        return None
    return count or None


def cpu_list(text: str) -> set[int]:
    """The CPUs of a sysfs cpulist ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


# Where scripts/sglang_env.sh builds SGLang's own environment, unless $SGLANG_VENV names another.
DEFAULT_SGLANG_VENV = Path.home() / ".cache" / "megatron-gspo" / "sglang-venv"


def sglang_venv() -> Path:
    """The SGLang environment scripts/sglang_env.sh builds: $SGLANG_VENV, else its default."""
    return Path(os.environ.get("SGLANG_VENV") or DEFAULT_SGLANG_VENV)


def sglang_python(configured: str | None = None) -> str:
    """The python that runs SGLang (and its router): rollout.sglang_python, else $SGLANG_PYTHON
    (the image sets it), else that of the environment scripts/sglang_env.sh built, where it is,
    else this one. A user who ran sglang_env.sh and set rollout.backend=sglang needs no more."""
    if configured:
        return configured
    if os.environ.get("SGLANG_PYTHON"):
        return os.environ["SGLANG_PYTHON"]
    built = sglang_venv() / "bin" / "python"
    return str(built) if built.exists() else sys.executable


def check_sglang_python(python: str) -> None:
    """A one-line refusal, naming the fix, where `python` cannot import SGLang: the servers
    would each fail to start on it, their logs saying why."""
    from megatron_gspo.errors import UserError

    probe = "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"
    try:
        rc = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode
        why = "has no SGLang" if rc else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        why = f"cannot be run ({type(e).__name__}: {e})"
    if why:
        raise UserError(
            f"rollout.backend=sglang: {python} {why}; build SGLang's environment with "
            f"`bash scripts/sglang_env.sh` (it goes to {sglang_venv()}, where it is found), or "
            "name its python in rollout.sglang_python or SGLANG_PYTHON"
        )
