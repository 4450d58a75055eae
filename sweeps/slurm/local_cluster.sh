#!/usr/bin/env bash
# A real single-node SLURM cluster on localhost: munge, MariaDB + slurmdbd (accounting, so sacct
# sees failed and cancelled jobs), slurmctld and slurmd, every port on 127.0.0.1.
#
#   sweeps/slurm/local_cluster.sh start    # install (Debian packages, as root) if missing, start, wait for an idle node
#   sweeps/slurm/local_cluster.sh stop     # stop the daemons by their pid files
#   sweeps/slurm/local_cluster.sh status   # exit 0 when the node is idle and sacct answers
#
# Needs root and no systemd (daemons are started by hand). State and logs go to $LAB_SLURM_DIR
# (default /tmp/lab-slurm). /etc/slurm/slurm.conf is written only if absent or written by this script.
set -euo pipefail

STATE=${LAB_SLURM_DIR:-/tmp/lab-slurm}
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
MARK="# written by sweeps/slurm/local_cluster.sh"

say() { echo "local_cluster: $*" >&2; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2; shift 2
  for ((i = 0; i < limit * 5; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  say "timed out after ${limit}s waiting for $what (logs in $STATE/log)"
  return 1
}

node_idle() { [ "$(sinfo -h -o %T 2>/dev/null | head -n1)" = idle ]; }

install_packages() {
  local missing=()
  for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge slurmdbd:slurmdbd \
              mariadbd:mariadb-server; do
    command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

check_conf_ours() {
  for f in "$CONF" "$DBD_CONF"; do
    if [ -e "$f" ] && ! grep -qF "$MARK" "$f"; then
      say "$f exists and was not written by this script; not touching a real cluster's configuration"
      exit 1
    fi
  done
}

write_confs() {
  local node cpus mem_mb
  node=$(hostname -s)
  cpus=$(nproc)
  mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
  install -d -m 0755 /etc/slurm "$STATE/ctld" "$STATE/d" "$STATE/log"
  umask 077
  cat >"$DBD_CONF.tmp" <<CONF
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
CommunicationParameters=NoInAddrAny
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
CONF
  mv "$DBD_CONF.tmp" "$DBD_CONF"
  umask 022
  cat >"$CONF.tmp" <<CONF
$MARK
ClusterName=lab
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=100000
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=300
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
  mv "$CONF.tmp" "$CONF"
}

start() {
  if [ "$(id -u)" -ne 0 ]; then say "needs root (daemons, /etc/slurm, Debian packages)"; exit 1; fi
  if [ -d /run/systemd/system ]; then say "systemd is running; use its units instead of this script"; exit 1; fi
  if status >/dev/null 2>&1; then say "already running"; return 0; fi
  install_packages
  check_conf_ours
  local loopback
  loopback=$(getent hosts "$(hostname)" | awk '{print $1; exit}')
  case "$loopback" in 127.*|::1) ;; *) say "$(hostname) resolves to '$loopback', not loopback"; exit 1 ;; esac
  write_confs

  install -d -o munge -g munge -m 0755 /run/munge
  [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create
  [ -S /run/munge/munge.socket.2 ] && munge -n >/dev/null 2>&1 || runuser -u munge -- /usr/sbin/munged
  wait_for 10 munged munge -n

  install -d -o mysql -g mysql /run/mysqld
  if ! mariadb -e 'select 1' >/dev/null 2>&1; then
    nohup runuser -u mysql -- /usr/sbin/mariadbd --skip-networking --socket=/run/mysqld/mysqld.sock \
      --pid-file=/run/mysqld/mysqld.pid >"$STATE/log/mariadb.log" 2>&1 &
  fi
  wait_for 30 MariaDB mariadb -e 'select 1'

  slurmdbd
  wait_for 30 slurmdbd bash -c "exec 3<>/dev/tcp/127.0.0.1/6819"
  slurmctld
  slurmd
  wait_for 60 "an idle node" node_idle
  wait_for 30 "accounting (sacct)" sacct -n -X
  say "up: node $(hostname -s), $(nproc) CPUs, partition debug; state and logs in $STATE"
}

stop_pidfile() {  # stop_pidfile NAME FILE
  local pid
  [ -s "$2" ] || return 0
  pid=$(cat "$2")
  if kill "$pid" 2>/dev/null; then
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    say "stopped $1 ($pid)"
  fi
}

stop() {
  stop_pidfile slurmd "$STATE/slurmd.pid"
  stop_pidfile slurmctld "$STATE/slurmctld.pid"
  stop_pidfile slurmdbd "$STATE/slurmdbd.pid"
  stop_pidfile mariadb /run/mysqld/mysqld.pid
  stop_pidfile munged /run/munge/munged.pid
}

status() {
  node_idle || { echo "no idle node"; return 1; }
  sacct -n -X >/dev/null 2>&1 || { echo "accounting (sacct) does not answer"; return 1; }
  echo "up"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
