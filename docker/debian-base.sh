#!/usr/bin/env bash
# Makes the default base image, localhost/debian:bookworm, when it is absent: a minimal Debian 12 root
# filesystem from the Debian mirror apt already uses (debootstrap), imported into the engine. For
# machines that reach no container registry; with one, pass BASE_IMAGE=python:3.11-slim instead.
#
#   docker/debian-base.sh [ENGINE] [IMAGE]      (defaults: podman, localhost/debian:bookworm)
#
# Cached: does nothing when the image exists. Cold: ~40 s and ~150 MB of downloads.
set -euo pipefail
engine=${1:-podman}
image=${2:-localhost/debian:bookworm}

if "$engine" image inspect "$image" >/dev/null 2>&1; then
    exit 0
fi
command -v debootstrap >/dev/null || { echo "debian-base.sh: debootstrap is not installed (make system-deps installs it)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "debian-base.sh: debootstrap needs root" >&2; exit 1; }

# The first Debian mirror of apt's own configuration (deb822 or one-line form), else deb.debian.org.
mirror=$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\/debian\)\/\?$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
if [ -z "$mirror" ]; then
    mirror=$(awk '$1 == "deb" && $2 ~ /\/debian\/?$/ {print $2; exit}' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
fi
mirror=${mirror:-http://deb.debian.org/debian}

rootfs=$(mktemp -d /var/tmp/flare-debian-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
echo "debian-base.sh: debootstrap bookworm from $mirror" >&2
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"
# apt inside derived images: no recommends, no caches kept.
printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$rootfs/etc/apt/apt.conf.d/90flare-no-recommends"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | "$engine" import --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "debian-base.sh: $image imported" >&2
