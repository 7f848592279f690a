#!/usr/bin/env bash
# Checkpoint tools end to end on a CPU: make a tiny Qwen3-MoE, convert it to a
# Megatron dist-checkpoint under TP2 x EP2, score token log-probs from it, and convert it back.
#   [DEMO_DIR=runs/convert_demo] bash scripts/convert_demo.sh
# Its outputs go to DEMO_DIR (not RUN_DIR: that names the user's run in scripts/quickstart.sh).
# Run again, it replaces the directory it made before (the one holding its marker file); a
# DEMO_DIR it did not make is refused (one line, exit 2), never deleted.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${DEMO_DIR:-runs/convert_demo}
MARK=.made-by-convert-demo
if [[ -e "$RUN" || -L "$RUN" ]]; then
  if [[ ! -d "$RUN" || ! -f "$RUN/$MARK" ]]; then
    echo "error: $RUN exists and was not made by this demo; set DEMO_DIR to a new directory" >&2
    exit 2
  fi
  rm -rf "$RUN"
fi
mkdir -p "$RUN"
touch "$RUN/$MARK"
M=".venv/bin/megatron-gspo"
TORCHRUN=".venv/bin/torchrun --nproc-per-node 4"
export OMP_NUM_THREADS=1

$M make-tiny-model --out "$RUN/tiny-moe" --dense-layers 0
$TORCHRUN -m megatron_gspo.cli convert hf-to-megatron --hf "$RUN/tiny-moe" --out "$RUN/megatron" --tp 2 --ep 2
printf '{"input_ids": [5, 16, 17, 20, 18, 23, 6]}\n{"input_ids": [58, 59, 15, 22, 25]}\n' > "$RUN/input.jsonl"
$TORCHRUN -m megatron_gspo.cli score --checkpoint "$RUN/megatron" --input "$RUN/input.jsonl" --output "$RUN/scored.jsonl" --pp 2 --ep 2
$M convert megatron-to-hf --megatron "$RUN/megatron" --out "$RUN/hf-back"
echo "scored:"; cat "$RUN/scored.jsonl"
echo "done: $RUN"
