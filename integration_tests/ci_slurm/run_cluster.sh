#!/usr/bin/env bash
# A real two-node SLURM cluster on this machine, running the integration suite through sbatch.
#
#   bash integration_tests/ci_slurm/run_cluster.sh
#
# What it does: installs Debian's slurm packages if missing (apt-get update once; slurmctld
# slurmd slurm-client munge), starts its own munged, then slurmctld and two slurmd "nodes",
# each in its own network namespace on a private bridge (10.200.0.10 controller, .11 / .12
# nodes) with its own hostname and hosts file; submits integration_tests/slurm/suite.sbatch
# (minus its GPU request) with `sbatch --nodes=2` (CPU, gloo), polls `scontrol show job`,
# and checks the job's exit code and its summary lines. Teardown always runs (trap): it
# stops only the daemons it started and the processes inside its own namespaces, by PID,
# and removes its namespaces, bridge, route and work dir (the flock file stays, empty).
# Network containment: while up, `ip route add unreachable 10.200.0.0/16`; the host has no
# address on the bridge; all traffic goes between the namespaces this script created.
#
# Exit status: 0 passed, or skipped with a "SKIP: reason" line when the machine does not
# allow it (not root, no network namespaces, no apt-get for missing packages, subnet in use);
# non-zero on a real failure. Variables:
#   PYTHON           interpreter for the job (default: python3 on PATH); a torchtitan env
#                    also runs the training parity test
#   SLURM_CI_NPROC   ranks per node (default 1: the world size is 2)
#   SLURM_CI_TIMEOUT seconds to wait for the job (default 600)
#   SLURM_CI_ARGS    extra suite arguments (e.g. "--tests job/* cp_parity/p2p")
#   SLURM_CI_KEEP_LOGS  1: keep the work dir (logs) after the run
# Facts this relies on (measured here): slurmd dies under `ip netns exec` (it remounts /sys:
# "No filesystem mounted on /sys/fs/cgroup"), so daemons start with nsenter --net plus
# unshare --mount --uts; without per-node host names resolving to node addresses gloo binds
# 127.0.0.1 and torchrun's c10d rendezvous finds no host.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SUBNET=10.200.0.0/16
CTL_IP=10.200.0.10
NODE_IPS=(10.200.0.11 10.200.0.12)
NODE_NAMES=(vcpn1 vcpn2)
CTL_NAME=vcpctl
NPROC=${SLURM_CI_NPROC:-1}
JOB_TIMEOUT=${SLURM_CI_TIMEOUT:-600}
SUITE_ARGS=${SLURM_CI_ARGS:-}
LOCK=/run/lock/varlen-cp-slurm-ci.lock
TAG=vcp$(( $$ % 100000 ))        # names unique to this run; interface names <= 15 chars
START=$(date +%s.%N)

WORK="" JOB_ID="" ROUTE_ADDED=0 BRIDGE="" NETNS=() DAEMON_PIDS=() LOCK_FD=""

say() { echo "slurm-ci: $*"; }
elapsed() { awk -v s="$START" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }'; }
skip() { echo "SKIP: slurm-ci: $*"; exit 0; }
fail() { echo "FAIL: slurm-ci: $*" >&2; exit 1; }

# ------------------------------------------------------------------------ preconditions
preflight() {
  [ "$(uname -s)" = Linux ] || skip "not Linux"
  [ "$(id -u)" -eq 0 ] || skip "needs root (network namespaces, daemons)"
  for tool in ip nsenter unshare flock awk; do
    command -v "$tool" >/dev/null || skip "$tool not found"
  done
  if ! ip netns add "${TAG}probe" 2>/dev/null; then
    skip "cannot create network namespaces here (ip netns add failed)"
  fi
  ip netns del "${TAG}probe"
  PYTHON=$(command -v "${PYTHON:-python3}") || fail "PYTHON=${PYTHON:-python3} not found"
  # find_spec, not import: importing torch would add ~5 s here.
  "$PYTHON" -c "import importlib.util as u, sys
sys.exit(0 if u.find_spec('torch') and u.find_spec('varlen_cp') else 1)" \
    || fail "$PYTHON cannot find torch and varlen_cp (pip install -e $REPO)"
}

install_packages() {
  local missing=()
  for bin in slurmctld slurmd sbatch munged; do
    command -v "$bin" >/dev/null || missing+=("$bin")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || skip "slurm not installed (${missing[*]}) and no apt-get"
  say "installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
  local t0=$SECONDS
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
         slurmctld slurmd slurm-client munge >/dev/null \
    || fail "apt-get install of the slurm packages failed"
  say "packages installed in $(( SECONDS - t0 )) s"
}

# --------------------------------------------------------------------------- teardown
kill_pids() {  # kill_pids PID...: TERM, wait up to 10 s, then KILL what is left
  local pid alive
  [ $# -eq 0 ] && return 0
  kill -TERM "$@" 2>/dev/null
  for _ in $(seq 50); do
    alive=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive -eq 0 ] && return 0
    sleep 0.2
  done
  kill -KILL "$@" 2>/dev/null
}

teardown() {
  local rc=$? ns pids
  trap - EXIT INT TERM
  if [ -n "$JOB_ID" ] && [ -n "$WORK" ]; then
    in_ctl scancel "$JOB_ID" >/dev/null 2>&1
  fi
  # Whatever still runs inside our namespaces (job steps, slurmstepd) was started by us.
  for ns in "${NETNS[@]}"; do
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    # shellcheck disable=SC2086
    [ -n "$pids" ] && kill_pids $pids
  done
  kill_pids "${DAEMON_PIDS[@]}"
  for ns in "${NETNS[@]}"; do ip netns del "$ns" 2>/dev/null; done
  [ -n "$BRIDGE" ] && ip link del "$BRIDGE" 2>/dev/null
  [ $ROUTE_ADDED -eq 1 ] && ip route del unreachable "$SUBNET" 2>/dev/null
  if [ -n "$WORK" ]; then
    if [ "${SLURM_CI_KEEP_LOGS:-0}" = 1 ]; then say "logs kept in $WORK"; else rm -rf "$WORK"; fi
  fi
  say "torn down (total $(elapsed) s)"
  exit "$rc"
}

# ---------------------------------------------------------------------------- network
setup_network() {
  # Our unreachable route must not shadow a real one (e.g. 10.0.0.0/8 via a VPN).
  if ip route show match "$SUBNET" | grep -v "^default" | grep -q . \
     || ip -o addr | grep -q " 10\.200\."; then
    skip "$SUBNET is already routed or addressed on this machine"
  fi
  ip route add unreachable "$SUBNET" || fail "ip route add unreachable $SUBNET failed"
  ROUTE_ADDED=1
  BRIDGE=${TAG}br
  ip link add "$BRIDGE" type bridge || fail "cannot create bridge $BRIDGE"
  ip link set "$BRIDGE" up
  local i names=("$CTL_NAME" "${NODE_NAMES[@]}") ips=("$CTL_IP" "${NODE_IPS[@]}")
  for i in "${!names[@]}"; do
    add_host "${TAG}${i}" "${names[$i]}" "${ips[$i]}"
  done
}

add_host() {  # add_host NETNS HOSTNAME IP: a namespace with a veth on the bridge
  local ns=$1 host=$2 ip=$3
  ip netns add "$ns" || fail "ip netns add $ns failed"
  NETNS+=("$ns")
  ip link add "${ns}h" type veth peer name "${ns}n" || fail "veth for $ns"
  ip link set "${ns}n" netns "$ns"
  ip link set "${ns}h" master "$BRIDGE" up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$ip/24" dev "${ns}n"
  ip -n "$ns" link set "${ns}n" up
  mkdir -p "$WORK/etc/$host"
  echo "$host" >"$WORK/etc/$host/hostname"
}

write_hosts() {
  {
    echo "127.0.0.1 localhost"
    echo "$CTL_IP $CTL_NAME"
    local i
    for i in "${!NODE_NAMES[@]}"; do echo "${NODE_IPS[$i]} ${NODE_NAMES[$i]}"; done
  } >"$WORK/etc/hosts"
}

# The command prefix that runs a command as host HOST: its namespace's network, and in a
# private mount + UTS namespace its own hostname and our hosts file (not `ip netns exec`:
# see the header). Every step execs, so a background command's $! is the daemon's PID.
host_prefix() {  # host_prefix ARRAY_NAME NETNS HOSTNAME
  local -n _out=$1
  _out=(nsenter --net="/run/netns/$2" unshare --mount --uts -- /bin/sh -c '
    echo "$1" >/proc/sys/kernel/hostname && mount --bind "$2" /etc/hosts && shift 2 &&
    exec "$@"' sh "$3" "$WORK/etc/hosts")
}
as_host() {  # as_host NETNS HOSTNAME CMD...
  local -a pre
  host_prefix pre "$1" "$2"
  shift 2
  "${pre[@]}" "$@"
}
in_ctl() { as_host "${TAG}0" "$CTL_NAME" "$@"; }

# ---------------------------------------------------------------------------- daemons
write_configs() {
  mkdir -p "$WORK"/{munge,state,spool,log,run}
  chmod 700 "$WORK/munge"
  dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 status=none
  chmod 600 "$WORK/munge/munge.key"
  local nodes
  nodes=$(IFS=,; echo "${NODE_NAMES[*]}")
  cat >"$WORK/slurm.conf" <<EOF
ClusterName=vcpci
SlurmctldHost=$CTL_NAME($CTL_IP)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$WORK/munge/munge.sock
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool/%n
SlurmctldPidFile=$WORK/run/slurmctld.pid
SlurmdPidFile=$WORK/run/slurmd.%n.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.%n.log
# No cgroups in these namespaces: plain process tracking, no task plugin.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
# Both nodes share this machine's cores: take CPUs from this file, not from the hardware.
SlurmdParameters=config_overrides
MailProg=/bin/true
SlurmctldTimeout=30
SlurmdTimeout=60
MinJobAge=600
NodeName=${NODE_NAMES[0]} NodeAddr=${NODE_IPS[0]} CPUs=2 State=UNKNOWN
NodeName=${NODE_NAMES[1]} NodeAddr=${NODE_IPS[1]} CPUs=2 State=UNKNOWN
PartitionName=ci Nodes=$nodes Default=YES MaxTime=60 State=UP
EOF
  export SLURM_CONF="$WORK/slurm.conf"
}

start_daemons() {
  munged --foreground --force --socket="$WORK/munge/munge.sock" \
    --key-file="$WORK/munge/munge.key" --pid-file="$WORK/munge/munged.pid" \
    --log-file="$WORK/log/munged.log" --seed-file="$WORK/munge/seed" \
    >>"$WORK/log/munged.out" 2>&1 &
  DAEMON_PIDS+=($!)
  wait_for 10 "munged socket" test -S "$WORK/munge/munge.sock"
  local -a pre
  host_prefix pre "${TAG}0" "$CTL_NAME"
  "${pre[@]}" slurmctld -D -i -f "$SLURM_CONF" >>"$WORK/log/slurmctld.out" 2>&1 &
  DAEMON_PIDS+=($!)
  local i
  for i in "${!NODE_NAMES[@]}"; do
    host_prefix pre "${TAG}$(( i + 1 ))" "${NODE_NAMES[$i]}"
    "${pre[@]}" slurmd -D -N "${NODE_NAMES[$i]}" -f "$SLURM_CONF" \
      >>"$WORK/log/slurmd.${NODE_NAMES[$i]}.out" 2>&1 &
    DAEMON_PIDS+=($!)
  done
  wait_for 60 "both nodes idle" nodes_idle
}

nodes_idle() {
  local states
  states=$(in_ctl sinfo -h -N -o "%T" 2>/dev/null | sort -u | tr '\n' ' ')
  [ "$states" = "idle " ]
}

wait_for() {  # wait_for SECONDS WHAT CMD...: poll CMD every 0.2 s
  local limit=$1 what=$2 t0=$SECONDS
  shift 2
  until "$@"; do
    if (( SECONDS - t0 >= limit )); then
      dump_logs
      fail "timed out after ${limit} s waiting for $what"
    fi
    local pid
    for pid in "${DAEMON_PIDS[@]}"; do
      kill -0 "$pid" 2>/dev/null || { dump_logs; fail "a daemon (pid $pid) exited while waiting for $what"; }
    done
    sleep 0.2
  done
}

dump_logs() {
  local f
  for f in "$WORK"/log/*.log; do
    [ -s "$f" ] || continue
    echo "----- $(basename "$f") (last 25 lines)" >&2
    tail -n 25 "$f" >&2
  done
}

# -------------------------------------------------------------------------------- job
submit_suite() {
  # The users' template, verbatim but for its GPU request (this cluster has no GPUs).
  sed '/^#SBATCH --gpus-per-node/d' "$REPO/integration_tests/slurm/suite.sbatch" \
    >"$WORK/suite_cpu.sbatch"
  local out
  out=$(cd "$REPO" && GPUS_PER_NODE=$NPROC PYTHON=$PYTHON SUITE_ARGS=$SUITE_ARGS \
        VARLEN_CP_DIR=$REPO in_ctl sbatch --parsable --nodes=2 --ntasks-per-node=1 \
        --time=15 --output="$WORK/log/job-%j.out" "$WORK/suite_cpu.sbatch") \
    || fail "sbatch failed: $out"
  JOB_ID=${out%%;*}
  say "submitted job $JOB_ID (2 nodes x $NPROC ranks) at $(elapsed) s"
}

job_field() {  # job_field TEXT KEY: value of KEY=value in `scontrol show job` output
  grep -o "\b$2=[^ ]*" <<<"$1" | head -n 1 | cut -d= -f2-
}

wait_job() {
  local t0=$SECONDS info state
  while :; do
    info=$(in_ctl scontrol show job "$JOB_ID" 2>&1)
    state=$(job_field "$info" JobState)
    case "$state" in
      COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE|PREEMPTED)
        break ;;
    esac
    if (( SECONDS - t0 >= JOB_TIMEOUT )); then
      show_job_output
      fail "job $JOB_ID still ${state:-unknown} after $JOB_TIMEOUT s"
    fi
    sleep 1
  done
  JOB_STATE=$state
  JOB_EXIT=$(job_field "$info" ExitCode)
}

show_job_output() {
  local f="$WORK/log/job-$JOB_ID.out"
  echo "----- job $JOB_ID output ($f)"
  # torchtitan logs every step on every rank; the suite's own lines are what matter here.
  [ -f "$f" ] && grep -v "^\[titan\]\|FutureWarning\|return func(\*args" "$f"
  echo "-----"
}

check_job() {
  local f="$WORK/log/job-$JOB_ID.out" summary
  show_job_output
  [ "$JOB_STATE" = COMPLETED ] && [ "$JOB_EXIT" = "0:0" ] \
    || { dump_logs; fail "job $JOB_ID ended $JOB_STATE, exit code $JOB_EXIT"; }
  summary=$(grep "^integration: .* passed, .* failed" "$f" | tail -n 1)
  [ -n "$summary" ] || fail "no summary line in the job output"
  grep -q "^integration: [1-9][0-9]* passed, 0 failed" <<<"$summary" \
    || fail "suite summary says: $summary"
  grep -q "^PASS  job/collectives .* on 2 host(s)" "$f" \
    || fail "the job did not span 2 hosts (see job/collectives above)"
  say "PASS: two-node job $JOB_ID: ${summary#integration: }"
}

main() {
  preflight
  install_packages
  mkdir -p "$(dirname "$LOCK")"
  exec {LOCK_FD}>"$LOCK"
  flock -w 900 "$LOCK_FD" || fail "another slurm-ci run holds $LOCK"
  trap teardown EXIT
  trap 'exit 130' INT TERM
  WORK=$(mktemp -d /tmp/varlen-cp-slurm.XXXXXX)
  write_configs
  setup_network
  write_hosts
  start_daemons
  say "cluster up ($CTL_NAME + ${NODE_NAMES[*]}) at $(elapsed) s"
  submit_suite
  wait_job
  say "job $JOB_ID $JOB_STATE at $(elapsed) s"
  check_job
}

main "$@"
