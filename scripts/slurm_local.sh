#!/usr/bin/env bash
# A one-node Slurm cluster on loopback (Debian's slurmctld + slurmd), for the opt-in Slurm test
# tier (tests/slurm) and for trying launch/slurm/train.sbatch without a cluster.
#
#   bash scripts/slurm_local.sh start     # prints the SLURM_CONF line to export
#   bash scripts/slurm_local.sh status
#   bash scripts/slurm_local.sh stop      # stops the two daemons by their PID files
#
# Needs Debian's packages: apt-get install slurmctld slurmd slurm-client (as root;
# SLURM_LOCAL_INSTALL=1 makes `start` install them). The daemons run as the calling user with
# auth/none: this is a test cluster bound to 127.0.0.1, never a shared one.
# State, config and logs live in SLURM_LOCAL_DIR (default /tmp/megatron-gspo-slurm); ports
# SLURM_LOCAL_PORT and +1 (default 16817).
set -euo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/megatron-gspo-slurm}"
PORT="${SLURM_LOCAL_PORT:-16817}"
CONF="$DIR/slurm.conf"
NODE="$(hostname -s)"

die() { echo "error: $*" >&2; exit 2; }

need_packages() {
    local missing=()
    for exe in slurmctld slurmd sbatch srun sinfo scontrol; do
        command -v "$exe" >/dev/null || missing+=("$exe")
    done
    ((${#missing[@]} == 0)) && return 0
    if [[ "${SLURM_LOCAL_INSTALL:-0}" == 1 && "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            slurmctld slurmd slurm-client >/dev/null
        return 0
    fi
    die "${missing[*]} not found; install Debian's Slurm: apt-get install slurmctld slurmd slurm-client (or SLURM_LOCAL_INSTALL=1 as root)"
}

write_conf() {
    local cpus mem_mb user
    cpus="$(nproc)"
    mem_mb="$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"
    user="$(id -un)"
    mkdir -p "$DIR/state" "$DIR/spool"
    cat > "$CONF" <<EOF
# Written by scripts/slurm_local.sh: one node on loopback, no accounting, no cgroups.
ClusterName=gspolocal
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait=30
InactiveLimit=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

# DIR holds the config the daemons run and the PID files `stop` kills by: under /tmp another
# user could have made it first (and put a config or a PID of their choosing there). So it must
# be this user's and writable by nobody else; it is made so when it does not exist yet.
own_dir() {
    [[ -e "$DIR" ]] || (umask 077 && mkdir -p "$DIR")
    local owner mode
    owner="$(stat -L -c %u "$DIR")" mode="$(stat -L -c %a "$DIR")"
    if [[ -L "$DIR" || ! -d "$DIR" || "$owner" != "$(id -u)" ]] || (((8#$mode & 8#022) != 0)); then
        die "SLURM_LOCAL_DIR $DIR is not a directory of this user that only it can write (owner uid $owner, mode $mode); remove it or set SLURM_LOCAL_DIR to one"
    fi
}

pid_alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

node_state() { SLURM_CONF="$CONF" sinfo -h -N -o '%t' 2>/dev/null | head -1; }

start() {
    need_packages
    if pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid"; then
        echo "already running; export SLURM_CONF=$CONF"
        return 0
    fi
    stop >/dev/null
    write_conf
    slurmctld -f "$CONF" -c -i || die "slurmctld did not start; see $DIR/slurmctld.log"
    slurmd -f "$CONF" -N "$NODE" || die "slurmd did not start; see $DIR/slurmd.log"
    local state="" i
    for ((i = 0; i < 60; i++)); do
        state="$(node_state)"
        [[ "$state" == idle ]] && break
        if [[ "$state" == down* || "$state" == drain* ]]; then
            SLURM_CONF="$CONF" scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
        fi
        sleep 1
    done
    [[ "$state" == idle ]] || die "node $NODE is '$state', not idle, after 60 s; see $DIR/slurmctld.log and $DIR/slurmd.log"
    echo "slurm on loopback: node $NODE idle ($(nproc) CPUs); export SLURM_CONF=$CONF"
}

stop_daemon() {  # stop_daemon PIDFILE NAME
    local pidfile="$1" name="$2" pid i
    pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    pid="$(cat "$pidfile")"
    kill -TERM "$pid"
    for ((i = 0; i < 50; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
        echo "$name (pid $pid) ignored SIGTERM; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

stop() {
    stop_daemon "$DIR/slurmd.pid" slurmd
    stop_daemon "$DIR/slurmctld.pid" slurmctld
    echo "stopped"
}

status() {
    if pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid"; then
        echo "running: node $NODE $(node_state); export SLURM_CONF=$CONF"
    else
        echo "not running"
        return 1
    fi
}

case "${1:-}" in
    start) own_dir; start ;;
    stop) own_dir; stop ;;
    status) own_dir; status ;;
    *) die "usage: scripts/slurm_local.sh start|stop|status" ;;
esac
