#!/usr/bin/env bash
# Stop what ci_start.sh started: cancel every job, then TERM (later KILL) the daemons by the PIDs in their pidfiles,
# never by process name. Safe to call when nothing runs.
set -uo pipefail

# shellcheck source=daemons.sh
source "$(dirname "$0")/daemons.sh"  # alive, daemon_pid

# 1. jobs first: their slurmstepd processes would outlive slurmd
if daemon_pid /run/slurmctld.pid slurmctld >/dev/null; then
  jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null
    for _ in $(seq 150); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi

# 2. daemons: slurmd and slurmctld together, then munged (slurm needs it to shut down cleanly)
stop_daemons() {   # PIDFILE NAME [PIDFILE NAME ...]
  local pids=() pid
  while [ $# -gt 0 ]; do
    if pid=$(daemon_pid "$1" "$2"); then kill -TERM "$pid" && pids+=("$pid"); fi
    rm -f "$1"   # a stale /run/slurmctld.pid makes the package's prerm fail later
    shift 2
  done
  for _ in $(seq 150); do
    local left=0
    for pid in "${pids[@]}"; do alive "$pid" && left=1; done
    [ "$left" = 0 ] && return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do
    if alive "$pid"; then echo "ci_stop.sh: pid $pid ignored TERM, killing it" >&2; kill -KILL "$pid"; fi
  done
}
stop_daemons /run/slurmd.pid slurmd /run/slurmctld.pid slurmctld
stop_daemons /run/munge/munged.pid munged
echo "slurm stopped"
