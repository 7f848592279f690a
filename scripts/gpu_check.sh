#!/usr/bin/env bash
# One-shot GPU verdict on a lent one-GPU machine (no network; Python 3.12 with CUDA torch, no
# megatron-core, no Transformer Engine, no SGLang). Prepare here: `bash scripts/gpu_wheels.sh`
# (fills .whl/); run there from the repo root with `.whl` carried:
#   bash scripts/gpu_check.sh [--out DIR] [--dry-run]
# It writes DIR/gpu_check.json (one object: each step's status, seconds and numbers, and the
# goals), DIR/gpu_check.log (a short log) and DIR/gpu_check_steps.log (every step's output).
# DIR: --out, else $OUT, else runs/gpu_check. Every step runs in its own process group under
# its own time budget and the run goes on past a failed or timed-out step; the whole run is
# planned for 8 minutes (480 s):
#   install      30 s  the .whl/ wheels into a --target dir (pip --no-index), put on PYTHONPATH
#   mfu         130 s  bench/gpu_mfu.py: the product's bf16 MoE train step, Qwen3-30B-A3B layer
#                      shapes, seq 4096, grouped (judged) and sequential experts at 6 and 2
#                      layers; tokens/s, MFU vs 989 TFLOP/s beside an 8192^3 bf16 matmul's
#                      TFLOP/s, the step's split, fixed cost, memory by kind, a kernel profile
#   mismatch     90 s  bench/gpu_mismatch.py: bf16 trainer (GPU) vs fp32 rollout model (CPU) on
#                      a random 2-layer Qwen3-30B-A3B-shaped model (2.7 GB bf16, made here):
#                      mean |d logp| and top-k routing agreement (an fp32 trainer as control)
#   weight_sync  75 s  bench/bench_weight_sync.py --device cuda: that model from the GPU trainer
#                      into a built-in server (tensor, distributed) vs a D2H copy of the same
#                      bytes; CUDA IPC alone vs a D2D copy (NCCL needs two GPUs)
#   gpu_tier    rest   the GPU test tier, pytest -m gpu tests/gpu (scripts/gpu_checks.sh's):
#                      what is left of the 480 s (155 s if every step above used its budget),
#                      at least 120 s
# --dry-run (any machine, CPU): the same steps with tiny shapes on gloo/CPU, the tier only
# collected, the wheels only checked for cp312 (skipped without .whl/), to show the run starts.
set -uo pipefail

DRY=0
DIR=${OUT:-}
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --out) DIR=$2; shift ;;
    --out=*) DIR=${1#--out=} ;;
    *) echo "usage: $0 [--out DIR] [--dry-run]" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$DIR" ]; then mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd) || exit 2; fi
cd "$(dirname "$0")/.." || exit 2
DIR=${DIR:-$PWD/runs/gpu_check}
if [ "$DRY" = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
  PYTHON=.venv/bin/python
fi
PY=${PYTHON:-python3}
TOTAL_S=480
mkdir -p "$DIR"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
LOG=$DIR/gpu_check.log
FULL=$DIR/gpu_check_steps.log
STEPS=$WORK/steps.tsv
: >"$LOG"
: >"$FULL"
: >"$STEPS"
START=$(date +%s)
export PYTHONUNBUFFERED=1
if [ "$DRY" = 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else  # the CPU halves of the benches (the rollout model, the server) get every core
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
  export OMP_NUM_THREADS
fi
SETSID=setsid  # each step in a process group of its own, killed whole at its budget
command -v setsid >/dev/null || SETSID=
log() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

# run_step NAME BUDGET_S CMD...: CMD in a new process group, killed (the group) at the budget;
# a line "NAME STATUS RC SECONDS BUDGET" goes to $STEPS, its output to $WORK/NAME.log.
run_step() {
  local name=$1 budget=$2
  shift 2
  local out=$WORK/$name.log t0 rc status pid timed_out=0
  log "$name: start (budget ${budget}s)"
  t0=$(date +%s.%N)
  $SETSID "$@" >"$out" 2>&1 &
  pid=$!
  local deadline=$(($(date +%s) + budget))
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      timed_out=1
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
      for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
      break
    fi
    sleep 0.5
  done
  wait "$pid"
  rc=$?
  local secs
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if [ "$timed_out" = 1 ]; then status=timeout; elif [ "$rc" = 0 ]; then status=ok; else status=failed; fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$secs" "$budget" >>"$STEPS"
  { echo "===== $name: $status (rc $rc, ${secs}s of ${budget}s): $*"; tail -n 3000 "$out"; } >>"$FULL"
  log "$name: $status (rc $rc) in ${secs}s"
  if [ "$status" != ok ]; then tail -n 15 "$out" | sed 's/^/    /' | tee -a "$LOG"; fi
}

skip_step() {  # NAME REASON
  printf '%s\tskipped\t0\t0\t0\n' "$1" >>"$STEPS"
  echo "$2" >"$WORK/$1.log"
  log "$1: skipped ($2)"
}

# ---- install: the wheels of scripts/gpu_wheels.sh, offline ---------------------------------
SITE=$WORK/site
install_wheels() {
  local whl mod
  if [ "$DRY" = 1 ]; then  # only check that they install on CPython 3.12, manylinux x86_64
    "$PY" -m pip install --dry-run --quiet --disable-pip-version-check --no-index --no-deps \
      --only-binary=:all: --target "$SITE" --python-version 3.12 --implementation cp \
      --abi cp312 --platform manylinux_2_28_x86_64 .whl/*.whl || return 1
  else
    for whl in .whl/*.whl; do
      case $(basename "$whl") in
        psutil-*) mod=psutil ;;
        setuptools-*) mod=setuptools ;;
        *) mod= ;;
      esac
      if [ -n "$mod" ] && "$PY" -c "import $mod" 2>/dev/null; then
        echo "$(basename "$whl"): $mod is already there"
        continue
      fi
      if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
          --target "$SITE" "$whl" || return 1
      else  # no pip: these wheels have no scripts or data, so unpacking one installs it
        "$PY" -m zipfile -e "$whl" "$SITE" || return 1
      fi
    done
  fi
  PYTHONPATH="$SITE:$PWD" "$PY" - "$WORK/install.json" <<'PY'
import json, os, shutil, sys, importlib.metadata as md
import torch
info = {"python": sys.version.split()[0], "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpus": os.cpu_count(),
        "shm_free_gb": shutil.disk_usage("/dev/shm").free / 1e9 if os.path.isdir("/dev/shm") else None,
        "c_compiler": next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)}
for dist in ("megatron-core", "psutil", "setuptools", "transformers"):
    try:
        info[dist] = md.version(dist)
    except md.PackageNotFoundError:
        info[dist] = None
import megatron.core  # noqa: the trainer's imports work (fails the step otherwise)
print(info)
json.dump(info, open(sys.argv[1], "w"))
PY
}
export -f install_wheels
export DRY PY SITE WORK

if compgen -G ".whl/*.whl" >/dev/null; then
  run_step install 30 bash -c install_wheels
elif [ "$DRY" = 1 ]; then
  skip_step install "no .whl/ (CI has none); the dry run goes on with this interpreter's packages"
else
  skip_step install "no .whl/: run scripts/gpu_wheels.sh here first and carry .whl"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
log "python: $PY; PYTHONPATH=$PYTHONPATH"

# ---- the measurements ------------------------------------------------------------------------
# The mismatch step makes the random bf16 checkpoint ($WORK/model) that the weight sync reuses
# (made once: tens of seconds of CPU work; the sync makes its own if it is missing). The benches
# run megatron's fused kernels eagerly where torch.compile fails (it needs triton and a C
# compiler: install.json says whether one is there); the tier runs the product as it is.
MODEL=$WORK/model
if [ "$DRY" = 1 ]; then
  run_step mfu 130 "$PY" bench/gpu_mfu.py --tiny --layers 2,1 --seq 64 --micro-batch 2 \
    --warmup 1 --steps 2 --matmul 256 --profile 5 --json "$WORK/mfu.json"
  run_step mismatch 90 "$PY" bench/gpu_mismatch.py --tiny --model "$MODEL" \
    --json "$WORK/mismatch.json"
  # (a CPU's weight sync of even the tiny model takes most of the GPU plan's 75 s under load)
  run_step weight_sync 180 "$PY" bench/bench_weight_sync.py --tiny --model "$MODEL" --reps 2 \
    --quick --transports tensor,distributed --json "$WORK/weight_sync.json"
  run_step gpu_tier 120 "$PY" -m pytest --collect-only -q -m gpu tests/gpu -p no:cacheprovider
else
  run_step mfu 130 env TORCHDYNAMO_SUPPRESS_ERRORS=1 \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$PY" bench/gpu_mfu.py \
    --profile 20 --json "$WORK/mfu.json"
  run_step mismatch 90 env TORCHDYNAMO_SUPPRESS_ERRORS=1 "$PY" bench/gpu_mismatch.py \
    --model "$MODEL" --json "$WORK/mismatch.json"
  run_step weight_sync 75 env TORCHDYNAMO_SUPPRESS_ERRORS=1 "$PY" bench/bench_weight_sync.py \
    --device cuda --dtype bfloat16 --model-gb 2 --model "$MODEL" --reps 3 --quick \
    --transports tensor,distributed --server-threads 8 --json "$WORK/weight_sync.json"
  left=$((TOTAL_S - ($(date +%s) - START)))
  run_step gpu_tier $((left > 120 ? left : 120)) "$PY" -m pytest -v -m gpu tests/gpu \
    -p no:cacheprovider
fi

# ---- gpu_check.json ------------------------------------------------------------------------
"$PY" - "$WORK" "$DIR/gpu_check.json" "$DRY" "$(($(date +%s) - START))" <<'PY' | tee -a "$LOG"
import json, re, sys
from pathlib import Path

work, out, dry, total = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])


def load(name):
    p = work / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def tier(text):
    if dry:
        tests = [l.strip() for l in text.splitlines() if "::" in l]
        return {"collected": len(tests), "passed": 0, "failed": 0, "errors": 0, "skipped": 0,
                "tests": dict.fromkeys(tests, "collected")}
    found = re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", text, re.M)
    tests = dict(found)
    count = lambda *o: sum(v in o for v in tests.values())
    summary = [l for l in text.splitlines() if re.match(r"^=+ .*\d+ (passed|failed|error)", l)]
    return {"collected": len(tests), "passed": count("PASSED", "XPASS", "XFAIL"),
            "failed": count("FAILED"), "errors": count("ERROR"), "skipped": count("SKIPPED"),
            "tests": tests, "summary": summary[-1].strip("= ") if summary else None}


def mfu(m):
    keys = ("mfu", "tokens_per_s", "matmul_tflops", "matmul_fraction", "judged", "per_layer",
            "fixed_cost_s", "split_s", "memory")
    n = {k: m.get(k) for k in keys}
    ok = [c for c in m.get("configs", []) if c.get("error") is None]
    judged = [c for c in ok if f"{c['experts']} experts, {c['layers']} layers" == m.get("judged")]
    best = judged[0] if judged else {}
    n["achieved_tflops"] = best.get("achieved_tflops")
    n["configs"] = m.get("configs")
    return n


def sync(s):
    t, f, ref = s.get("transports", {}), s.get("floors", {}), s.get("reference", {})
    ratio = lambda a, b: a / b if a and b else None
    n = {"model_gb": s.get("model_bytes", 0) / 1e9, "reference": ref.get("what"),
         "reference_gbps": ref.get("gbps")}
    for name in ("tensor", "distributed"):
        n[f"{name}_gbps"] = t.get(name, {}).get("gbps")
        n[f"{name}_x_reference"] = t.get(name, {}).get("x_reference")
        n[f"{name}_probe_max_diff"] = t.get(name, {}).get("probe_max_diff")
    for name in ("d2h_pinned", "d2d", "cuda_ipc", "nccl"):
        n[f"{name}_gbps"] = f.get(name)
    n["cuda_ipc_x_d2d"] = ratio(f.get("cuda_ipc"), f.get("d2d"))
    n.update(shm_free_gb=s.get("shm_free_gb"), errors=s.get("errors"), notes=s.get("notes"))
    return n


def mismatch(m):
    n = {k: m.get(k) for k in ("logprob_abs_diff_mean", "logprob_abs_diff_max",
                               "routing_agreement", "routing_agreement_per_layer", "tokens")}
    control = m.get("trainer", {}).get("float32", {})
    n["fp32_control_logprob_abs_diff_mean"] = control.get("logprob_abs_diff_mean")
    n["fp32_control_routing_agreement"] = control.get("routing_agreement")
    return n


numbers = {
    "install": lambda: load("install"),
    "mfu": lambda: mfu(load("mfu")),
    "weight_sync": lambda: sync(load("weight_sync")),
    "mismatch": lambda: mismatch(load("mismatch")),
    "gpu_tier": lambda: tier((work / "gpu_tier.log").read_text(errors="replace")),
}
steps = {}
for line in (work / "steps.tsv").read_text().splitlines():
    name, status, rc, secs, budget = line.split("\t")
    step = {"status": status, "rc": int(rc), "seconds": float(secs), "budget_s": int(budget)}
    try:
        step["numbers"] = numbers[name]()
    except Exception as e:  # a step's output that cannot be read is that step's problem
        step["numbers"], step["status"] = {}, "failed"
        step["error"] = f"reading its results: {type(e).__name__}: {e}"
    if status != "ok":
        tail = (work / f"{name}.log").read_text(errors="replace").splitlines()[-20:]
        step.setdefault("error", "\n".join(tail))
    steps[name] = step

m, s = steps.get("mfu", {}).get("numbers", {}), steps.get("weight_sync", {}).get("numbers", {})
at_most = lambda v, x: v is not None and v <= x
mem = m.get("memory") or {}
goals = [
    {"goal": f"MoE train-step MFU >= 0.30 ({m.get('judged')}, the product's step)",
     "value": m.get("mfu"), "met": m.get("mfu") is not None and m["mfu"] >= 0.30},
    {"goal": "fixed per-step cost <= 0.2 s (intercept of step time against tokens)",
     "value": m.get("fixed_cost_s"), "met": at_most(m.get("fixed_cost_s"), 0.2)},
    {"goal": "peak memory <= 1.15x the static state (parameters, gradients, optimizer)",
     "value": mem.get("peak_x_static"), "met": at_most(mem.get("peak_x_static"), 1.15)},
    {"goal": "CUDA IPC sync >= 0.5x the D2H copy (tensor transport GB/s over the D2H copy of "
             "the same bytes; the built-in server is on CPU, so the buckets go by shared memory)",
     "value": s.get("tensor_x_reference"),
     "met": s.get("tensor_x_reference") is not None and s["tensor_x_reference"] >= 0.5},
]
result = {"dry_run": dry, "total_s": total, "budget_s": 480, "steps": steps, "goals": goals}
out.write_text(json.dumps(result, indent=1) + "\n")
for name, st in steps.items():
    print(f"{name:12s} {st['status']:8s} {st['seconds']:6.1f}s / {st['budget_s']}s")
for g in goals:
    print(f"goal: {g['goal']}: {g['value']} -> {'met' if g['met'] else 'NOT met'}")
PY
rm -rf "$WORK"
log "wrote $DIR/gpu_check.json"
