#!/usr/bin/env bash
# The README's second command: the whole test suite (vet, then every package's tests
# against real PostgreSQL, runsc and btrfs). Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="/usr/local/go/bin:$PATH"
test -z "$(gofmt -l . | tee /dev/stderr)" || { echo "test.sh: gofmt would change the files above" >&2; exit 1; }
go vet ./...
# Packages run one at a time (-p 1): the suite starts real sandboxes on a 2-core machine.
go test -p 1 -count=1 -timeout 30m "$@" ./...
