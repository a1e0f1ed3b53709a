#!/usr/bin/env bash
# A one-node SLURM on this machine, to try scripts/slurm/ddp.sbatch and hydra/launcher=slurm before a
# real cluster (and for the tests in tests/test_slurm.py). Needs root and Debian's packages:
#
#   sudo scripts/slurm/local-cluster.sh install   # apt-get install slurm-wlm munge
#   sudo scripts/slurm/local-cluster.sh start     # munged, slurmctld, slurmd; one partition "local"
#   scripts/slurm/local-cluster.sh status         # exit 0 when the node takes jobs (1: not running, 2: not
#                                                 # installed, 3: the machine has a SLURM of its own)
#   scripts/slurm/local-cluster.sh config         # print the slurm.conf that start writes
#   sudo scripts/slurm/local-cluster.sh stop
#
# start and stop are idempotent. The node is this machine under the name "localhost", with all of its
# CPUs and memory. Settings that work in a container too: processes are tracked through /proc and not
# cgroups, tasks aren't bound to CPUs, and there is no accounting database (so sacct has nothing to
# report: submitit warns about it and learns a job's end from its result file).
set -euo pipefail
# The daemons and mungekey live in sbin, which a user's PATH may lack (Debian's does).
PATH=$PATH:/usr/sbin:/sbin

SLURM_CONF=/etc/slurm/slurm.conf
MARK="# written by hydra-ddp's scripts/slurm/local-cluster.sh"
PACKAGES="slurm-wlm munge"
STATE_DIR=/var/lib/slurm
LOG_DIR=/var/log/slurm
MUNGE_PID=/run/munge/munged.pid
SLURMCTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
ME=$(basename "$0")

fail() {
    echo "$ME: $*" >&2
    exit 1
}

need_root() {
    [[ $(id -u) == 0 ]] || fail "$1 needs root: sudo $0 $1"
}

missing_commands() {
    local name missing=()
    for name in munged mungekey slurmctld slurmd sinfo sbatch scontrol; do
        command -v "$name" >/dev/null || missing+=("$name")
    done
    echo "${missing[*]}"
}

own_slurm() {  # this machine has a SLURM of its own: a slurm.conf this script didn't write
    [[ -e $SLURM_CONF ]] && ! grep -qxF "$MARK" "$SLURM_CONF"
}

running() {  # pid file (through /proc: any user may look, where kill -0 needs the daemon's user)
    [[ -s $1 && -d /proc/$(cat "$1") ]]
}

node_ready() {  # the node is up and takes jobs
    local state
    state=$(sinfo --noheader --nodes=localhost --format=%T 2>/dev/null) || return 1
    [[ $state =~ ^(idle|mixed|allocated|completing) ]]
}

config() {  # the slurm.conf that start writes
    local cpus memory_mb
    # --all: plain nproc honours OMP_NUM_THREADS (often 1 on CPU boxes), and a 1-CPU node never runs a
    # job that asks for 2. --all counts what slurmd -C counts, every CPU whatever the affinity.
    cpus=$(nproc --all)
    memory_mb=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))  # leave some to the system
    cat <<EOF
$MARK
ClusterName=local
SlurmctldHost=localhost
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=$SLURMCTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
# No cgroups in a container: track processes through /proc and leave tasks unbound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

write_config() {
    mkdir -p "$(dirname "$SLURM_CONF")"
    config >"$SLURM_CONF"
}

install() {
    need_root install
    command -v apt-get >/dev/null || fail "no apt-get here: install SLURM (slurmctld, slurmd, the client commands) and munge with this system's package manager"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $PACKAGES
}

start() {
    need_root start
    local missing
    missing=$(missing_commands)
    if [[ -n $missing ]]; then
        command -v apt-get >/dev/null || fail "missing $missing, and there is no apt-get: install SLURM and munge with this system's package manager"
        fail "missing $missing: sudo $0 install  (apt-get install $PACKAGES)"
    fi
    if own_slurm; then
        fail "$SLURM_CONF is not this script's: this machine has a SLURM of its own, use that one"
    fi
    if running "$SLURMCTLD_PID" && running "$SLURMD_PID" && node_ready; then
        echo "$ME: running: partition local, $(sinfo --noheader --format='%c CPUs, %m MB' --nodes=localhost)"
        return
    fi
    write_config
    mkdir -p "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd" "$LOG_DIR" /run/munge
    chown slurm: "$STATE_DIR/slurmctld" "$LOG_DIR"
    chown munge: /run/munge
    # 9>&-: the daemons don't inherit the lock, which would block every later start or stop
    if ! running "$MUNGE_PID"; then
        [[ -s /etc/munge/munge.key ]] || runuser -u munge -- mungekey --create
        runuser -u munge -- munged --force 9>&-
    fi
    running "$SLURMCTLD_PID" || slurmctld 9>&-
    running "$SLURMD_PID" || slurmd -N localhost 9>&-
    local waited=0
    until node_ready; do
        # a node left down or drained by an earlier run (its jobs killed, its daemons stopped) takes jobs again
        scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true
        (( waited++ < 60 )) || fail "the node did not come up in 30 s: see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log"
        sleep 0.5
    done
    echo "$ME: started: partition local, $(sinfo --noheader --format='%c CPUs, %m MB' --nodes=localhost)"
}

stop() {
    need_root stop
    if own_slurm; then
        fail "$SLURM_CONF is not this script's: not stopping this machine's own SLURM"
    fi
    local pid_file
    for pid_file in "$SLURMD_PID" "$SLURMCTLD_PID" "$MUNGE_PID"; do
        if running "$pid_file"; then
            local pid
            pid=$(cat "$pid_file")
            kill "$pid"
            while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
        fi
    done
    echo "$ME: stopped"
}

status() {  # exit 0: the node takes jobs; 1: it doesn't; 2: not installed; 3: a SLURM of the machine's own
    if own_slurm; then
        echo "$ME: $SLURM_CONF is not this script's: this machine has a SLURM of its own" >&2
        exit 3
    fi
    if [[ -n $(missing_commands) ]]; then
        echo "$ME: not installed: sudo $0 install" >&2
        exit 2
    fi
    # without slurmctld, sinfo would retry for 9 s before it says so
    running "$SLURMCTLD_PID" && node_ready || fail "not running: sudo $0 start"
    echo "$ME: running: partition local, $(sinfo --noheader --format='%c CPUs, %m MB' --nodes=localhost)"
}

case ${1:-} in
    install | status | config) "$1" ;;
    start | stop)
        need_root "$1"
        exec 9>/run/hydra-ddp-local-cluster.lock
        flock 9  # one start or stop at a time (test processes may start it together)
        "$1"
        ;;
    *) fail "usage: $0 install | start | stop | status | config" ;;
esac
