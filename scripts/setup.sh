#!/usr/bin/env bash
# Installs what space needs on Debian 12 (idempotent): the runtime and storage tools,
# PostgreSQL's server binaries, and checks for Go. Run as root.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
  echo "setup.sh: run as root (sudo): space needs root for btrfs loop mounts and sandboxes" >&2
  exit 1
fi

# Debian packages space uses at run time and in tests.
pkgs=(
  btrfs-progs      # mkfs.btrfs and btrfs send/receive for the template store
  debootstrap      # builds the base template (Debian bookworm)
  postgresql-15    # initdb/postgres for the embedded private cluster
  e2fsprogs util-linux iproute2 ca-certificates curl git
  jq               # the README's curl example (run by internal/server TestReadmeCurl)
  qemu-system-x86  # the qemu runtime (microvm; KVM where the CPU has it, else TCG)
  linux-image-cloud-amd64  # the guest kernel of VM runtimes
  cpio busybox-static  # initramfs building and VM tests
  chromium         # headless browser for the web console's tests (internal/e2e/console_test.go)
  nftables         # nft(8): inspecting the egress rules (the code itself uses netlink)
  # the code interpreter server's unit test runs it on the host (internal/guest/codeinterp)
  python3-jupyter-client python3-ipykernel python3-matplotlib python3-numpy
  docker-registry  # the CNCF distribution registry: the artifact tests run their own (internal/artifact)
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  # Debian's postgresql-15 creates and starts a default cluster; space runs its own.
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Debian's docker-registry starts a registry on :5000 as a service; space's tests start
# their own on loopback and need only the binary, so the service is not left running.
if [ "${#missing[@]}" -gt 0 ] && [[ " ${missing[*]} " == *" docker-registry "* ]] && command -v systemctl >/dev/null \
   && [ -d /run/systemd/system ]; then
  systemctl disable --now docker-registry.service >/dev/null 2>&1 || true
fi

# Go 1.26+ (not packaged for bookworm): /usr/local/go or PATH.
export PATH="/usr/local/go/bin:$PATH"
if ! command -v go >/dev/null; then
  echo "setup.sh: Go 1.26 or newer is required (install it to /usr/local/go)" >&2
  exit 1
fi
# gVisor's runsc, built from its Go module at a pinned version: Debian's runsc is a
# 2022 release (ptrace platform only, no systrap). The build takes a few minutes; the
# binary is cached per version, so reruns and version switches back are instant. space
# runs /usr/local/lib/space/runsc by default (docs/runtimes.md, "gVisor"); it never
# touches a runsc the operator installed elsewhere (e.g. /usr/local/bin, /usr/bin).
# To move the pin: pick a version from `go list -m -versions gvisor.dev/gvisor` (or
# @latest), rerun this script and the gvisor runtime and conformance tests.
#
# Like upstream's release builds (and unlike a plain `go install`), the binary carries
# its seccomp filters precompiled, so no `runsc run` or `runsc restore` compiles them
# at start: scripts/runsc-seccomp/gen.go writes them into a copy of the module's
# source before the build (the filters are the same ones; see that file).
RUNSC_VERSION=v0.0.0-20260905035102-160fafc42237
runsc_seccomp_dir="$(cd "$(dirname "$0")/runsc-seccomp" && pwd)"
runsc_build_id="$RUNSC_VERSION-$(cat "$runsc_seccomp_dir"/*.go | sha256sum | cut -c1-12)"
runsc_cache="/var/cache/space/runsc/$runsc_build_id/runsc"
runsc_bin=/usr/local/lib/space/runsc
if [ ! -x "$runsc_cache" ]; then
  echo "setup.sh: building runsc $RUNSC_VERSION with precompiled seccomp filters (a few minutes)"
  runsc_tmp="$(mktemp -d)"
  # Outside the repository, so that its go.mod plays no part; CGO off as upstream builds it.
  (
    set -e
    export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
    cd "$runsc_tmp"
    go mod init runsc-build >/dev/null 2>&1
    go mod download -json "gvisor.dev/gvisor@$RUNSC_VERSION" >module.json
    src="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' module.json)"
    cp -r "$src" gvisor
    chmod -R u+w gvisor
    cd gvisor
    sed '1,2d' "$runsc_seccomp_dir/boot_config.go" >runsc/boot/filter/config/space_precompiled.go
    mkdir space-seccomp-gen
    sed '1,2d' "$runsc_seccomp_dir/gen.go" >space-seccomp-gen/main.go
    go run ./space-seccomp-gen runsc/boot/filter runsc/fsgofer/filter
    go build -trimpath -ldflags "-X gvisor.dev/gvisor/runsc/version.version=$RUNSC_VERSION" \
      -o "$runsc_tmp/bin/runsc" ./runsc
  )
  install -D -m 0755 "$runsc_tmp/bin/runsc" "$runsc_cache"
  rm -rf "$runsc_tmp"
fi
if ! cmp -s "$runsc_cache" "$runsc_bin"; then
  # Copy and rename: running sandboxes keep the old file (runsc re-executes itself
  # through /proc/self/exe), new ones get the new one.
  install -D -m 0755 "$runsc_cache" "$runsc_bin.new"
  mv -f "$runsc_bin.new" "$runsc_bin"
fi

# Huge pages for sandbox memory, opt-in (docs/operations.md, "Host tuning"): gVisor
# backs a sandbox's memory with transparent huge pages only when the host lets shared
# memory have them on request (shmem_enabled=advise) without stalling on compaction
# (defrag=defer). Wakes load memory faster (256 MiB: 0.8x the time, 1 GiB: 0.5-0.9x)
# and an idle sandbox costs about 6 MiB more; but a program that runs out of memory
# then ends its whole sandbox (the host's OOM killer) where it alone was killed. With
# SPACE_SETUP_THP=1, Debian's defaults (never, madvise) are changed, now and at every
# boot (tmpfiles.d); a host tuned otherwise is left as it is.
thp=/sys/kernel/mm/transparent_hugepage
if [ "${SPACE_SETUP_THP:-0}" = 1 ] && [ -w "$thp/shmem_enabled" ] && grep -q '\[never\]' "$thp/shmem_enabled"; then
  echo advise >"$thp/shmem_enabled"
  conf="w $thp/shmem_enabled - - - - advise"
  if grep -q '\[madvise\]' "$thp/defrag"; then
    echo defer >"$thp/defrag"
    conf="$conf"$'\n'"w $thp/defrag - - - - defer"
  fi
  if [ -d /etc/tmpfiles.d ]; then
    printf '# space: huge pages for gVisor sandbox memory (scripts/setup.sh, SPACE_SETUP_THP=1)\n%s\n' "$conf" >/etc/tmpfiles.d/space-thp.conf
  fi
  echo "setup.sh: transparent huge pages for sandbox memory on (shmem_enabled=advise, defrag=$(sed -E 's/.*\[(.*)\].*/\1/' "$thp/defrag"))"
fi

# The real E2B JS SDKs the E2B compatibility tests drive (internal/e2e/e2bsdk),
# pinned by its lockfile. Debian's nodejs/npm when the machine has none.
if ! command -v npm >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nodejs npm || true
fi
if command -v npm >/dev/null; then
  (cd "$(dirname "$0")/../internal/e2e/e2bsdk" && npm ci --no-audit --no-fund --loglevel=error)
else
  echo "setup.sh: npm not found: the E2B SDK tests will be skipped (install Node.js 20+)" >&2
fi
echo "setup.sh: ready ($(go version | cut -d' ' -f3), $("$runsc_bin" --version 2>/dev/null | head -1))"
