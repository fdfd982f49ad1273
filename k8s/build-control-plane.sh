#!/usr/bin/env bash
# Build kube-apiserver, kube-scheduler and kube-controller-manager (v1.20.2) from Debian
# bookworm's *source* package `kubernetes` (1.20.5+really1.20.2), which carries the whole upstream
# tree with vendored modules and builds offline with Debian's golang-go.
#
# The three binaries are cached in $FLARE_K8S_BIN (default /opt/flare-airflow/k8s-1.20.2/bin);
# when all three are present (and executable) this script does nothing. Also installs
# etcd-server (needed at run time) if missing. Idempotent, non-interactive, meant to run as root
# (CI). Cold build: ~7.5 min and ~2.3 GB of temporary disk on 2 cores; the build tree is deleted
# afterwards.
#
# Env:
#   FLARE_K8S_BIN        where the binaries are cached
#   FLARE_K8S_BUILD_DIR  scratch dir for the source tree (default: mktemp under /var/tmp)
#   FLARE_K8S_KEEP_TREE  set to 1 to keep the build tree (debugging)
set -euo pipefail

BIN_DIR="${FLARE_K8S_BIN:-/opt/flare-airflow/k8s-1.20.2/bin}"
BINARIES=(kube-apiserver kube-scheduler kube-controller-manager)
export DEBIAN_FRONTEND=noninteractive

log() { printf '[build-control-plane %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else
        log "need root for: $*"; exit 1
    fi
}

have_binaries() {
    local b
    for b in "${BINARIES[@]}"; do [ -x "$BIN_DIR/$b" ] || return 1; done
}

ensure_etcd() {
    if ! command -v etcd >/dev/null 2>&1; then
        log "installing etcd-server"
        as_root apt-get update -q
        as_root apt-get install -y -q --no-install-recommends etcd-server
    fi
}

if have_binaries; then
    ensure_etcd
    log "binaries present in $BIN_DIR; nothing to build"
    exit 0
fi

# Serialise concurrent invocations (e.g. two pytest sessions) on one lock.
mkdir -p "$(dirname "$BIN_DIR")"
exec 9>"$(dirname "$BIN_DIR")/.build.lock"
log "waiting for build lock"
flock 9
if have_binaries; then
    ensure_etcd
    log "binaries appeared in $BIN_DIR while waiting; nothing to build"
    exit 0
fi

START=$(date +%s)

# 1. deb-src entry for bookworm main, in its own sources file (Debian only).
SRC_LIST=/etc/apt/sources.list.d/flare-airflow-bookworm-src.sources
if [ ! -f "$SRC_LIST" ]; then
    log "adding $SRC_LIST"
    as_root tee "$SRC_LIST" >/dev/null <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi

# 2. Toolchain (+ etcd for running).
log "apt-get update"
as_root apt-get update -q
PKGS=()
for p in golang-go jq rsync make dpkg-dev etcd-server; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || PKGS+=("$p")
done
if [ "${#PKGS[@]}" -gt 0 ]; then
    log "installing ${PKGS[*]}"
    as_root apt-get install -y -q --no-install-recommends "${PKGS[@]}"
fi

# 3. Fetch and unpack the source.
BUILD_DIR="${FLARE_K8S_BUILD_DIR:-$(mktemp -d /var/tmp/flare-k8s-build.XXXXXX)}"
mkdir -p "$BUILD_DIR"
chmod 755 "$BUILD_DIR"  # lets apt's _apt user write the download (no warning)
cleanup() {
    if [ "${FLARE_K8S_KEEP_TREE:-0}" != 1 ]; then
        log "removing build tree $BUILD_DIR"
        rm -rf "$BUILD_DIR"
    fi
}
trap cleanup EXIT
cd "$BUILD_DIR"
log "apt-get source --download-only kubernetes (in $BUILD_DIR)"
apt-get source --download-only kubernetes
ORIG=$(ls kubernetes_*.orig.tar.* | grep -v "\.asc$" | head -n1)
log "unpacking $ORIG"
mkdir src
tar -xf "$ORIG" -C src --strip-components=1
cd src

# 4. Build through the upstream make path (plain `go build -mod=vendor` fails under Go 1.19).
export KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=clean KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20
# providerless: upstream's build tag that leaves the in-tree cloud providers (AWS, Azure, GCE,
# vSphere, OpenStack SDKs) out of kube-apiserver and kube-controller-manager. Nothing here uses a
# cloud provider, and they are 31 % of the Go source the three binaries compile (go list -deps:
# 136.6 -> 94.2 MB, 1,878 -> 1,623 packages): a cold build costs the tests' two cores that much less.
export GOFLAGS="${GOFLAGS:--tags=providerless}" GOCACHE="$BUILD_DIR/gocache" GOPATH="$BUILD_DIR/gopath"
log "make WHAT=cmd/kube-apiserver cmd/kube-scheduler cmd/kube-controller-manager"
make WHAT="cmd/kube-apiserver cmd/kube-scheduler cmd/kube-controller-manager"

# 5. Cache the binaries (atomically: copy to a temp dir, then rename each into place).
mkdir -p "$BIN_DIR"
for b in "${BINARIES[@]}"; do
    install -m 0755 "_output/bin/$b" "$BIN_DIR/.$b.tmp"
    mv -f "$BIN_DIR/.$b.tmp" "$BIN_DIR/$b"
done
"$BIN_DIR/kube-apiserver" --version >&2
log "built in $(( $(date +%s) - START )) s; binaries in $BIN_DIR"
