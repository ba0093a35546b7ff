#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for the SLURM tests (tests/slurm) and for trying
# `launcher=slurm` and `bapo train --slurm-script` by hand (docs/distributed.md#slurm-on-one-machine).
#   bash scripts/slurm_local.sh start    # install (apt-get, only what is missing), configure, start
#   bash scripts/slurm_local.sh stop     # stop the daemons (slurmd, slurmctld, munged; packages stay)
#   bash scripts/slurm_local.sh status   # exit 0 when this host's node answers `sinfo`
# Needs root and Debian's packages (slurmctld, slurmd, slurm-client, munge: 22.05 on bookworm).
# `start` is idempotent: a running cluster of ours is left as it is. It refuses to replace a
# slurm.conf it did not write (a real cluster's). No systemd: the daemons are started by hand,
# as root (SlurmUser=root), with no cgroups (proctrack/linuxproc, task/none), one partition
# `debug` holding this host as its only node, reached at 127.0.0.1.
set -euo pipefail

conf=/etc/slurm/slurm.conf
mark="# written by bapo-cli scripts/slurm_local.sh"
packages=(slurmctld slurmd slurm-client munge)
state=/var/spool/slurmctld
spool=/var/spool/slurmd
logs=/var/log/slurm
partition=${SLURM_LOCAL_PARTITION:-debug}
cred_expire=${SLURM_LOCAL_CRED_EXPIRE:-10}

say() { echo "slurm_local: $*"; }
die() { echo "slurm_local: error: $*" >&2; exit 1; }

node_state() {  # this node's state as sinfo reports it (idle, mixed, down*, ...), empty if none
  timeout 10 sinfo -h -N -n "$(hostname -s)" -o %T 2>/dev/null | head -n 1 || true
}

install() {
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return
  say "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  # a clean machine may have no package lists yet: update only then, or when the install fails
  if ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1 \
    || ! apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; then
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

write_conf() {
  if [ -f "$conf" ] && ! grep -qF "$mark" "$conf"; then
    die "$conf exists and was not written by this script (a real cluster's?); not replacing it"
  fi
  local host node
  host=$(hostname -s)
  # the node as slurmd sees it (CPUs, sockets, cores, memory); memory a little under the total,
  # or slurmd would report less than configured and the node would be drained
  node=$(slurmd -C | head -n 1)
  local mem=${node##*RealMemory=}
  mem=${mem%% *}
  node="${node% RealMemory=*} RealMemory=$((mem * 9 / 10))"
  mkdir -p /etc/slurm "$state" "$spool" "$logs"
  cat > "$conf.tmp" <<EOF
$mark: a single-node cluster for tests
ClusterName=bapo-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits out the job credential's lifetime before it starts again: 120 s by default
AuthInfo=cred_expire=$cred_expire
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
StateSaveLocation=$state
SlurmdSpoolDir=$spool
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$logs/slurmctld.log
SlurmdLogFile=$logs/slurmd.log
ReturnToService=2
# a requeued job whose begin time has come waits for the next scheduling pass: the main one runs
# every 60 s by default and the backfill one every 30 s; here both every second
SchedulerParameters=bf_interval=1,sched_interval=1
MpiDefault=none
MailProg=/bin/true
KillWait=30
MinJobAge=300
$node NodeAddr=127.0.0.1 State=UNKNOWN
# jobs share the cores (up to 4 per core): tests submit beside each other on a 2-core machine
PartitionName=$partition Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  mv "$conf.tmp" "$conf"
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  mkdir -p /etc/munge
  [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 0400 /etc/munge/munge.key
  mkdir -p /run/munge
  chown munge:munge /run/munge 2>/dev/null || true
  # as root munged needs --force; its warning about the log dir's owner (munge) goes to its log
  munged --force 2>>"$logs/munged.start" || { cat "$logs/munged.start" >&2; die "munged did not start"; }
  munge -n | unmunge >/dev/null || die "munged started but a credential does not decode"
}

running() {  # pid file of $1 names a live process
  local pid
  pid=$(cat "/run/$1.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

start() {
  [ "$(id -u)" = 0 ] || die "needs root (apt-get, daemons run as root)"
  command -v apt-get >/dev/null || die "needs apt-get (Debian's slurm packages)"
  case "$(node_state)" in idle* | mixed* | allocated* | completing*)
    if [ -f "$conf" ] && grep -qF "$mark" "$conf"; then say "running: $(hostname -s) $(node_state)"; return; fi
    ;;
  esac
  local t0=$SECONDS
  install
  write_conf
  start_munge
  running slurmctld || slurmctld
  running slurmd || slurmd
  # the node registers within a few seconds; a node left down by an earlier stop is resumed
  for _ in $(seq 1 60); do
    case "$(node_state)" in
      idle* | mixed* | allocated*) say "up in $((SECONDS - t0)) s: $(hostname -s) $(node_state), partition $partition, $(sinfo -V)"; return ;;
      down* | drain*) scontrol update nodename="$(hostname -s)" state=resume 2>/dev/null || true ;;
    esac
    sleep 1
  done
  tail -n 5 "$logs/slurmctld.log" "$logs/slurmd.log" >&2 || true
  die "the node did not become idle in 60 s (sinfo: $(node_state))"
}

stop() {
  for daemon in slurmd slurmctld; do
    if running "$daemon"; then
      kill "$(cat "/run/$daemon.pid")"
    fi
  done
  for _ in $(seq 1 20); do
    if ! running slurmd && ! running slurmctld; then
      # munged last: the daemons talk to it until they are gone
      if running munge/munged; then kill "$(cat /run/munge/munged.pid)"; fi
      say "stopped"
      return
    fi
    sleep 0.5
  done
  die "slurmd / slurmctld still running after 10 s"
}

case "${1-}" in
  start) start ;;
  stop) stop ;;
  status) state_now=$(node_state); [ -n "$state_now" ] && say "$(hostname -s) $state_now" || { say "not running"; exit 1; } ;;
  *) echo "usage: bash scripts/slurm_local.sh start|stop|status" >&2; exit 2 ;;
esac
