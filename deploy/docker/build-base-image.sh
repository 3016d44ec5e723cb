#!/usr/bin/env bash
# Builds a local Debian base image with Python 3.11 for the project's Dockerfile,
# for machines that reach Debian's mirror but no container registry:
# debootstrap a minimal Debian, then `docker import` it.
#
#   deploy/docker/build-base-image.sh            # prints the image tag on stdout
#   BASE_TAG=my-base:1 deploy/docker/build-base-image.sh
#
# Settings (environment):
#   BASE_TAG    the local image to produce      (default inference-svc-base:bookworm)
#   SUITE       Debian suite; its python3 must be 3.11 for the pinned torch wheel
#               (default bookworm)
#   MIRROR      Debian mirror                   (default http://deb.debian.org/debian)
#   CACHE_DIR   where the rootfs tarball is kept (default .cache/base-image, git-ignored)
#
# Idempotent: an image whose label matches the recipe's hash is reused; a cached
# tarball of the same recipe is re-imported without running debootstrap again.
# Needs root (debootstrap) and a running Docker engine. Logs go to stderr.
set -euo pipefail
cd "$(dirname "$0")/../.."

BASE_TAG=${BASE_TAG:-inference-svc-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
CACHE_DIR=${CACHE_DIR:-.cache/base-image}
# python3-dev and g++: torch.compile's inductor backend compiles C++ at run time.
PACKAGES=python3,python3-venv,python3-dev,g++,ca-certificates,tini
# Bump when the rootfs recipe below changes (the hash also covers the settings above).
RECIPE=1
LABEL=org.inference-svc.base-recipe

log() { echo "build-base-image: $*" >&2; }

recipe_hash() {
    echo "$RECIPE $SUITE $MIRROR $PACKAGES" | sha256sum | cut -c1-16
}
hash=$(recipe_hash)

if ! docker info >/dev/null 2>&1; then
    log "no Docker engine answers (start dockerd first)"
    exit 1
fi
existing=$(docker image inspect --format "{{ index .Config.Labels \"$LABEL\" }}" "$BASE_TAG" \
    2>/dev/null || true)
if [ "$existing" = "$hash" ]; then
    log "$BASE_TAG is up to date (recipe $hash)"
    echo "$BASE_TAG"
    exit 0
fi

mkdir -p "$CACHE_DIR"
tarball="$CACHE_DIR/rootfs-$SUITE-$hash.tar"
if [ ! -s "$tarball" ]; then
    if ! command -v debootstrap >/dev/null; then
        log "installing debootstrap"
        apt-get update -q >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2
    fi
    rootfs=$(mktemp -d "${TMPDIR:-/tmp}/base-rootfs.XXXXXX")
    trap 'rm -rf "$rootfs"' EXIT
    log "debootstrap $SUITE into $rootfs (minbase + $PACKAGES)"
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >&2
    # Leave apt usable in the image, and the image small.
    echo "deb $MIRROR $SUITE main" > "$rootfs/etc/apt/sources.list"
    chroot "$rootfs" apt-get clean
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
        "$rootfs"/var/log/*.log "$rootfs"/tmp/*
    version=$(chroot "$rootfs" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$version" != "3.11" ]; then
        log "$SUITE has Python $version; the pinned torch wheel needs 3.11"
        exit 1
    fi
    rm -f "$CACHE_DIR"/rootfs-*.tar
    tar --numeric-owner -C "$rootfs" -cf "$tarball.part" .
    mv "$tarball.part" "$tarball"
    rm -rf "$rootfs"
    trap - EXIT
fi

log "importing $tarball as $BASE_TAG"
previous=$(docker image inspect --format '{{.Id}}' "$BASE_TAG" 2>/dev/null || true)
docker import \
    --change "LABEL $LABEL=$hash" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$tarball" "$BASE_TAG" >&2
if [ -n "$previous" ]; then  # the old recipe's image, now untagged
    docker rmi "$previous" >/dev/null 2>&1 || true
fi
echo "$BASE_TAG"
