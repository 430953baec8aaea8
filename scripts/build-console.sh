#!/usr/bin/env bash
# Builds the web console's vendored npm files reproducibly.
#
# The console's own files (internal/console/static: HTML, CSS, JavaScript modules) are
# served as written; only npm packages need building. This script installs exactly the
# versions pinned in internal/console/web/package-lock.json (npm ci, no install
# scripts), copies the files the console loads into internal/console/static/vendor and
# writes vendor/MANIFEST.json (package versions and the files' SHA-256). The result is
# committed, so `go build` needs no npm; TestVendorManifest checks the committed files
# against the manifest and the lockfile.
#
#   scripts/build-console.sh          rebuild static/vendor
#   scripts/build-console.sh --check  rebuild into a temporary directory and fail if it
#                                     differs from what is committed
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
web=$root/internal/console/web
vendor=$root/internal/console/static/vendor
check=0
[ "${1:-}" = "--check" ] && check=1

command -v npm >/dev/null || { echo "build-console.sh: npm is required (apt-get install npm)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$web/package.json" "$web/package-lock.json" "$tmp/"
(cd "$tmp" && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error >/dev/null)

out=$tmp/vendor
mkdir -p "$out"
# name in node_modules | file in the package | name in vendor/
files=(
  "@xterm/headless|lib-headless/xterm-headless.mjs|xterm-headless.mjs"
)
cp "$web/LICENSE.xterm" "$out/xterm-LICENSE.txt"
{
  echo "{"
  echo "  \"generated_by\": \"scripts/build-console.sh\","
  echo "  \"files\": ["
  sep=""
  for f in "${files[@]}"; do
    IFS='|' read -r pkg src dst <<<"$f"
    cp "$tmp/node_modules/$pkg/$src" "$out/$dst"
    ver=$(node -p "require('$tmp/node_modules/$pkg/package.json').version")
    sum=$(sha256sum "$out/$dst" | cut -d' ' -f1)
    printf '%s    {"package": "%s", "version": "%s", "source": "%s", "file": "%s", "sha256": "%s"}' "$sep" "$pkg" "$ver" "$src" "$dst" "$sum"
    sep=$',\n'
  done
  echo
  echo "  ]"
  echo "}"
} >"$out/MANIFEST.json"

if [ "$check" = 1 ]; then
  if diff -r "$out" "$vendor" >/dev/null; then
    echo "build-console.sh: static/vendor matches the lockfile"
  else
    diff -r "$out" "$vendor" | head -20 >&2
    echo "build-console.sh: static/vendor differs from a fresh build: run scripts/build-console.sh" >&2
    exit 1
  fi
  exit 0
fi
rm -rf "$vendor"
cp -r "$out" "$vendor"
echo "build-console.sh: wrote $(ls "$vendor" | wc -l) files to internal/console/static/vendor"
