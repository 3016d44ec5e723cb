#!/bin/sh
# pip for the image's build stage: `pip-build install ...`, `pip-build wheel ...`
# into /opt/venv, trusting deploy/docker/local/ca-certificates.crt (copied to
# /tmp/local) when it is there, for networks whose proxy re-signs TLS.
set -eu
if [ -s /tmp/local/ca-certificates.crt ]; then
    export PIP_CERT=/tmp/local/ca-certificates.crt
fi
cmd=$1
shift
exec /opt/venv/bin/pip "$cmd" --no-cache-dir --disable-pip-version-check --progress-bar off "$@"
