#!/usr/bin/env bash
# The README's first command: install what is missing, build space, start
# `space serve` on the embedded default (private PostgreSQL, btrfs store, gVisor), create
# a sandbox from the base template and run python3 in it. The server keeps running in
# the background; its log is in $SPACE_DATA_DIR/serve.log (mode 0600).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="/usr/local/go/bin:$PWD/bin:$PATH"
export SPACE_DATA_DIR="${SPACE_DATA_DIR:-/var/lib/space}"

echo "demo: building bin/space and bin/space-agent"
go build -o bin/space ./cmd/space
CGO_ENABLED=0 go build -o bin/space-agent ./cmd/space-agent

url="${SPACE_URL:-http://127.0.0.1:7700}"
if ! curl -sf "$url/healthz" >/dev/null 2>&1; then
  mkdir -p "$SPACE_DATA_DIR"
  echo "demo: starting space serve (data dir $SPACE_DATA_DIR, log $SPACE_DATA_DIR/serve.log, readable by root only)"
  # The log is private (mode 0600) even where it existed before with other modes; the
  # operator key is never in it (space serve writes it to $SPACE_DATA_DIR/admin.key).
  (umask 077 && : >>"$SPACE_DATA_DIR/serve.log")
  chmod 600 "$SPACE_DATA_DIR/serve.log"
  nohup bin/space serve >>"$SPACE_DATA_DIR/serve.log" 2>&1 &
  for _ in $(seq 1 120); do
    curl -sf "$url/healthz" >/dev/null 2>&1 && break
    sleep 0.5
  done
  curl -sf "$url/healthz" >/dev/null || { echo "demo: space serve did not come up; see $SPACE_DATA_DIR/serve.log" >&2; exit 1; }
fi

echo "demo: creating a sandbox from template base (the first one builds the template: about a minute)"
id=$(bin/space sandbox create --template base --wait)
echo "demo: sandbox $id is running; running python3 -c 'print(6*7)' in it:"
bin/space exec "$id" -- python3 -c 'print(6*7)'
echo
echo "demo: it works. Try:"
echo "  export PATH=\$PWD/bin:\$PATH SPACE_DATA_DIR=$SPACE_DATA_DIR"
echo "  space sandbox list"
echo "  space exec $id -- bash -c 'uname -a; id'"
echo "  space sandbox rm $id"
echo "Stop the server with: pkill -INT -f 'bin/space serve'"
