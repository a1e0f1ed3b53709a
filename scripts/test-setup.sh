#!/usr/bin/env bash
# What the test suite needs outside .venv/, set up where it is missing; `make test` runs this before pytest:
#
#   - SLURM and munge (scripts/slurm/local-cluster.sh install), for tests/test_slurm.py;
#   - a headless browser and its driver (Debian's chromium and chromium-driver), for tests/test_trackers.py's
#     test of `make mlflow-ui`'s page;
#   - the one-node SLURM running (scripts/slurm/local-cluster.sh start).
#
#   sudo scripts/test-setup.sh    # or as root; make test runs it as the user who runs make
#
# Installing and starting need root: as root, or through sudo where it asks no password (sudo -n). Each step
# says in one line what it installs or starts (the commands' own output goes to a log, shown if they fail);
# where everything is there, it does nothing and says nothing. Without root or such sudo it installs and starts
# nothing, says in one line what is missing, and exits 0: the tests that need it skip, naming this script.
# A machine with a SLURM of its own (an /etc/slurm/slurm.conf that local-cluster.sh didn't write, as on a
# login node) keeps it: nothing is installed or started for SLURM, and tests/test_slurm.py submits to it only
# where HYDRA_DDP_SLURM_PARTITION names a partition.
set -euo pipefail
cd "$(dirname "$0")/.."

ME=scripts/$(basename "$0")
LOCAL_CLUSTER=scripts/slurm/local-cluster.sh
BROWSER=/usr/bin/chromium
DRIVER=/usr/bin/chromedriver
BROWSER_PACKAGES="chromium chromium-driver"
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
APT_UPDATED=no
SLURM_STATUS=  # local-cluster.sh status's exit code: 0 running, 1 not running, 2 not installed, 3 a SLURM of the machine's own

say() {
    echo "$ME: $*"
}

as_root() {
    if [[ $(id -u) == 0 ]]; then "$@"; else sudo -n "$@"; fi
}

can_be_root() {
    [[ $(id -u) == 0 ]] || { command -v sudo >/dev/null && sudo -n true 2>/dev/null; }
}

quietly() {  # a command's output into the log, shown (its last lines) if it fails
    if ! "$@" >"$LOG" 2>&1; then
        tail -n 30 "$LOG" >&2
        echo "$ME: failed: $*  (TEST_SETUP= make test runs the tests without this set-up)" >&2
        exit 1
    fi
}

cannot() {  # what is missing, and what skips without it
    say "$1, and setting it up needs root: $2 (to run: sudo $ME)"
}

no_apt() {  # what is missing, and what to install without apt-get
    say "$1, and there is no apt-get: install $2 with this system's package manager"
}

slurm_status() {
    SLURM_STATUS=0
    "$LOCAL_CLUSTER" status >/dev/null 2>&1 || SLURM_STATUS=$?
}

install_slurm() {
    [[ $SLURM_STATUS == 2 ]] || return 0
    can_be_root || { cannot "SLURM isn't installed" "tests/test_slurm.py skips"; return; }
    command -v apt-get >/dev/null || { no_apt "SLURM isn't installed" "SLURM (slurmctld, slurmd, the client commands) and munge"; return; }
    say "installing SLURM and munge: $LOCAL_CLUSTER install (apt-get install slurm-wlm munge)"
    quietly as_root "$LOCAL_CLUSTER" install
    APT_UPDATED=yes
    slurm_status
}

install_browser() {
    [[ -e $BROWSER && -e $DRIVER ]] && return
    can_be_root || { cannot "no browser ($BROWSER, $DRIVER)" "tests/test_trackers.py's browser test skips"; return; }
    command -v apt-get >/dev/null || { no_apt "no browser ($BROWSER, $DRIVER)" "chromium and its driver"; return; }
    say "installing the browser: apt-get install $BROWSER_PACKAGES"
    [[ $APT_UPDATED == yes ]] || quietly as_root apt-get update -qq
    quietly as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $BROWSER_PACKAGES
}

start_slurm() {
    case $SLURM_STATUS in
        0 | 2) return ;;  # running; not installed (said above)
        3)
            [[ -n ${HYDRA_DDP_SLURM_PARTITION:-} ]] \
                || say "this machine has a SLURM of its own: tests/test_slurm.py skips; to run it there: HYDRA_DDP_SLURM_PARTITION=<partition> make test"
            return
            ;;
    esac
    can_be_root || { cannot "the one-node SLURM isn't running" "tests/test_slurm.py skips"; return; }
    say "starting the one-node SLURM: $LOCAL_CLUSTER start"
    quietly as_root "$LOCAL_CLUSTER" start
}

slurm_status
install_slurm
install_browser
start_slurm
