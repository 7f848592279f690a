#!/usr/bin/env bash
# The main job on a CPU: GSPO on a tiny Qwen3-MoE, from a starting checkpoint made here.
#   1. make the starting policy: a 2-layer, 8-expert MoE fine-tuned to be partly right on
#      single-step arithmetic (so RL has something to improve);
#   2. train it with GSPO (configs/tiny_moe_gspo.yaml): built-in rollout server, Megatron actor,
#      weight sync after every step, greedy eval on held-out prompts every 5 steps;
#   3. plot the run. Pass another config as $1 (e.g. configs/tiny_moe_grpo.yaml).
# Running it again continues the run from its newest checkpoint (a finished run: nothing to
# train; raise train.steps in the config to train on) and writes its report again.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/tiny_moe_gspo.yaml}
NAME=$(basename "$CONFIG" .yaml)
RUN=${RUN_DIR:-runs/$NAME}
M=".venv/bin/megatron-gspo"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# the config's starting model, made here when it is not there yet: the task model of its
# built-in task (the drift preset for sortlong)
read -r MODEL MAKE < <(.venv/bin/python - "$CONFIG" <<'PY'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
path = cfg["model"]["path"]
task = str(cfg.get("data", {}).get("train", "builtin:arith")).removeprefix("builtin:")
print(path, "--preset drift" if task == "sortlong" else f"--task {task}")
PY
)
# shellcheck disable=SC2086
[ -d "$MODEL" ] || $M make-task-model $MAKE --out "$MODEL"
RESUME=()
[ -d "$RUN/checkpoints" ] && RESUME=(--resume)
$M train --config "$CONFIG" --run-dir "$RUN" "${RESUME[@]}"
# the report, written again each time: to a new file first, then over the old one (which stays
# as it was if the new one fails)
NEW="$RUN/report.new.png"
rm -f "$NEW"
$M report "$RUN" --out "$NEW" >/dev/null
mv -f "$NEW" "$RUN/report.png"
echo "wrote $RUN/report.png"
.venv/bin/python - "$RUN" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
evals = [(r["step"], r["eval/reward"]) for r in rows if "eval/reward" in r]
print(f"greedy eval reward: step {evals[0][0]} {evals[0][1]:.3f} -> step {evals[-1][0]} {evals[-1][1]:.3f}")
PY
echo "done: $RUN (metrics.jsonl, report.png, tensorboard/, checkpoints/)"
