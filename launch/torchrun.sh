#!/usr/bin/env bash
# Run `megatron-gspo train` on this node: the rollout servers the config places here, then one
# torchrun agent for the trainer ranks. One node on its own; under Slurm launch/slurm/train.sbatch
# runs this script once per node (srun), and two copies with NNODES=2 simulate two nodes.
#
#   launch/torchrun.sh --config FILE.yaml [--run-dir DIR] [--steps N] [--resume]
#       [--allow-config-change] [key.sub=value ...]
#
# rollout.placement decides where servers go (launch/plan.py): colocated, every node serves on
# the trainer's GPUs; disaggregated, the last ROLLOUT_NODES nodes only serve (on one node, the
# GPUs after the trainer's). The servers' URLs reach the trainer as rollout.urls, the node of
# each as rollout.url_nodes, and each rank learns its own node from MEGATRON_GSPO_NODE_RANK (the
# tensor weight sync relays to a node's servers through a rank on that node). Nodes meet
# through RUN_DIR/launch/<LAUNCH_ID>/ (a filesystem every node mounts; checkpoints need it anyway):
# started/node<R> per node, urls/node<R>.txt per serving node, `done` when training ended, `abort`
# when a node failed. That directory is one launch's: a LAUNCH_ID an earlier launch of the run
# used is refused (Slurm's default id counts the job's requeues).
#
# Logs: RUN_DIR/logs/ranks/node<R>/ (torchrun, one stdout/stderr per rank), RUN_DIR/logs/servers/
# node<R>/ (one per server, and the router's), RUN_DIR/logs/launch/node<R>.log (this script).
# On exit, normal or not, everything this script started is stopped by its PID.
#
# Environment (all optional):
#   PYTHON            python with megatron-gspo (default: .venv/bin/python, else python3)
#   NPROC_PER_NODE    trainer ranks per training node (default: the GPUs, 1 on a CPU)
#   GPUS_PER_NODE     GPUs to place processes on (default: the GPUs the node sees, nvidia-smi's
#                     count narrowed by CUDA_VISIBLE_DEVICES, 0 without one; refused above that
#                     count, and above 0 on a machine without a GPU: NPROC_PER_NODE sets the
#                     ranks of a CPU run)
#   NNODES NODE_RANK  nodes in the job and this one's index (default 1 0; Slurm: SLURM_NNODES,
#                     SLURM_NODEID)
#   ROLLOUT_NODES     disaggregated: nodes set aside for servers, the last ones (default 1)
#   SERVERS_PER_NODE  servers per serving node (default GPUs / rollout.server_tp, 1 on a CPU)
#   RDZV_ENDPOINT     c10d rendezvous host:port (default 127.0.0.1:<free port>; set it for
#                     several nodes)
#   LAUNCH_ID         the same on every node of one launch and new for each launch, a plain name
#                     (letters, digits, . _ -; default SLURM_JOB_ID-SLURM_RESTART_COUNT, the
#                     restart count 0 until Slurm requeues the job, else time+pid):
#                     RUN_DIR/launch/<LAUNCH_ID>/
#   SERVER_HOST       address servers bind (default 127.0.0.1 when the job has one node)
#   SERVER_PORT_BASE  server i listens on BASE+i (default: free ports)
#   SGLANG_PYTHON     python of SGLang's environment (or rollout.sglang_python)
#   MEGATRON_GSPO_API_KEY  the servers' API key (default: a random one; with NNODES > 1 set
#                     the same one on every node)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"

USAGE="usage: launch/torchrun.sh --config FILE.yaml [--run-dir DIR] [--steps N] [--resume] [--allow-config-change] [key.sub=value ...]"
die() { echo "error: $*" >&2; exit 2; }
# --help: the usage, then this file's opening comment (what it runs, the environment it reads)
show_help() {
    echo "$USAGE"
    echo
    sed -n '2,/^set -euo pipefail/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"
    exit 0
}

# ---- arguments -------------------------------------------------------------------------------
# A flag's value: missing (the flag last) or empty ("", FLAG=) is train's one-line refusal, not
# bash's "2: parameter null or not set" (exit 1), nor a flag dropped without a word.
STEPS_NEED="a whole number of steps (0 or more)"
need() { [[ -n "$2" ]] || die "$1 needs $3"; }  # need FLAG VALUE WHAT
CONFIG="" RUN_DIR="" STEPS="" RESUME=0 ALLOW_CHANGE=0
OVERRIDES=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --config) need --config "${2:-}" "a file"; CONFIG="$2"; shift 2 ;;
        --config=*) CONFIG="${1#*=}"; need --config "$CONFIG" "a file"; shift ;;
        --run-dir) need --run-dir "${2:-}" "a directory"; RUN_DIR="$2"; shift 2 ;;
        --run-dir=*) RUN_DIR="${1#*=}"; need --run-dir "$RUN_DIR" "a directory"; shift ;;
        --steps) need --steps "${2:-}" "$STEPS_NEED"; STEPS="$2"; shift 2 ;;
        --steps=*) STEPS="${1#*=}"; need --steps "$STEPS" "$STEPS_NEED"; shift ;;
        --resume) RESUME=1; shift ;;
        --allow-config-change) ALLOW_CHANGE=1; shift ;;
        -h|--help) show_help ;;
        *=*) OVERRIDES+=("$1"); shift ;;
        *) die "unknown argument '$1'; $USAGE" ;;
    esac
done
[[ -n "$CONFIG" ]] || die "--config FILE.yaml is required (e.g. configs/tiny_moe_gspo.yaml)"
[[ -f "$CONFIG" ]] || die "config file $CONFIG not found; pass --config FILE.yaml"
CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null || die "python '$PYTHON' not found; set PYTHON to the python that has megatron-gspo"
"$PYTHON" -c "import megatron_gspo" 2>/dev/null \
    || die "$PYTHON cannot import megatron_gspo; run scripts/setup.sh or set PYTHON"

# The GPUs this node's processes see (SEEN_GPUS): those nvidia-smi -L lists, narrowed by
# CUDA_VISIBLE_DEVICES where it is set (its ids; empty: none). Unset where nvidia-smi lists none
# (torch is asked then). SEEN_HOW says how they were counted, for a refusal's line.
SEEN_GPUS="" SEEN_HOW=""
count_visible_gpus() {
    command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || return 0
    local listed ids=() id kept=0
    listed=$(($(nvidia-smi -L | wc -l)))
    SEEN_GPUS=$listed SEEN_HOW="nvidia-smi -L lists $listed"
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        IFS=, read -ra ids <<< "$CUDA_VISIBLE_DEVICES"
        for id in "${ids[@]}"; do [[ -z "${id// /}" ]] || kept=$((kept + 1)); done
        if ((kept < listed)); then SEEN_GPUS=$kept; fi
        SEEN_HOW="CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES of the $listed nvidia-smi -L lists"
    fi
}
count_visible_gpus
gpu_count() {
    if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then echo "$SLURM_GPUS_ON_NODE"; else echo "${SEEN_GPUS:-0}"; fi
}
free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

NNODES="${NNODES:-${SLURM_NNODES:-1}}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
GPUS_PER_NODE="${GPUS_PER_NODE:-$(gpu_count)}"
# Every number is checked before anything starts: bash's arithmetic reads a word as a variable
# (NODE_RANK=x would be node 0), and a node outside the job would wait for a training that never
# comes.
in_range() { [[ "$1" =~ ^[0-9]{1,6}$ ]] && ((10#$1 >= $2 && 10#$1 <= $3)); }  # VALUE MIN MAX
in_range "$NNODES" 1 999999 || die "NNODES=$NNODES must be the number of nodes in the job (1 or more)"
in_range "$NODE_RANK" 0 "$((10#$NNODES - 1))" \
    || die "NODE_RANK=$NODE_RANK must be this node's index in the job, 0..$((10#$NNODES - 1))"
for var in GPUS_PER_NODE NPROC_PER_NODE ROLLOUT_NODES SERVERS_PER_NODE; do
    [[ -z "${!var:-}" ]] || in_range "${!var}" 0 999999 || die "$var=${!var} must be a whole number (or unset)"
done
[[ -z "${SERVER_PORT_BASE:-}" ]] || in_range "$SERVER_PORT_BASE" 0 65535 \
    || die "SERVER_PORT_BASE=$SERVER_PORT_BASE must be a port number (0: free ports)"
NNODES=$((10#$NNODES)) NODE_RANK=$((10#$NODE_RANK))
# GPUS_PER_NODE places ranks and servers on GPUs. On a machine without one (nvidia-smi lists none
# and torch, which decides where the trainer runs, sees none) GPUS_PER_NODE=8 ran 8 gloo ranks and
# 8 servers on its cores, silently, several times slower: refused. Several CPU ranks are
# NPROC_PER_NODE's. (torch is asked only then: a GPU machine without nvidia-smi still launches.)
if ((10#$GPUS_PER_NODE > 0)) && [[ -z "$SEEN_GPUS" ]] \
    && [[ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)" == 0 ]]; then
    die "GPUS_PER_NODE=$GPUS_PER_NODE, but this machine has no GPU (neither nvidia-smi nor torch finds one); on a CPU leave GPUS_PER_NODE unset (or 0), and set NPROC_PER_NODE=N for N trainer ranks"
fi
# Above the GPUs the node sees (GPUS_PER_NODE=8 with 4, or CUDA_VISIBLE_DEVICES narrowing them),
# ranks and servers would be placed on GPUs that are not there, failing only once started.
if [[ -n "$SEEN_GPUS" ]] && ((10#$GPUS_PER_NODE > SEEN_GPUS)); then
    unset_it=", or leave it unset (the GPUs seen)"
    [[ -z "${SLURM_GPUS_ON_NODE:-}" ]] || unset_it=""  # (unset, it is Slurm's count)
    die "GPUS_PER_NODE=$GPUS_PER_NODE, but this node sees $SEEN_GPUS GPU(s) ($SEEN_HOW); set GPUS_PER_NODE to at most $SEEN_GPUS$unset_it"
fi
if [[ "$NNODES" -gt 1 ]]; then
    [[ -n "${RDZV_ENDPOINT:-}" ]] || die "RDZV_ENDPOINT=host:port of the first node is required with NNODES=$NNODES"
    [[ -n "${LAUNCH_ID:-${SLURM_JOB_ID:-}}" ]] \
        || die "set LAUNCH_ID to the same value on every node of a multi-node launch"
    case "${RDZV_ENDPOINT%:*}" in  # every node on this machine (a simulation): stay on loopback
        127.0.0.1|localhost) SERVER_HOST="${SERVER_HOST:-127.0.0.1}" ;;
        *) SERVER_HOST="${SERVER_HOST:-${SLURMD_NODENAME:-$(hostname)}}" ;;
    esac
else
    RDZV_ENDPOINT="${RDZV_ENDPOINT:-127.0.0.1:$(free_port)}"
    SERVER_HOST="${SERVER_HOST:-127.0.0.1}"
fi
# torchrun takes any RDZV_ENDPOINT (a typo was minutes of c10d warnings, then a failure that
# blamed the checkpoint), and LAUNCH_ID names a directory under RUN_DIR/launch/ (../../x made
# one outside the run directory): both checked here, before anything is made.
HOST_PORT='^([A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})$'
if ! [[ "$RDZV_ENDPOINT" =~ $HOST_PORT ]] || ! in_range "${BASH_REMATCH[3]}" 1 65535; then
    die "RDZV_ENDPOINT=$RDZV_ENDPOINT must be host:port, the first node's address and a free port (e.g. node001:29500)"
fi
# A Slurm requeue runs the job again under its job id: SLURM_RESTART_COUNT (how many times it
# was requeued or restarted; unset before) tells the attempts apart.
LAUNCH_ID="${LAUNCH_ID:-${SLURM_JOB_ID:+$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}}}"
LAUNCH_ID="${LAUNCH_ID:-$(date +%Y%m%d-%H%M%S)-$$}"
[[ "$LAUNCH_ID" =~ ^[A-Za-z0-9._-]+$ && "$LAUNCH_ID" != . && "$LAUNCH_ID" != .. ]] \
    || die "LAUNCH_ID=$LAUNCH_ID must be a plain name (letters, digits, . _ -), the same on every node of the launch"
# The servers and the trainer share an API key: only its holder may drive the servers, and the
# built-in server loads shared-memory (tensor) weight updates only for it. One node makes its
# own; the nodes of a multi-node launch must be given the same one.
if [[ -z "${MEGATRON_GSPO_API_KEY:-}" ]]; then
    ((NNODES == 1)) || die "set MEGATRON_GSPO_API_KEY to the same secret on every node (launch/slurm/train.sbatch makes one)"
    MEGATRON_GSPO_API_KEY="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
fi
export MEGATRON_GSPO_API_KEY

# ---- the layout ------------------------------------------------------------------------------
# Planned before anything is made: a refused launch leaves no run directory behind. plan.py
# also checks --steps and answers a --resume of a run with no step left (`train`'s line, exit 0,
# nothing started or written: every node of a launch asks, and reads the same files).
RUN_DIR="${RUN_DIR:-runs/$(basename "$CONFIG" .yaml)}"
PLAN_ARGS=(--config "$CONFIG" --nnodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE")
[[ -n "${NPROC_PER_NODE:-}" ]] && PLAN_ARGS+=(--nproc-per-node "$NPROC_PER_NODE")
[[ -n "${ROLLOUT_NODES:-}" ]] && PLAN_ARGS+=(--rollout-nodes "$ROLLOUT_NODES")
[[ -n "${SERVERS_PER_NODE:-}" ]] && PLAN_ARGS+=(--servers-per-node "$SERVERS_PER_NODE")
PLAN_ARGS+=("${OVERRIDES[@]}")
RUN_ARGS=(--run-dir "$RUN_DIR")
[[ -n "$STEPS" ]] && RUN_ARGS+=(--steps "$STEPS")
((RESUME)) && RUN_ARGS+=(--resume)
((ALLOW_CHANGE)) && RUN_ARGS+=(--allow-config-change)
PLAN="$("$PYTHON" "$HERE/plan.py" "${RUN_ARGS[@]}" "${PLAN_ARGS[@]}")" || exit 2
# Shell assignments, each value quoted by plan.py (shlex.quote).
eval "$PLAN"
: "${PLACEMENT:?} ${BACKEND:?} ${TRAIN_NODES:?} ${NPROC_PER_NODE:?} ${SERVING_NODES:?}"
: "${TOTAL_SERVERS:?} ${START_ROUTER:?} ${HEALTH_TIMEOUT_S:?}"
if [[ -n "${NOTHING_TO_TRAIN:-}" ]]; then echo "$NOTHING_TO_TRAIN"; exit 0; fi
[[ -n "${SGLANG_PYTHON:-}" ]] && export SGLANG_PYTHON

# ---- this launch's directories -------------------------------------------------------------
# A directory that cannot be made is `train`'s one line, exit 2, not mkdir's (a run directory
# under a file, on a read-only filesystem, of another user). The reason is mkdir's last words.
make_dir() {  # make_dir DIR WHAT FIX: mkdir -p DIR, else "error: WHAT (reason); FIX"
    local out
    out="$(LC_ALL=C mkdir -p -- "$1" 2>&1)" || die "$2 (${out##*: }); $3"
}
make_dir "$RUN_DIR" "cannot make --run-dir $RUN_DIR" "pass --run-dir NEW_DIR"
RUN_DIR="$(cd "$RUN_DIR" && pwd)"
STATE="$RUN_DIR/launch/$LAUNCH_ID"
STARTED="$STATE/started/node$NODE_RANK"
RANK_LOGS="$RUN_DIR/logs/ranks/node$NODE_RANK"
SERVER_LOGS="$RUN_DIR/logs/servers/node$NODE_RANK"
LAUNCH_LOG="$RUN_DIR/logs/launch/node$NODE_RANK.log"

# RUN_DIR/launch/<LAUNCH_ID>/ is this launch's alone. Read as this launch's, an earlier one's
# files misled every node (a Slurm requeue keeps the job id; a relaunch may repeat LAUNCH_ID):
# its urls/ named servers long gone, its `done` and `abort` stopped the nodes at once. So each
# node marks the directory as it starts (started/node<R>), and refuses it where it finds what
# only an earlier launch can have left: its own mark or URLs, an `abort` it wrote, a `done`
# (written once training ended, which needs every node). Another node's files are never taken
# for an earlier launch's: that node may simply have started first.
earlier_launch() {  # what of an earlier launch under this id is there (nothing: none found)
    local mine="urls/node$NODE_RANK.txt"
    if [[ -e "$STARTED" ]]; then echo "started/node$NODE_RANK"
    elif [[ -e "$STATE/$mine" ]]; then echo "$mine"
    elif [[ -e "$STATE/done" ]]; then echo "done"
    elif grep -q "^node $NODE_RANK: " "$STATE/abort" 2>/dev/null; then echo "abort"
    fi
}
used_by_earlier() {  # used_by_earlier WHAT: the refusal, WHAT being what in STATE says so
    die "LAUNCH_ID=$LAUNCH_ID was an earlier launch's ($STATE holds its $1); give this launch a LAUNCH_ID of its own, the same on every node, or remove that directory once no launch uses it"
}
used="$(earlier_launch)"
[[ -z "$used" ]] || used_by_earlier "$used"
fix="make it writable (chmod -R u+w $RUN_DIR) and run the command again, or pass --run-dir NEW_DIR"
for dir in "$STATE/urls" "$STATE/started" "$RANK_LOGS" "$SERVER_LOGS" "$(dirname "$LAUNCH_LOG")"; do
    make_dir "$dir" "cannot write $dir" "$fix"
done
# (made only where absent: a second copy of this node, started under the same id, is refused)
( set -o noclobber; echo "$(hostname) pid $$ $(date '+%F %T')" > "$STARTED" ) 2>/dev/null \
    || used_by_earlier "started/node$NODE_RANK"

log() { echo "[node $NODE_RANK $(date +%H:%M:%S)] $*" | tee -a "$LAUNCH_LOG"; }
fail() { echo "error: $*" | tee -a "$LAUNCH_LOG" >&2; }

TRAINS=0 SERVES=0
[[ "$NODE_RANK" -lt "$TRAIN_NODES" ]] && TRAINS=1
for n in $SERVING_NODES; do [[ "$n" == "$NODE_RANK" ]] && SERVES=1; done
ROLE="trains ($NPROC_PER_NODE ranks)"
((SERVES)) && ROLE="serves"
((TRAINS && SERVES)) && ROLE="trains ($NPROC_PER_NODE ranks) and serves"
log "run $RUN_DIR, launch $LAUNCH_ID: $PLACEMENT $BACKEND on $NNODES node(s); this one $ROLE"

# ---- cleanup: everything started here, by PID --------------------------------------------------
TRAIN_PID="" SERVE_PID="" ROUTER_PID=""
# shellcheck disable=SC2317,SC2329  # the cleanup functions run from the traps below
stop_pid() {  # stop_pid PID NAME GRACE_S: SIGTERM, wait, SIGKILL
    local pid="$1" name="$2" grace="$3" i
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < grace * 5; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name (pid $pid) ignored SIGTERM for ${grace}s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}
# torchrun starts each rank in its own session (process group = the rank's PID) and, when a rank
# dies, stops only the groups of ranks still alive: what a killed rank had started (checkpoint
# writer processes) would outlive the job. So note each rank's group while it runs and stop those
# groups at the end, by their IDs.
WORKER_GROUPS=()
note_workers() {
    [[ -n "$TRAIN_PID" ]] || return 0
    local pid
    for pid in $(ps -o pid= --ppid "$TRAIN_PID" 2>/dev/null); do
        [[ " ${WORKER_GROUPS[*]} " == *" $pid "* ]] || WORKER_GROUPS+=("$pid")
    done
}
# shellcheck disable=SC2317,SC2329
groups_gone() {  # groups_gone PGID...: wait up to 10 s for every group to be empty
    local pg i any
    for ((i = 0; i < 50; i++)); do
        any=0
        for pg in "$@"; do kill -0 -- "-$pg" 2>/dev/null && any=1; done
        ((any)) || return 0
        sleep 0.2
    done
    return 1
}
# shellcheck disable=SC2317,SC2329
stop_worker_groups() {
    local pg live=()
    for pg in "${WORKER_GROUPS[@]}"; do
        kill -TERM -- "-$pg" 2>/dev/null && live+=("$pg")
    done
    ((${#live[@]})) || return 0
    groups_gone "${live[@]}" && return 0
    for pg in "${live[@]}"; do kill -KILL -- "-$pg" 2>/dev/null || true; done
    groups_gone "${live[@]}" || true  # gone, not only signalled, when this script returns
}
# shellcheck disable=SC2317,SC2329
cleanup() {
    trap - EXIT INT TERM
    note_workers
    stop_pid "$TRAIN_PID" "torchrun" 30
    stop_worker_groups
    stop_pid "$ROUTER_PID" "sglang-router" 20
    stop_pid "$SERVE_PID" "rollout servers" 30
}
# shellcheck disable=SC2317,SC2329
on_signal() { log "received $1; stopping what this node started"; cleanup; exit 143; }
trap cleanup EXIT
trap 'on_signal SIGINT' INT
trap 'on_signal SIGTERM' TERM

pause() { sleep "$1" & wait $! || true; }  # a sleep that traps can interrupt

# The run's checkpoints, newest first, one "STEP PATH" a line: every step_N directory, as the
# trainer counts them (one that lost its trainer_state.json is a damaged checkpoint, not none).
checkpoints() {
    local d k
    for d in "$RUN_DIR"/checkpoints/step_*; do
        k="${d##*/step_}"
        if [[ -d "$d" && "$k" =~ ^[0-9]{1,18}$ ]]; then echo "$((10#$k)) $d"; fi
    done | sort -k1,1nr
}
newest_checkpoint() {
    local d=""
    read -r _ d < <(checkpoints) || true
    echo "${d:-none}"
}
# What a rerun does with the run's checkpoints, as the trainer decides it on --resume (a message:
# nothing is checked or moved here): newest first, one that does not verify against its manifest
# is moved to checkpoints/unverified/ and the one before is tried; where none is left, --resume
# refuses (and a start without --resume refuses a run that has checkpoints). Seen here: a lost
# trainer_state.json or manifest.json; what only reading the files shows (a checksum, a format)
# is the trainer's to find.
resume_advice() {
    local d missing damaged="" usable=""
    while read -r _ d; do
        missing=""
        [[ -f "$d/manifest.json" ]] || missing="manifest.json"
        [[ -f "$d/trainer_state.json" ]] || missing="trainer_state.json"
        [[ -z "$missing" ]] && { usable="$d"; break; }
        damaged+="${damaged:+, }${d##*/} (no $missing)"
    done < <(checkpoints)
    if [[ -n "$usable" && -z "$damaged" ]]; then
        echo "last complete checkpoint: $usable; rerun with --resume --run-dir $RUN_DIR to continue"
    elif [[ -n "$usable" ]]; then
        echo "last complete checkpoint: $usable; rerun with --resume --run-dir $RUN_DIR to continue from it (newer, damaged: $damaged; --resume moves them to checkpoints/unverified/)"
    elif [[ -n "$damaged" ]]; then
        echo "no usable checkpoint under $RUN_DIR/checkpoints, only damaged ones: $damaged; --resume would refuse them (nothing changed): restore their files from a copy, or start another run with --run-dir NEW_DIR"
    else
        echo "no complete checkpoint yet under $RUN_DIR/checkpoints; rerun (with or without --resume) to start it again"
    fi
}
abort_job() {  # abort_job MESSAGE [ADVICE]: tell the other nodes, then stop here
    echo "node $NODE_RANK: $1" >> "$STATE/abort"
    fail "$1"
    fail "logs: $RANK_LOGS (per rank), $SERVER_LOGS (servers)"
    fail "${2:-$(resume_advice)}"
}
other_node_failed() { [[ -f "$STATE/abort" ]]; }
refusal() {  # the trainer's `error:` line (its text) in this launch's rank logs here, if any
    local dir old f
    for dir in "$RANK_LOGS"/*; do
        for old in "${LOGS_BEFORE[@]}"; do [[ "$old" != "$dir" ]] || continue 2; done
        for f in "$dir"/attempt_*/*/stderr.log; do
            if [[ -f "$f" ]] && grep -q '^error: ' "$f"; then
                grep '^error: ' "$f" | tail -1 | sed 's/^error: //'
                return 0
            fi
        done
    done
}

# ---- rollout servers on this node ------------------------------------------------------------
SERVE_LOG="$SERVER_LOGS/serve_node.log"
SERVE_LOG_START=0  # the log is appended to by every launch: only this one's part is read
if ((SERVES)); then
    [[ -f "$SERVE_LOG" ]] && SERVE_LOG_START="$(wc -c < "$SERVE_LOG")"
    "$PYTHON" "$HERE/serve_node.py" servers "${PLAN_ARGS[@]}" --node-rank "$NODE_RANK" \
        --host "$SERVER_HOST" --port-base "${SERVER_PORT_BASE:-0}" --log-dir "$SERVER_LOGS" \
        --urls-file "$STATE/urls/node$NODE_RANK.txt" >> "$SERVE_LOG" 2>&1 &
    SERVE_PID=$!
    log "rollout servers starting (pid $SERVE_PID), logs in $SERVER_LOGS"
fi
servers_dead() {
    [[ -n "$SERVE_PID" ]] && ! kill -0 "$SERVE_PID" 2>/dev/null
}
servers_failure() {  # the last error line of this launch's part of the log, else its last line
    local part line
    part="$(tail -c "+$((SERVE_LOG_START + 1))" "$SERVE_LOG" 2>/dev/null || true)"
    line="$(grep -E '^(error|[^ ]*: error):' <<< "$part" | tail -1 || true)"
    [[ -n "$line" ]] || line="$(grep -v '^[[:space:]]*$' <<< "$part" | tail -1 || true)"
    echo "rollout servers on node $NODE_RANK stopped: ${line#error: } (see $SERVE_LOG)"
}

# ---- a node that only serves: hold the servers until training ends ---------------------------
if ((!TRAINS)); then
    while true; do
        if [[ -f "$STATE/done" ]]; then log "training finished; stopping the servers"; exit 0; fi
        if other_node_failed; then fail "another node failed: $(head -1 "$STATE/abort")"; exit 1; fi
        if servers_dead; then abort_job "$(servers_failure)"; exit 1; fi
        pause 1
    done
fi

# ---- a training node: wait for every serving node's URLs --------------------------------------
deadline=$((SECONDS + HEALTH_TIMEOUT_S + 120))
URLS=() URL_NODES=()
for n in $SERVING_NODES; do
    f="$STATE/urls/node$n.txt"
    until [[ -f "$f" ]]; do
        if servers_dead; then abort_job "$(servers_failure)"; exit 1; fi
        if other_node_failed; then fail "another node failed: $(head -1 "$STATE/abort")"; exit 1; fi
        if ((SECONDS > deadline)); then
            abort_job "node $n's rollout servers were not ready after $((HEALTH_TIMEOUT_S + 120)) s; see RUN_DIR/logs/servers/node$n"
            exit 1
        fi
        pause 0.5
    done
    mapfile -t -O "${#URLS[@]}" URLS < "$f"
    while ((${#URL_NODES[@]} < ${#URLS[@]})); do URL_NODES+=("$n"); done
done
log "rollout servers ready: ${URLS[*]}"

ROUTER_URL=""
if ((START_ROUTER)) && [[ "$NODE_RANK" == 0 ]]; then
    ROUTER_PORT="${ROUTER_PORT:-$(free_port)}"
    "$PYTHON" "$HERE/serve_node.py" router --worker-urls "${URLS[@]}" --host "$SERVER_HOST" \
        --port "$ROUTER_PORT" --log-dir "$SERVER_LOGS" --urls-file "$STATE/router.txt" \
        >> "$SERVER_LOGS/router_supervisor.log" 2>&1 &
    ROUTER_PID=$!
    until [[ -f "$STATE/router.txt" ]]; do
        kill -0 "$ROUTER_PID" 2>/dev/null || { abort_job "sglang-router did not start; see $SERVER_LOGS/router.log"; exit 1; }
        pause 0.5
    done
    ROUTER_URL="$(head -1 "$STATE/router.txt")"
    log "sglang-router in front of $TOTAL_SERVERS servers: $ROUTER_URL"
fi

# ---- the trainer -----------------------------------------------------------------------------
url_list="$(printf '"%s",' "${URLS[@]}")"
node_list="$(printf '%s,' "${URL_NODES[@]}")"
TRAIN_ARGS=(--config "$CONFIG" --run-dir "$RUN_DIR")
[[ -n "$STEPS" ]] && TRAIN_ARGS+=(--steps "$STEPS")
((RESUME)) && TRAIN_ARGS+=(--resume)
((ALLOW_CHANGE)) && TRAIN_ARGS+=(--allow-config-change)
TRAIN_ARGS+=("${OVERRIDES[@]}" "rollout.urls=[${url_list%,}]" "rollout.url_nodes=[${node_list%,}]")
[[ -n "$ROUTER_URL" ]] && TRAIN_ARGS+=("rollout.router_url=$ROUTER_URL")  # generation goes through it
if [[ -n "${TRAINER_GPUS:-}" && "$PLACEMENT" == disaggregated && "$NNODES" == 1 ]]; then
    export CUDA_VISIBLE_DEVICES="$TRAINER_GPUS"  # the servers hold the node's other GPUs
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export MEGATRON_GSPO_NODE_RANK="$NODE_RANK"  # the node of each rank, as rollout.url_nodes counts
log "torchrun: $TRAIN_NODES node(s) x $NPROC_PER_NODE ranks, rendezvous $RDZV_ENDPOINT"
shopt -s nullglob
LOGS_BEFORE=("$RANK_LOGS"/*)  # (torchrun logs this launch's ranks in a directory it makes there)
shopt -u nullglob
# torchrun, but exit code 2 when the first rank to fail refused its input (torchrun_agent.py)
"$PYTHON" "$HERE/torchrun_agent.py" \
    --nnodes "$TRAIN_NODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$LAUNCH_ID" \
    --max-restarts 0 --log-dir "$RANK_LOGS" --tee 3 \
    -m megatron_gspo.cli train "${TRAIN_ARGS[@]}" &
TRAIN_PID=$!

code=""
while true; do
    note_workers
    if ! kill -0 "$TRAIN_PID" 2>/dev/null; then
        code=0; wait "$TRAIN_PID" || code=$?
        TRAIN_PID=""
        break
    fi
    if servers_dead; then abort_job "$(servers_failure)"; exit 1; fi
    if other_node_failed; then
        fail "another node failed: $(head -1 "$STATE/abort"); stopping this node's ranks"
        exit 1
    fi
    pause 1
done

if [[ "$code" == 0 ]]; then
    [[ "$NODE_RANK" == 0 ]] && echo 0 > "$STATE/done"
    log "training finished; newest checkpoint: $(newest_checkpoint)"
    exit 0
fi
if [[ "$code" == 2 ]]; then
    # The trainer refused its input (a config --resume does not take, data, a run directory):
    # the same command would be refused again, so the advice is its `error:` line, not --resume.
    said="$(refusal)"
    abort_job "training stopped on node $NODE_RANK: the trainer refused its input (exit 2)${said:+: $said}" \
        "the trainer's error: line above says what it refused; fix that, then run the command again"
    exit 2
fi
abort_job "training stopped on node $NODE_RANK: torchrun exited with code $code (a rank failed or was killed; torchrun's summary above names it)"
exit "$code"
