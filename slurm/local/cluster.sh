#!/usr/bin/env bash
# A real Slurm cluster on this machine, for tests and for trying Lockstep's Slurm path:
# munged, MariaDB + slurmdbd (submitit reads job states through sacct), slurmctld and 4 slurmd
# daemons acting as fake nodes n1..n4 (4 CPUs each). Everything lives in $LOCKSTEP_SLURM_STATE.
#
#   slurm/local/cluster.sh install   apt-get the Debian packages (root; ~30 s)
#   slurm/local/cluster.sh start     write configs, start daemons, wait until the nodes are idle
#   slurm/local/cluster.sh stop      stop the daemons this script started (by PID)
#   slurm/local/cluster.sh env       print `export SLURM_CONF=...` for clients
set -euo pipefail
STATE=${LOCKSTEP_SLURM_STATE:-/tmp/lockstep-slurm}
NODES=${LOCKSTEP_SLURM_NODES:-4}
HOST=$(hostname -s)
CONF=$STATE/slurm.conf
DB_PORT=${LOCKSTEP_SLURM_DB_PORT:-3417}
DBD_PORT=${LOCKSTEP_SLURM_DBD_PORT:-6919}
CTLD_PORT=${LOCKSTEP_SLURM_CTLD_PORT:-6917}
NODE_PORT0=${LOCKSTEP_SLURM_NODE_PORT:-17001}
export SLURM_CONF=$CONF

say() { echo "[slurm-local] $*" >&2; }

install() {
  command -v slurmctld >/dev/null && command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null && return 0
  [ "$(id -u)" = 0 ] || { say "installing Slurm needs root (apt-get)"; exit 1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q munge slurmctld slurmd slurm-client slurmdbd mariadb-server >/dev/null
}

write_configs() {
  mkdir -p "$STATE"/{ctld,nodes,tmp,db,log}
  local last=$((NODE_PORT0 + NODES - 1))
  cat > "$CONF" <<EOF
ClusterName=lockstep
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdSpoolDir=$STATE/nodes/%n
SlurmdPidFile=$STATE/nodes/%n.pid
SlurmdLogFile=$STATE/log/slurmd-%n.log
TmpFS=$STATE/tmp/%n
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
SchedulerParameters=bf_interval=1,bf_resolution=1,bf_hetjob_immediate,sched_interval=2
EnforcePartLimits=ALL
KillWait=5
ReturnToService=2
JobRequeue=1
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=n[1-$NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[$NODE_PORT0-$last] CPUs=4 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP
EOF
  cat > "$STATE/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=root
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$STATE/slurmdbd.conf"
  for i in $(seq 1 "$NODES"); do mkdir -p "$STATE/nodes/n$i" "$STATE/tmp/n$i"; done
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local t=$1 what=$2; shift 2
  for _ in $(seq 1 $((t * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  say "timed out after ${t}s waiting for $what"; return 1
}

# A slow or shared CI disk makes InnoDB's fsyncs the long pole (CI twice timed out waiting for MariaDB):
# this database holds nothing worth a crash guarantee, so nothing is fsynced. The server's PID is the one
# launched (mariadbd writes its pid file only once initialised, too late for a stop during start-up).
start_mariadb() {
  if [ ! -d "$STATE/db/mysql" ]; then
    mariadb-install-db --user=root --datadir="$STATE/db" --auth-root-authentication-method=normal \
      --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1 || { say "mariadb-install-db failed"; return 1; }
  fi
  if ! db_answers; then
    rm -f "$STATE/mysql.sock"  # a dead server's socket (a machine restarted, a daemon killed) is not a server
    setsid mariadbd --no-defaults --user=root --datadir="$STATE/db" --socket="$STATE/mysql.sock" --port="$DB_PORT" \
       --bind-address=127.0.0.1 --pid-file="$STATE/mariadb.pid" --log-error="$STATE/log/mariadb.log" \
       --innodb-use-native-aio=0 --skip-name-resolve --skip-log-bin --performance-schema=0 \
       --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0 --innodb-flush-method=nosync \
       --innodb-buffer-pool-size=64M </dev/null >/dev/null 2>&1 &
    echo $! > "$STATE/mariadb.launch.pid"
  fi
  wait_for "${LOCKSTEP_SLURM_DB_WAIT:-120}" mariadb db_answers
}

db_answers() { mariadb --no-defaults --socket="$STATE/mysql.sock" -uroot -e "select 1" >/dev/null 2>&1; }

all_idle() { [ "$(sinfo -h -t idle -o %D 2>/dev/null)" = "$NODES" ]; }

# Nodes that registered while slurmctld was still busy can come up DOWN/UNKNOWN: nudge them back.
wait_idle() {
  wait_for 40 "idle nodes" all_idle && return 0
  say "nodes now: $(sinfo -h -N -o '%N:%t' | tr '\n' ' '); resuming them"
  scontrol update nodename="n[1-$NODES]" state=resume >/dev/null 2>&1 || true
  for i in $(seq 1 "$NODES"); do
    [ -f "$STATE/nodes/n$i.pid" ] && kill -0 "$(cat "$STATE/nodes/n$i.pid")" 2>/dev/null || slurmd -f "$CONF" -N "n$i"
  done
  wait_for 80 "idle nodes (after resume)" all_idle
}

dump_logs() {
  local f
  for f in "$STATE"/log/*.log; do
    [ -s "$f" ] || continue
    echo "----- $f (last 25 lines)" >&2; tail -n 25 "$f" >&2
  done
  sinfo -N -l >&2 2>/dev/null || true
}

start_once() {
  write_configs
  # munge: a key, then the daemon (its own pid file)
  mkdir -p /etc/munge /run/munge /var/log/munge /var/lib/munge
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; chmod 400 /etc/munge/munge.key; }
  if ! munge -n >/dev/null 2>&1; then
    munged --force --pid-file="$STATE/munged.pid" --socket=/run/munge/munge.socket.2 >/dev/null 2>&1
  fi
  wait_for 20 munged munge -n || return 1
  # MariaDB for accounting (bound to loopback, own data dir and port). Native AIO (io_uring/libaio)
  # is off: container seccomp profiles often refuse io_uring, and a test database does not need it.
  start_mariadb || return 1
  mariadb --no-defaults --socket="$STATE/mysql.sock" -uroot -e "create database if not exists slurm_acct_db" || return 1
  slurmdbd || return 1  # reads slurmdbd.conf beside $SLURM_CONF
  wait_for 60 slurmdbd bash -c "exec 3<>/dev/tcp/127.0.0.1/$DBD_PORT" || return 1
  slurmctld -f "$CONF" || return 1
  wait_for 60 slurmctld scontrol ping || return 1
  for i in $(seq 1 "$NODES"); do slurmd -f "$CONF" -N "n$i" || return 1; done
  wait_idle || return 1
  # submitit polls sacct: make sure the cluster is known to accounting
  sacctmgr -i add cluster lockstep >/dev/null 2>&1 || true
}

# Two attempts, each from a clean state directory. Each failure prints the daemons' logs.
start() {
  install
  if [ -f "$CONF" ] && scontrol ping >/dev/null 2>&1 && [ "$(sinfo -h -t idle,alloc,mix -o %D 2>/dev/null)" = "$NODES" ]; then
    say "already up ($CONF)"; return 0
  fi
  local attempt t0=$SECONDS
  for attempt in 1 2; do
    # From a clean state: what a killed cluster or a restarted machine left (a dead server's socket,
    # the controller's saved node states) is what stalled CI's start.
    stop >/dev/null 2>&1
    rm -rf "${STATE:?}"/{ctld,nodes,tmp,db,log} "$STATE"/*.pid "$STATE"/*.conf "$STATE"/mysql.sock
    if start_once; then
      say "up in $((SECONDS - t0)) s: $NODES nodes ($(sinfo -h -o '%P %D %t' | tr '\n' ' ')); export SLURM_CONF=$CONF"
      return 0
    fi
    say "start attempt $attempt failed after $((SECONDS - t0)) s; the daemons' logs:"
    dump_logs
  done
  stop
  return 1
}

stop_pidfile() {  # stop_pidfile FILE DAEMON: only a live process of that name (a stale file's PID may be reused)
  local f=$1 name=$2
  [ -f "$f" ] || return 0
  local pid; pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

stop() {
  for f in "$STATE"/nodes/*.pid; do [ -e "$f" ] && stop_pidfile "$f" slurmd; done
  stop_pidfile "$STATE/slurmctld.pid" slurmctld
  stop_pidfile "$STATE/slurmdbd.pid" slurmdbd
  stop_pidfile "$STATE/mariadb.pid" mariadbd
  stop_pidfile "$STATE/mariadb.launch.pid" mariadbd
  rm -f "$STATE/mysql.sock"
  stop_pidfile "$STATE/munged.pid" munged
  say "stopped"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 install|start|stop|env" >&2; exit 2 ;;
esac
