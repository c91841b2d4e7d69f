#!/usr/bin/env bash
# Bring up a real one-node Slurm (munged, slurmctld, slurmd) on a Debian 12 machine where we are root and PID 1 is
# not systemd (CI containers). Used by tests/test_slurm.py to run the project's sbatch template for real.
#
#   bash benchmark/launch/slurm/ci_start.sh      # ~10 s on a fresh machine (apt), ~1 s when the packages are there
#   bash benchmark/launch/slurm/ci_stop.sh       # cancels jobs, stops the daemons by the PIDs in their pidfiles
#
# Knobs (environment):
#   SLURM_PARTITIONS="cpu"   partitions to create, all on this node; the first one is the default
#   SLURM_FAKE_GPUS=0        N > 0 gives the node Gres=gpu:N backed by /dev/null-like character devices, so that
#                            --gres=gpu:K schedules and jobs see CUDA_VISIBLE_DEVICES (there is no GPU behind it)
#   SLURM_START_TIMEOUT=60   seconds to wait for the node to report idle
#
# Calling it again is cheap: running daemons are kept unless the generated config changed. Every (re)start of
# slurmctld begins with empty state, so job ids start at 1 and old jobs are gone.
# What this cluster cannot show: no cgroups (memory/CPU limits are scheduling only), one node, no real GPUs.
set -euo pipefail
trap 'echo "ci_start.sh: line $LINENO failed: $BASH_COMMAND" >&2' ERR

read -r -a partitions <<<"${SLURM_PARTITIONS:-cpu}"
fake_gpus=${SLURM_FAKE_GPUS:-0}
timeout=${SLURM_START_TIMEOUT:-60}
node=$(hostname -s)
conf_dir=/etc/slurm
state_dir=/var/lib/slurm
log_dir=/var/log/slurm

# is_up PIDFILE NAME: the process in PIDFILE exists, is not a zombie and is NAME. (Plain `kill -0` is not enough:
# it succeeds on zombies, and PID 1 in these containers reaps exited daemons late.)
is_up() {
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1")
  [ -r "/proc/$pid/stat" ] || return 1
  [ "$(awk '{print $3}' "/proc/$pid/stat")" != Z ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

# take_down PIDFILE NAME: TERM the daemon, wait up to 10 s, then KILL
take_down() {
  is_up "$1" "$2" || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1")
  kill -TERM "$pid"
  for _ in $(seq 100); do is_up "$1" "$2" || break; sleep 0.1; done
  if is_up "$1" "$2"; then kill -KILL "$pid"; fi
  rm -f "$1"
}

fail() {
  echo "ci_start.sh: $*" >&2
  for f in /var/log/munge/munged.log "$log_dir/slurmctld.log" "$log_dir/slurmd.log"; do
    if [ -f "$f" ]; then echo "---- tail $f" >&2; tail -n 25 "$f" >&2; fi
  done
  exit 1
}

# 1. packages (9 debs, ~3.5 MB): --no-install-recommends, else apt pulls in ~40 packages (hdf5, rrd, ...)
need_install=0
for bin in slurmctld slurmd sbatch munged; do
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || need_install=1
done
if [ "$need_install" = 1 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

# 2. munge: the package made a key; systemd would have made /run/munge. munged runs as user munge and returns
#    once its socket accepts connections.
[ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
if ! is_up /run/munge/munged.pid munged; then
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged || fail "munged did not start"
fi
munge -n | unmunge >/dev/null || fail "munge credential round trip failed"

# 3. config for exactly this node, everything on loopback, no cgroup plugins
hw=$(/usr/sbin/slurmd -C | head -n 1)   # NodeName=vm CPUs=2 Boards=1 ... RealMemory=24152
cpus=$(sed -E 's/.*CPUs=([0-9]+).*/\1/' <<<"$hw")
detected_mb=$(sed -E 's/.*RealMemory=([0-9]+).*/\1/' <<<"$hw")
real_mb=$((detected_mb * 9 / 10))   # must not exceed what slurmd detects, or the node is drained
mem_per_cpu=$((real_mb / cpus))     # otherwise a job without --mem books the whole node's memory
topology=$(sed -E 's/^NodeName=[^ ]+ //; s/ RealMemory=[0-9]+//' <<<"$hw")
gres_node=""
gres_types=""
if [ "$fake_gpus" -gt 0 ]; then
  install -d -m 0755 "$state_dir/fakegpu"
  for i in $(seq 0 $((fake_gpus - 1))); do
    [ -c "$state_dir/fakegpu/gpu$i" ] || mknod -m 0666 "$state_dir/fakegpu/gpu$i" c 1 3   # slurmd wants devices
  done
  gres_conf="AutoDetect=off
Name=gpu File=$state_dir/fakegpu/gpu[0-$((fake_gpus - 1))]"
  gres_node=" Gres=gpu:$fake_gpus"
  gres_types="GresTypes=gpu"
fi
partition_lines=""
default=YES
for p in "${partitions[@]}"; do
  partition_lines+="PartitionName=$p Nodes=$node Default=$default MaxTime=INFINITE State=UP"$'\n'
  default=NO
done
new_conf="ClusterName=ci
SlurmctldHost=$node(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
# step credentials live 10 s instead of 120 s; Slurm holds a requeued job back for that long (its credentials are
# revoked until then), so a requeue test waits 10 s instead of 2 minutes
AuthInfo=cred_expire=10
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$state_dir/slurmctld
SlurmdSpoolDir=$state_dir/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$log_dir/slurmctld.log
SlurmdLogFile=$log_dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# no slurmdbd, so no sacct: finished jobs stay in 'scontrol show job' for MinJobAge s and go to the jobcomp log
JobCompType=jobcomp/filetxt
JobCompLoc=$log_dir/jobcomp.log
MinJobAge=3600
SchedulerType=sched/backfill
# refill freed slots at once instead of on a 3 s tick; sched_interval=1: a requeued job is started by the periodic
# scheduler as soon as its BeginTime (cred_expire) has passed, not by the next backfill pass up to 30 s later
SchedulerParameters=batch_sched_delay=0,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$mem_per_cpu
# reject impossible requests at submit time instead of leaving them PENDING forever
EnforcePartLimits=ALL
MpiDefault=none
ReturnToService=2
$gres_types
NodeName=$node NodeAddr=127.0.0.1 $topology RealMemory=$real_mb$gres_node State=UNKNOWN
$partition_lines"

new_conf=$(printf '%s' "$new_conf")   # $(cat file) below drops trailing newlines: compare like with like
install -d -m 0755 "$conf_dir"
old_conf=$(cat "$conf_dir/slurm.conf" 2>/dev/null || true)
old_gres=$(cat "$conf_dir/gres.conf" 2>/dev/null || true)
if [ "$new_conf" != "$old_conf" ] || [ "${gres_conf:-}" != "$old_gres" ]; then
  # running daemons were started with other settings
  take_down /run/slurmd.pid slurmd
  take_down /run/slurmctld.pid slurmctld
  printf '%s\n' "$new_conf" >"$conf_dir/slurm.conf"
  rm -f "$conf_dir/gres.conf"
  if [ -n "${gres_conf:-}" ]; then printf '%s\n' "$gres_conf" >"$conf_dir/gres.conf"; fi
fi
install -d -o slurm -g slurm -m 0755 "$state_dir/slurmctld" "$log_dir"
install -d -m 0755 "$state_dir/slurmd"

# 4. daemons (both fork into the background and write their pidfiles); a fresh controller starts from clean state
if ! is_up /run/slurmctld.pid slurmctld; then
  take_down /run/slurmd.pid slurmd
  rm -rf "${state_dir:?}/slurmctld/"* "${state_dir:?}/slurmd/"*
  rm -f "$log_dir/jobcomp.log" "$log_dir/slurmctld.log" "$log_dir/slurmd.log"
  /usr/sbin/slurmctld -c || fail "slurmctld did not start"   # -c: ignore any saved state
fi
if ! is_up /run/slurmd.pid slurmd; then
  /usr/sbin/slurmd -N "$node" || fail "slurmd did not start"
fi

# 5. ready when the node reports idle
deadline=$((SECONDS + timeout))
until [ "$(sinfo -h -n "$node" -o %t 2>/dev/null | sort -u)" = idle ]; do
  [ "$SECONDS" -lt "$deadline" ] || { sinfo -N -l >&2 || true; fail "node $node not idle after ${timeout}s"; }
  sleep 0.2
done
echo "slurm ready: node $node idle, $cpus cpus, partitions ${partitions[*]}, fake gpus $fake_gpus"
