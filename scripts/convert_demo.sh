#!/usr/bin/env bash
# Checkpoint tools end to end on a CPU: make a tiny Qwen3-MoE, convert it to a
# Megatron dist-checkpoint under TP2 x EP2, score token log-probs from it, and convert it back.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN_DIR:-runs/convert_demo}
rm -rf "$RUN"
mkdir -p "$RUN"
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
