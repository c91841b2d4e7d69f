#!/usr/bin/env bash
# A real two-node Slurm cluster on one machine (Debian 12's slurm-wlm 22.05 + munge, as root, no systemd), for
# testing multi-node jobs of benchmark/launch/launcher.py (tests/test_slurm_two_nodes.py). Everything lives in DIR:
#
#   bash benchmark/launch/slurm/ci_two_nodes.sh start DIR   # < 1 s when the packages are installed (apt otherwise)
#   bash benchmark/launch/slurm/ci_two_nodes.sh run DIR sbatch ...  # a Slurm client command, run where it reaches it
#   bash benchmark/launch/slurm/ci_two_nodes.sh stop DIR    # cancels jobs, stops daemons, deletes the namespaces
#
# Layout: three network namespaces on a private bridge, nothing added to the host's network namespace (<id> is
# rlhf2n-<6 random hex digits>, written to DIR/netns):
#
#   <id>-ctl    10.77.0.1/24 on the bridge br0 (slurmctld; the clients are run here too)
#   <id>-node1  10.77.0.2/24 on eth0, veth peer of br0's port veth1 (slurmd of node1)
#   <id>-node2  10.77.0.3/24 on eth0, veth peer of br0's port veth2 (slurmd of node2)
#
# There is no route beyond 10.77.0.0/24: traffic stays on the bridge and the namespaces' own loopbacks.
# Each daemon also gets its own UTS and mount namespace: its own hostname (ctl, node1, node2: slurmctld insists that
# its host name is SlurmctldHost's, and a job on node1 sees `hostname` = node1 as on a real cluster) and DIR/hosts
# bind-mounted over /etc/hosts, so that the node names resolve for the jobs too (MASTER_ADDR is a node name).
# `ip netns exec` would remount /sys, and slurmd then finds no cgroup file system: hence nsenter + unshare. A job's
# processes inherit all three namespaces from their slurmd. The cluster has its own slurm.conf, munged (socket and
# key), state, spool, pid and log directories, all in DIR, and its own ports (6827/6828, though each namespace has its
# own port space anyway): the one-node CI cluster of ci_start.sh and anything else on the machine stay as they are.
# The filesystem is shared: a job sees the repository, its virtualenv and DIR at their usual paths.
# No cgroups (as in ci_start.sh): CPU and memory limits are scheduling only; both nodes share this machine's cores.
#
# Knobs (environment): SLURM_START_TIMEOUT=60 (seconds to wait for both nodes to be idle).
set -euo pipefail
trap 'echo "ci_two_nodes.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR

usage() {
  echo "usage: ci_two_nodes.sh start|stop DIR  or  ci_two_nodes.sh run DIR COMMAND [ARGS...]" >&2
  exit 2
}
[ $# -ge 2 ] || usage
action=$1
dir=$(realpath -m "$2")
shift 2
timeout=${SLURM_START_TIMEOUT:-60}
subnet=10.77.0
nodes=(node1 node2)
conf=$dir/slurm.conf

# shellcheck source=daemons.sh
source "$(dirname "$0")/daemons.sh"  # alive, daemon_pid
# the namespace names, written by `start` before it creates them, so that `stop` finds them even after a failure
netns_names() { if [ -s "$dir/netns" ]; then cat "$dir/netns"; fi; }
ctl_netns() { head -n 1 "$dir/netns"; }
# in_cluster COMMAND...: run a client command in the controller's network namespace, against this cluster's config
in_cluster() { nsenter --net="/run/netns/$(ctl_netns)" env SLURM_CONF="$conf" "$@"; }

fail() {
  echo "ci_two_nodes.sh: $*" >&2
  for f in "$dir"/log/*.log; do
    if [ -f "$f" ]; then echo "---- tail $f" >&2; tail -n 25 "$f" >&2; fi
  done
  exit 1
}

# in_namespaces NETNS HOSTNAME COMMAND...: exec COMMAND in NETNS with its own hostname and DIR/hosts as /etc/hosts
in_namespaces() {
  local netns=$1 name=$2
  shift 2
  nsenter --net="/run/netns/$netns" unshare --uts --mount --propagation private \
    sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' sh "$dir/hosts" "$name" "$@"
}

start() {
  # 1. packages: slurm-wlm + munge (9 debs, ~3.5 MB, as ci_start.sh installs them) and iproute2 for `ip netns`
  local packages=() bin
  for bin in slurmctld slurmd sbatch munged; do
    command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || packages=(slurm-wlm munge)
  done
  command -v ip >/dev/null 2>&1 || packages+=(iproute2)
  if [ ${#packages[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
  fi
  [ ! -e "$dir/netns" ] || fail "$dir already holds a cluster: stop it first"
  # munged wants execute permission for everyone on the directories above its socket
  install -d -m 0755 "$dir" "$dir/munge" "$dir/run" "$dir/log" "$dir/state" "$dir/spool"
  install -d -m 0700 "$dir/munge-key"

  # 2. network: the bridge and the veth pairs are created inside the namespaces, never in the host's
  local id i netns
  id=rlhf2n-$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')
  printf '%s\n' "$id-ctl" "$id-node1" "$id-node2" >"$dir/netns"
  for netns in $(netns_names); do
    ip netns add "$netns"
    ip -n "$netns" link set lo up
  done
  ip -n "$id-ctl" link add br0 type bridge
  ip -n "$id-ctl" addr add "$subnet.1/24" dev br0
  ip -n "$id-ctl" link set br0 up
  for i in 1 2; do
    ip -n "$id-ctl" link add "veth$i" type veth peer name eth0 netns "$id-node$i"
    ip -n "$id-ctl" link set "veth$i" master br0 up
    ip -n "$id-node$i" addr add "$subnet.$((i + 1))/24" dev eth0
    ip -n "$id-node$i" link set eth0 up
  done
  printf '127.0.0.1 localhost\n%s.1 ctl\n%s.2 node1\n%s.3 node2\n' "$subnet" "$subnet" "$subnet" >"$dir/hosts"

  # 3. munge: its own key and socket, run as root (the machine's munged, if any, is not touched)
  mungekey --create --keyfile="$dir/munge-key/munge.key"
  /usr/sbin/munged --socket="$dir/munge/munge.socket" --key-file="$dir/munge-key/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" ||
    fail "munged did not start"
  munge -S "$dir/munge/munge.socket" -n | unmunge -S "$dir/munge/munge.socket" >/dev/null ||
    fail "munge credential round trip failed"

  # 4. config: both nodes claim this machine's cores; cores only (no memory) are scheduled
  local topology
  topology=$(/usr/sbin/slurmd -C | head -n 1 | sed -E 's/^NodeName=[^ ]+ //; s/ RealMemory=[0-9]+//')
  cat >"$conf" <<CONF
ClusterName=two
SlurmctldHost=ctl($subnet.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# step credentials live 10 s instead of 120 s: Slurm holds a requeued job back for that long
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
SlurmctldPort=6827
SlurmdPort=6828
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.log
MinJobAge=3600
SchedulerType=sched/backfill
# sched_interval=1: a requeued job is started by the periodic scheduler once its BeginTime (cred_expire) has passed;
# with the default of 60 s it waited up to a minute more (the backfill pass did not pick it up either)
SchedulerParameters=batch_sched_delay=0,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
EnforcePartLimits=ALL
MpiDefault=none
ReturnToService=2
NodeName=node1 NodeAddr=$subnet.2 $topology State=UNKNOWN
NodeName=node2 NodeAddr=$subnet.3 $topology State=UNKNOWN
PartitionName=two Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
CONF

  # 5. daemons (each forks into the background and writes its pidfile)
  in_namespaces "$id-ctl" ctl /usr/sbin/slurmctld -c -f "$conf" || fail "slurmctld did not start"
  for node in "${nodes[@]}"; do
    install -d -m 0755 "$dir/spool/$node"
    in_namespaces "$id-$node" "$node" /usr/sbin/slurmd -f "$conf" -N "$node" || fail "slurmd of $node did not start"
  done

  # 6. ready when both nodes report idle
  local deadline=$((SECONDS + timeout))
  until [ "$(in_cluster sinfo -h -o %t 2>/dev/null | sort -u)" = idle ] &&
    [ "$(in_cluster sinfo -h -N -o %N 2>/dev/null | sort -u | wc -l)" = 2 ]; do
    [ "$SECONDS" -lt "$deadline" ] || { in_cluster sinfo -N -l >&2 || true; fail "nodes not idle after ${timeout}s"; }
    sleep 0.2
  done
  echo "slurm ready: nodes ${nodes[*]} idle in network namespaces $(netns_names | tr '\n' ' ')(SLURM_CONF=$conf)"
}

# stop_pids PID...: TERM, wait up to 15 s, then KILL
stop_pids() {
  local pid left
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  for _ in $(seq 150); do
    left=0
    for pid in "$@"; do if alive "$pid"; then left=1; fi; done
    [ "$left" = 0 ] && return 0
    sleep 0.1
  done
  for pid in "$@"; do
    if alive "$pid"; then echo "ci_two_nodes.sh: pid $pid ignored TERM, killing it" >&2; kill -KILL "$pid" || true; fi
  done
}

stop() {
  set +e   # best effort: one failing step must not leave the rest running
  trap - ERR
  local pids=() pid netns node
  # 1. jobs first: their slurmstepd processes would outlive slurmd
  if [ -s "$dir/netns" ] && daemon_pid "$dir/run/slurmctld.pid" slurmctld >/dev/null; then
    in_cluster scancel --full --quiet --partition two 2>/dev/null || true
    for _ in $(seq 150); do [ -z "$(in_cluster squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  # 2. the daemons, by their pidfiles
  for node in "${nodes[@]}"; do
    if pid=$(daemon_pid "$dir/run/slurmd-$node.pid" slurmd); then pids+=("$pid"); fi
  done
  if pid=$(daemon_pid "$dir/run/slurmctld.pid" slurmctld); then pids+=("$pid"); fi
  stop_pids "${pids[@]}"
  # 3. whatever still runs in the namespaces (a job step that ignored the cancel), then the namespaces themselves:
  #    deleting a namespace deletes its interfaces and the bridge
  for netns in $(netns_names); do
    if [ -e "/run/netns/$netns" ]; then
      mapfile -t pids < <(ip netns pids "$netns" 2>/dev/null)
      stop_pids "${pids[@]}"
      ip netns delete "$netns"
    fi
  done
  # 4. munged last: slurm needs it to shut down cleanly
  if pid=$(daemon_pid "$dir/munge/munged.pid" munged); then stop_pids "$pid"; fi
  rm -f "$dir/netns"
  echo "slurm stopped: $dir"
}

case "$action" in
  start) start ;;
  stop) stop ;;
  run)
    [ $# -gt 0 ] || usage
    [ -s "$dir/netns" ] || fail "no cluster in $dir"
    trap - ERR
    in_cluster "$@"
    ;;
  *) usage ;;
esac
