#!/usr/bin/env bash
# The README's second command: the whole test suite (vet, then every package's tests
# against real PostgreSQL, runsc and btrfs). Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="/usr/local/go/bin:$PATH"
test -z "$(gofmt -l . | tee /dev/stderr)" || { echo "test.sh: gofmt would change the files above" >&2; exit 1; }
go vet ./...
# Two packages at a time (-p 2): most of the suite waits on sandboxes, servers and
# PostgreSQL rather than computing, and each package keeps what it makes apart (its own
# temp dirs, stores, clusters, fake host namespaces; host names derived from its data
# dirs), so two at a time halves the wall time on a 2-core machine. Flags given to this
# script go last and win, e.g. scripts/test.sh -p 1 for one package at a time.
# The e2e package alone takes 18-27 minutes on a busy 2-core machine: a 30 m per-binary
# timeout would end it with a panic while nothing is wrong.
go test -p 2 -count=1 -timeout 45m "$@" ./...
