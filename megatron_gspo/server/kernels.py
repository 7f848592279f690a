"""The compiled decode step (decode_kernel.c): built once per machine, loaded with ctypes.

Deliberate deviation from torch.utils.cpp_extension: a source that includes the torch headers
takes some 40 s to compile on a small machine, and the kernel needs none of torch, only raw
pointers to fp32 tensors. So it is plain C, compiled by the system C compiler (`$CC`, else `cc`
or `gcc`) in about a second into a cache directory (`$MEGATRON_GSPO_KERNEL_CACHE`, else
`$XDG_CACHE_HOME/megatron_gspo/kernels`, else `~/.cache/...`), keyed by the source, the compiler,
the flags and the CPU, and called through ctypes, once per decode step.

Where it cannot be used (no compiler, a failed build, a model it does not cover: not fp32, or a
large model with several torch threads, where torch's threaded matmuls win) the model keeps its
torch path; `mode="torch"` (the server's `--decode-kernel torch`) forces that path.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from megatron_gspo.server.args import KERNEL_MODES

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_kernel.c")
FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu11"]
_AUTO_MAX_PARAMS = 4 * 2**20  # above this, with several torch threads, "auto" keeps torch
# The layer table's fields (P_* in decode_kernel.c), and those whose weights it reads packed.
_P_FIELDS = 10
_PACKED = {2, 4, 7, 8, 9}  # q|k|v, o, router, gate|up, down
_FRESH = itertools.count()  # distinct keys for weights without a version counter
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first use; None where it cannot be built."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load()
        return _loaded["lib"]


def _load() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or not SOURCE.is_file():
        log.info("no C compiler or kernel source: the rollout model decodes with torch")
        return None
    try:
        path = _build(cc)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("decode kernel unavailable (%s): the rollout model decodes with torch", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.mg_decode.restype = i64
    lib.mg_decode.argtypes = [ptr, ctypes.c_double, *[ptr] * 6, i64, i64, *[ptr] * 5]
    lib.mg_layer_fields.restype = lib.mg_config_fields.restype = i64
    lib.mg_sample.restype = None
    lib.mg_sample.argtypes = [ptr, i64, i64, *[ptr] * 5]
    return lib


def _build(cc: str) -> Path:
    """Compile the source unless the cache holds it already; returns the shared library."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    for flags in ([*FLAGS, "-march=native"], FLAGS):  # some compilers lack -march=native
        key = hashlib.sha256(
            "\0".join([SOURCE.read_text(), version, *flags, _cpu_id()]).encode()
        ).hexdigest()[:16]
        out = _cache_dir() / f"decode_kernel-{key}.so"
        if out.is_file():
            return out
        with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
            pass
        cmd = [cc, *flags, "-o", tmp.name, str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            os.replace(tmp.name, out)  # atomic: concurrent builders of one key both succeed
            return out
        os.unlink(tmp.name)
        error = done.stderr.strip()[-2000:]
    raise OSError(f"{cc} failed: {error}")


def _cache_dir() -> Path:
    root: str | Path | None = os.environ.get("MEGATRON_GSPO_KERNEL_CACHE")
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(base) / "megatron_gspo" / "kernels"
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        path = Path(tempfile.gettempdir()) / f"megatron_gspo-kernels-{os.getuid()}"
        path.mkdir(parents=True, exist_ok=True)
    return path


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's feature flags where Linux lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


class CompiledDecode:
    """A model's decode steps (batches of one-token chunks) through the kernel library."""

    def __init__(self, lib: ctypes.CDLL, model) -> None:
        s = model.spec
        self.lib, self.model = lib, model
        moe = s.is_moe
        cfg = [
            s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim,
            s.num_experts if moe else 0, s.moe_ffn_hidden_size if moe else 0,
            s.ffn_hidden_size if not all(s.moe_layers) else 0, s.topk if moe else 0,
            int(bool(moe and s.norm_topk_prob)), int(s.qk_norm), s.num_layers, s.vocab_size,
        ]  # fmt: skip
        assert len(cfg) == lib.mg_config_fields() and lib.mg_layer_fields() == _P_FIELDS
        self.cfg = array.array("q", cfg)
        self.n_moe, self.topk = len(model.moe_layer_ids), s.topk if moe else 0
        self._scratch = torch.empty(0)

    @staticmethod
    def covers(model) -> str | None:
        """Why the kernel cannot run this model (None: it can)."""
        s = model.spec
        if model.dtype != torch.float32:
            return f"dtype {model.dtype}"
        if s.head_dim > 1024 or s.head_dim % 8 or s.num_heads % s.num_kv_heads:
            return "head layout"
        tensors = [*model.params.values(), *model.fused.values()]
        tensors += [t for ex in model.experts.values() for t in (ex["gate_up"], ex["down"])]
        if not all(t.is_contiguous() for t in tensors):
            return "non-contiguous weights"
        return None

    def _sources(self) -> list[torch.Tensor | None]:
        """The weights the kernel reads: per layer in decode_kernel.c's P_* order (None: absent),
        then the final norm and the head."""
        m, p, out = self.model, self.model.params, []
        for i in range(m.spec.num_layers):
            pre = f"model.layers.{i}."
            ex = m.experts.get(i)
            out += [
                p[pre + "input_layernorm.weight"], p[pre + "post_attention_layernorm.weight"],
                m.fused[pre + "qkv"], m.fused.get(pre + "qkv_bias"),
                p[pre + "self_attn.o_proj.weight"],
                p.get(pre + "self_attn.q_norm.weight"), p.get(pre + "self_attn.k_norm.weight"),
                p[pre + "mlp.gate.weight"] if ex else None,
                ex["gate_up"] if ex else m.fused[pre + "gate_up"],
                ex["down"] if ex else p[pre + "mlp.down_proj.weight"],
            ]  # fmt: skip
        return out + [
            p["model.norm.weight"],
            p.get("lm_head.weight", p["model.embed_tokens.weight"]),
        ]

    def _tables(self) -> tuple[array.array, torch.Tensor]:
        """The per-layer pointer table and the packed head. Matmul weights are read
        packed (see _pack), copies made once per weight version: the cache key holds each
        source's address and in-place version counter, so any write to a weight (a load, a
        direct copy_, a replaced tensor) rebuilds them before the next step."""
        srcs = self._sources()
        key = tuple((t.data_ptr(), _version(t)) for t in srcs if t is not None)
        cached = self.model._derived.get("decode_kernel")
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        n = _P_FIELDS
        keep, ptrs = [], []
        for i, t in enumerate(srcs[:-2]):
            if t is not None and i % n in _PACKED:
                t = _pack(t)
                keep.append(t)
            ptrs.append(0 if t is None else t.data_ptr())
        head = srcs[-1]
        assert head is not None  # the head is always there (lm_head or the tied embedding)
        head_t = _pack(head)
        table = array.array("q", ptrs)
        self.model._derived["decode_kernel"] = (key, table, head_t, keep)
        return table, head_t

    def step(self, ids, pos, slots, cache, routing: bool):
        """Logits [T, V] fp32 of one token per sequence, k/v written into `cache`; and the
        routed experts [T, L, k] int32 when `routing` (else None)."""
        m, T = self.model, len(ids)
        k_len = max(pos) + 1
        cache.ensure(max(slots) + 1, k_len)
        rope = m._rope_table(k_len)
        embed = m.params["model.embed_tokens.weight"]
        kv = array.array("q", [t.data_ptr() for pair in zip(cache.k, cache.v) for t in pair])
        idx = array.array("q", [*ids, *pos, *slots])
        logits = torch.empty(T, m.spec.vocab_size)
        routed = None
        if routing and self.n_moe:
            routed = torch.empty(T, self.n_moe, self.topk, dtype=torch.int32)
        table, head_t = self._tables()
        base, size = idx.buffer_info()[0], idx.itemsize
        rc = self.lib.mg_decode(
            self.cfg.buffer_info()[0], m.spec.rms_norm_eps, table.buffer_info()[0],
            embed.data_ptr(), m.params["model.norm.weight"].data_ptr(), head_t.data_ptr(),
            rope.data_ptr(), kv.buffer_info()[0], cache.capacity, T,
            base, base + T * size, base + 2 * T * size,
            logits.data_ptr(), routed.data_ptr() if routed is not None else None,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("the decode kernel could not allocate its scratch memory")
        return logits, routed

    def sample(self, logits_BV: torch.Tensor, temps: list[float], u_B: torch.Tensor):
        """sampling.sample_batch for rows without filters: (tokens, log-probs) as lists;
        temperature 0 marks a greedy row, u_B holds each row's uniform draw."""
        B, V = logits_BV.shape
        logits_BV = logits_BV.to(torch.float32).contiguous()
        if self._scratch.numel() < V:
            self._scratch = torch.empty(V)
        temp = array.array("f", temps)
        tokens, logprobs = array.array("q", bytes(8 * B)), array.array("f", bytes(4 * B))
        self.lib.mg_sample(
            logits_BV.data_ptr(), B, V, temp.buffer_info()[0], u_B.data_ptr(),
            tokens.buffer_info()[0], logprobs.buffer_info()[0], self._scratch.data_ptr(),
        )  # fmt: skip
        return tokens.tolist(), logprobs.tolist()


def _version(t: torch.Tensor) -> int:
    """The in-place write counter; an inference tensor has none (-1 then rebuilds each step)."""
    try:
        return t._version
    except RuntimeError:
        return -1 - next(_FRESH)


def _pack(w: torch.Tensor) -> torch.Tensor:
    """[..., N, K] (out, in) -> [..., ceil(N / 16), K, 16]: the panels decode_kernel.c's
    matmuls stream, the columns past N zero."""
    *lead, N, K = w.shape
    n16 = -(-N // 16) * 16
    wt = w.new_zeros(*lead, K, n16)
    wt[..., :N] = w.transpose(-1, -2)
    return wt.view(*lead, K, n16 // 16, 16).transpose(-3, -2).contiguous()


class KernelUnavailable(RuntimeError):
    """The compiled decode step was insisted on ("c") and cannot serve this model here."""


def attach(model, mode: str = "auto") -> bool:
    """Make `model` decode with the kernel where `mode` wants it and it can; returns whether
    it does. "auto" takes it for fp32 models unless several torch threads would serve a large
    model better; "c" insists (KernelUnavailable where it cannot). Builds the library on first use
    (about a second; call it before serving)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"decode kernel mode must be one of {KERNEL_MODES}, got {mode!r}")
    model.decode_kernel = None
    if mode == "torch":
        return False
    why = CompiledDecode.covers(model)
    n_params = sum(t.numel() for t in model.params.values())
    n_params += sum(ex["gate_up"].numel() + ex["down"].numel() for ex in model.experts.values())
    if mode == "auto" and torch.get_num_threads() > 1 and n_params > _AUTO_MAX_PARAMS:
        return False
    lib = library() if why is None else None
    if lib is None:
        if mode == "c":
            raise KernelUnavailable(
                f"decode kernel requested but unavailable ({why or 'no build'})"
            )
        return False
    model.decode_kernel = CompiledDecode(lib, model)
    return True
