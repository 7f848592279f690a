#!/usr/bin/env bash
# The main job on a CPU: GSPO on a tiny Qwen3-MoE, from a starting checkpoint made here.
#   1. make the starting policy: a 2-layer, 8-expert MoE fine-tuned to be partly right on
#      single-step arithmetic (so RL has something to improve);
#   2. train it with GSPO (configs/tiny_moe_gspo.yaml): built-in rollout server, Megatron actor,
#      weight sync after every step, greedy eval on held-out prompts every 5 steps;
#   3. plot the run.
#
#   bash scripts/quickstart.sh [CONFIG.yaml] [key.sub=value ...]
#
# CONFIG defaults to configs/tiny_moe_gspo.yaml (e.g. configs/tiny_moe_grpo.yaml); the overrides
# go to `train` (every key: docs/config.md). Running it again continues the run from its newest
# checkpoint and writes its report again; a finished run says so at once (nothing to train):
# pass train.steps=N to train on. Stopped by a Ctrl-C, it says what it kept; running it again
# goes on from there. Bad input (no such config, no model.path, a model it cannot
# make, a model.path= given here that does not exist: only the config's own is made) is one
# line, exit 2.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "error: $*" >&2; exit 2; }
CONFIG=configs/tiny_moe_gspo.yaml
if [[ $# -gt 0 && "$1" != *=* ]]; then CONFIG=$1; shift; fi
for o in "$@"; do
    [[ "$o" == *=* ]] || die "'$o' is not an override; usage: bash scripts/quickstart.sh [CONFIG.yaml] [key.sub=value ...]"
done
if [[ ! -f "$CONFIG" ]]; then
    near=""
    [[ "$CONFIG" == *.yml && -f "${CONFIG%.yml}.yaml" ]] && near=" (did you mean ${CONFIG%.yml}.yaml?)"
    die "config $CONFIG not found$near; pass one of configs/*.yaml (ls configs/), e.g. configs/tiny_moe_grpo.yaml"
fi
NAME=$(basename "$CONFIG" .yaml)
RUN=${RUN_DIR:-runs/$NAME}
M=".venv/bin/megatron-gspo"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# the config's starting model, made here when it is not there yet: the task model of its
# built-in task (data/task_model.py `make_task_model_flags`); MODEL= and MAKE= (empty: there)
PLAN=$(.venv/bin/python - "$CONFIG" "$@" <<'PY'
import shlex, sys
from pathlib import Path
from megatron_gspo.config import load_config
from megatron_gspo.data.task_model import check_model_path, make_task_model_flags
from megatron_gspo.errors import UserError
def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
try:
    cfg = load_config(sys.argv[1], sys.argv[2:])
except UserError as e:
    fail(e)
path, source = cfg.model.path, cfg.data.train
# a model.path given here must exist (a typo would make and train a model under its name): only
# the config's own one is made
given = any(o.partition("=")[0].strip() in ("model.path", "model") for o in sys.argv[2:])
make = ""
if not Path(path).is_dir():
    if given or Path(path).exists():
        try:
            check_model_path(path, source)
        except UserError as e:
            fail(e)
    if not source.startswith("builtin:"):
        fail(f"model.path {path} does not exist, and the quickstart makes the starting model of "
             f"a built-in task only (data.train is {source}): point model.path at an HF "
             "checkpoint (megatron-gspo make-task-model makes one for data.train=builtin:TASK)")
    make = make_task_model_flags(source.removeprefix("builtin:"))
print(f"MODEL={shlex.quote(path)}\nMAKE={shlex.quote(make)}")
PY
) || exit $?
eval "$PLAN"
# shellcheck disable=SC2086
[ -z "$MAKE" ] || $M make-task-model $MAKE --out "$MODEL"
RESUME=()
[ -d "$RUN/checkpoints" ] && RESUME=(--resume)
rc=0
$M train --config "$CONFIG" --run-dir "$RUN" "${RESUME[@]}" "$@" || rc=$?
if [[ $rc -ne 0 ]]; then
    # stopped by a Ctrl-C (130) or SIGTERM (143) on a first run, train's line says "the same
    # command with --resume": the quickstart's own command is the one to run again
    if [[ ${#RESUME[@]} -eq 0 && ( $rc -eq 130 || $rc -eq 143 ) ]]; then
        echo "(the quickstart passes --resume itself: run it again, with the same arguments, to go on)" >&2
    fi
    exit $rc
fi
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
