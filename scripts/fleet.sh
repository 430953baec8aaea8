#!/usr/bin/env bash
# A local fleet on one machine (docs/operations.md, "A local fleet"):
#
#   scripts/fleet.sh up [N]   PostgreSQL, a registry, an api+controller process and N node
#                             processes (default 2), each node in its own network namespace
#                             with its own data directory and btrfs store
#   scripts/fleet.sh env      the environment that points the CLI at it (eval "$(… env)")
#   scripts/fleet.sh status   what runs
#   scripts/fleet.sh down     stop everything; remove namespaces, links and state (idempotent)
#
# Run as root after scripts/setup.sh. Settings (environment):
#   SPACE_FLEET_DIR        state directory (default /var/tmp/space-fleet)
#   SPACE_FLEET_SUBNET     first three octets of the fleet's /24, in the test-only range
#                          198.18.0.0/15 (default 198.19.64): the host side is .1, node i
#                          .(10+i); bridge, namespaces and links are named after its last
#                          octet (spf64br, spf64-n<i>, spf64h<i>/spf64n<i>)
#   SPACE_FLEET_PG_PORT    PostgreSQL's port (default 55432)
#   SPACE_FLEET_SEED       btrfs store image every node starts from (so that each has the
#                          base template without building it); default: the newest golden
#                          image in the test cache (/var/tmp/space-test-cache), if any;
#                          "none": every node builds base itself on first need
#   SPACE_FLEET_API_ARGS   extra `space serve` arguments of the api+controller process
#   SPACE_FLEET_NODE_ARGS  extra `space serve` arguments of every node (e.g. --capacity memory=2048)
set -eEuo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${SPACE_FLEET_DIR:-/var/tmp/space-fleet}
subnet=${SPACE_FLEET_SUBNET:-198.19.64}
pg_port=${SPACE_FLEET_PG_PORT:-55432}
# Names derive from the subnet's third octet: fleets on different subnets coexist.
tag=spf${subnet##*.}
bridge=${tag}br
host_ip=$subnet.1
api_url=http://$host_ip:7700
bin=$dir/bin/space

die() { echo "fleet.sh: $*" >&2; exit 1; }
say() { echo "fleet.sh: $*"; }

need_root() { [ "$(id -u)" -eq 0 ] || die "run as root (network namespaces, loop-mounted btrfs stores, gVisor)"; }

case "$subnet" in
  198.18.*|198.19.*) ;;
  *) die "SPACE_FLEET_SUBNET=$subnet: use the test-only range 198.18.0.0/15" ;;
esac

node_ip() { echo "$subnet.$((10 + $1))"; }
node_ns() { echo "$tag-n$1"; }
pg_bindir() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }

# alive PIDFILE: whether the process in PIDFILE runs.
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# wait_http URL SECONDS LOG: wait for URL to answer 200, else show LOG and fail.
wait_http() {
  local url=$1 secs=$2 log=$3 i
  for ((i = 0; i < secs * 5; i++)); do
    if curl -fsS -o /dev/null --max-time 2 "$url" 2>/dev/null; then return 0; fi
    sleep 0.2
  done
  echo "fleet.sh: $url did not answer within ${secs}s; last lines of $log:" >&2
  tail -n 30 "$log" >&2 || true
  return 1
}

# start NAME LOG CMD...: run CMD in the background in its own session, pid in $dir/NAME.pid.
start() {
  local name=$1 log=$2
  shift 2
  setsid "$@" </dev/null >>"$log" 2>&1 &
  echo $! >"$dir/$name.pid"
}

# stop NAME: SIGTERM the process in $dir/NAME.pid, SIGKILL after 20 s.
stop() {
  local pidf=$dir/$1.pid i
  if alive "$pidf"; then
    local pid
    pid=$(cat "$pidf")
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidf"
}

nodes_count() { cat "$dir/nodes" 2>/dev/null || echo 0; }

up() {
  need_root
  local n=${1:-2}
  [[ "$n" =~ ^[1-9][0-9]?$ ]] || die "up N: N is a number of nodes from 1 to 99"
  if alive "$dir/api.pid" || [ -f "$dir/nodes" ]; then
    die "a fleet is up in $dir (scripts/fleet.sh down first)"
  fi
  ip link show "$bridge" >/dev/null 2>&1 && die "subnet $subnet.0/24 is in use by another fleet (bridge $bridge exists): pick another SPACE_FLEET_SUBNET"
  command -v docker-registry >/dev/null || die "docker-registry not found: run scripts/setup.sh"
  [ -n "$(pg_bindir)" ] || die "PostgreSQL server binaries not found under /usr/lib/postgresql: run scripts/setup.sh"
  id postgres >/dev/null 2>&1 || die "no postgres user (Debian's postgresql package makes it): run scripts/setup.sh"
  mkdir -p "$dir/bin"
  chmod 0755 "$dir"
  echo "$n" >"$dir/nodes"
  # From here on a failure undoes everything made so far.
  trap 'echo "fleet.sh: up failed; undoing" >&2; down >/dev/null 2>&1 || true' ERR

  say "building space into $dir/bin"
  (cd "$repo" && PATH="/usr/local/go/bin:$PATH" go build -o "$dir/bin/" ./cmd/space ./cmd/space-agent)

  say "network: bridge $bridge $host_ip/24, $n namespaces $tag-n1…"
  ip link add "$bridge" type bridge
  ip addr add "$host_ip/24" dev "$bridge"
  ip link set "$bridge" up
  local i
  for ((i = 1; i <= n; i++)); do
    local ns
    ns=$(node_ns "$i")
    ip netns add "$ns"
    ip link add "${tag}h$i" type veth peer name "${tag}n$i" netns "$ns"
    ip link set "${tag}h$i" master "$bridge" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$(node_ip "$i")/24" dev "${tag}n$i"
    ip -n "$ns" link set "${tag}n$i" up
    ip -n "$ns" route add default via "$host_ip"
  done

  say "PostgreSQL on $host_ip:$pg_port (as user postgres)"
  local pgbin pgdir=$dir/postgres
  pgbin=$(pg_bindir)
  mkdir -p "$pgdir/run"
  chown postgres:postgres "$pgdir" "$pgdir/run"
  chmod 0700 "$pgdir"
  runuser -u postgres -- "$pgbin/initdb" -D "$pgdir/data" -U postgres --auth-local=peer --auth-host=scram-sha-256 \
    -E UTF8 --locale=C.UTF-8 >"$dir/postgres-init.log" 2>&1 || { cat "$dir/postgres-init.log" >&2; false; }
  # Local superuser by peer; the fleet's role by password from the fleet's network only.
  cat >"$pgdir/data/pg_hba.conf" <<EOF
local all postgres peer
host  space space $host_ip/32 scram-sha-256
host  space space $subnet.0/24 scram-sha-256
EOF
  runuser -u postgres -- "$pgbin/pg_ctl" -D "$pgdir/data" -l "$pgdir/postgres.log" -w -t 60 start \
    -o "-c listen_addresses=$host_ip -c port=$pg_port -c unix_socket_directories=$pgdir/run -c max_connections=300" >/dev/null
  local pw
  pw=$(head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 32)
  umask 077
  printf '%s\n' "$pw" >"$dir/db-password"
  umask 022
  runuser -u postgres -- "$pgbin/psql" -q -h "$pgdir/run" -p "$pg_port" -d postgres -v ON_ERROR_STOP=1 \
    -c "CREATE ROLE space LOGIN PASSWORD '$pw'" -c "CREATE DATABASE space OWNER space" >/dev/null
  export SPACE_DATABASE_URL="postgres://space:$pw@$host_ip:$pg_port/space?sslmode=disable"

  say "registry on $host_ip:5000 (docker-registry)"
  mkdir -p "$dir/registry"
  cat >"$dir/registry/config.yml" <<EOF
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $dir/registry/data
  delete:
    enabled: true
http:
  addr: $host_ip:5000
  secret: $(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
EOF
  start registry "$dir/registry.log" docker-registry serve "$dir/registry/config.yml"
  wait_http "http://$host_ip:5000/v2/" 30 "$dir/registry.log"

  say "api + controller on $api_url"
  mkdir -p "$dir/api"
  # shellcheck disable=SC2086 # extra arguments are split on purpose
  start api "$dir/api.log" "$bin" serve --roles api,controller --data-dir "$dir/api" --listen "$host_ip:7700" \
    --e2b-listen "$host_ip:3000" --network off ${SPACE_FLEET_API_ARGS:-}
  wait_http "$api_url/healthz" 60 "$dir/api.log"

  local seed=${SPACE_FLEET_SEED:-}
  if [ -z "$seed" ]; then
    seed=$(ls -t /var/tmp/space-test-cache/golden-*.img 2>/dev/null | head -1 || true)
  fi
  [ "$seed" = none ] && seed=
  local size_args=()
  if [ -n "$seed" ]; then
    # Identical copies of one btrfs image mount side by side only with temp_fsid.
    [ -e /sys/fs/btrfs/features/temp_fsid ] || { say "kernel lacks btrfs temp_fsid: not seeding stores"; seed=; }
  fi
  [ -n "$seed" ] && size_args=(--store-size "$(stat -c %s "$seed")")
  for ((i = 1; i <= n; i++)); do
    local ns ip data
    ns=$(node_ns "$i")
    ip=$(node_ip "$i")
    data=$dir/node$i
    mkdir -p "$data"
    if [ -n "$seed" ]; then
      cp --sparse=always "$seed" "$data/store.img"
    fi
    say "node$i in namespace $ns on http://$ip:7701${seed:+ (store seeded from $seed)}"
    # nsenter joins the node's network namespace only: its mounts (store, sandboxes)
    # stay in the host's mount namespace, where down finds them. Each node's gVisor
    # sandboxes run as their own range of host uids, as on separate hosts.
    # shellcheck disable=SC2086
    start "node$i" "$dir/node$i.log" nsenter --net="/run/netns/$ns" "$bin" serve --roles node --data-dir "$data" \
      --node-name "node$i" --listen "$ip:7701" --advertise-url "http://$ip:7701" --metrics-listen "$ip:9470" \
      --registry "$host_ip:5000/space" --registry-insecure --network off \
      --runsc-uid-base $((0x70000000 + i * 0x10000)) "${size_args[@]}" ${SPACE_FLEET_NODE_ARGS:-}
  done
  for ((i = 1; i <= n; i++)); do
    wait_http "http://$(node_ip "$i"):7701/healthz" 120 "$dir/node$i.log"
  done
  trap - ERR
  say "up: $n node(s). Point the CLI at the fleet with:"
  echo
  env_lines | sed 's/^/    /'
  echo
  echo "    space node list; space sandbox create; space exec ID -- echo hi"
  echo
  say "logs in $dir/*.log (PostgreSQL: $dir/postgres/postgres.log); stop with scripts/fleet.sh down"
}

env_lines() {
  echo "export SPACE_URL=$api_url"
  echo "export SPACE_DATA_DIR=$dir/api   # the CLI reads the operator key from admin.key there"
}

status() {
  local name
  for name in postgres registry api $(for ((i = 1; i <= $(nodes_count); i++)); do echo "node$i"; done); do
    if [ "$name" = postgres ]; then
      if [ -f "$dir/postgres/data/postmaster.pid" ] && kill -0 "$(head -1 "$dir/postgres/data/postmaster.pid")" 2>/dev/null; then
        echo "postgres  running  $host_ip:$pg_port"
      else
        echo "postgres  stopped"
      fi
      continue
    fi
    if alive "$dir/$name.pid"; then echo "$name  running  pid $(cat "$dir/$name.pid")"; else echo "$name  stopped"; fi
  done
}

# cleanup_node DATA: destroy what a stopped node leaves behind: its gVisor sandboxes
# (which outlive space serve by design), their mounts, and its store's mount.
cleanup_node() {
  local data=$1 root runsc=/usr/local/lib/space/runsc id
  root=/run/space/runsc-$(printf %s "$data" | sha256sum | cut -c1-12)
  if [ -d "$root" ] && [ -x "$runsc" ]; then
    for id in $("$runsc" --root "$root" list -quiet 2>/dev/null); do
      "$runsc" --root "$root" kill --all "$id" KILL >/dev/null 2>&1 || true
      "$runsc" --root "$root" delete -force "$id" >/dev/null 2>&1 || true
    done
  fi
  # Deepest mounts first.
  findmnt -rn -o TARGET | awk -v a="$root" -v b="$data" 'index($0, a) == 1 || index($0, b) == 1' | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
  if [ -f "$data/store.img" ]; then
    losetup -j "$data/store.img" -O NAME -n 2>/dev/null | while read -r l; do losetup -d "$l" 2>/dev/null || true; done
  fi
  rm -rf "$root" "/run/space/qemu-${root#/run/space/runsc-}"
}

down() {
  need_root
  local i n
  n=$(nodes_count)
  # Nodes there may be more of than recorded (a failed up): every namespace of ours.
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$tag-n[0-9]*\$" || true); do
    i=${ns#"$tag"-n}
    [ "$i" -gt "$n" ] && n=$i
  done
  for ((i = 1; i <= n; i++)); do stop "node$i"; done
  stop api
  stop registry
  if [ -f "$dir/postgres/data/postmaster.pid" ]; then
    runuser -u postgres -- "$(pg_bindir)/pg_ctl" -D "$dir/postgres/data" -m fast -w stop >/dev/null 2>&1 || true
  fi
  for ((i = 1; i <= n; i++)); do
    cleanup_node "$dir/node$i"
    ip netns del "$(node_ns "$i")" 2>/dev/null || true
    ip link del "${tag}h$i" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  [ -d "$dir/api" ] && cleanup_node "$dir/api"
  case "$dir" in
    /|/var|/var/tmp|/tmp|"") die "refusing to remove $dir" ;;
  esac
  rm -rf "$dir"
  say "down: fleet stopped and removed ($dir)"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  env) env_lines ;;
  status) status ;;
  *) echo "usage: scripts/fleet.sh up [N] | down | env | status" >&2; exit 2 ;;
esac
