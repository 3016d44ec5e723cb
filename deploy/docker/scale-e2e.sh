#!/usr/bin/env bash
# The compose profile `scale` run as an operator would, on this machine: three replicas (each
# a server and its sidecar) behind Envoy, under load from the host, one replica killed -9.
#
#   1. starts dockerd if none runs; builds the project image (deploy/docker/e2e.sh, until
#      build) and a local Envoy image (deploy/envoy/build-image.sh: no registry here)
#   2. docker-compose --profile scale up -d envoy, compilation mode none by default (three
#      replicas compiling at once on a small machine take a long time; any mode works)
#   3. deploy/docker/scale_check.py from the host: the replicas' shares of 32 clients' calls
#      through Envoy, a server killed -9 under load (no Embed lost, its streams end
#      UNAVAILABLE), compose restarting it and its sidecar warming it back into Envoy's pool
#   4. tears everything down, also on failure or Ctrl-C
#
#   deploy/docker/scale-e2e.sh
#
# Settings (environment):
#   SCALE_COMPILATION_MODE  the replicas' --compilation-mode       (default none)
#   SCALE_THREADS           torch threads per replica              (default 1)
#   SCALE_IMAGE             the project image tag                  (default inference-svc:e2e)
#   ENVOY_IMAGE             the Envoy image (built when absent)    (default inference-envoy:1.40.0)
#   SCALE_KEEP=1            leave the containers up at the end
# Needs root and the test venv (scripts/setup.sh test) for the client. Prints "scale: PASS".
set -euo pipefail
cd "$(dirname "$0")/../.."

PROJECT=inference-svc-scale
IMAGE=${SCALE_IMAGE:-inference-svc:e2e}
export ENVOY_IMAGE=${ENVOY_IMAGE:-inference-envoy:1.40.0}
export INFERENCE_IMAGE=$IMAGE COMPILATION_MODE=${SCALE_COMPILATION_MODE:-none}
export SCALE_THREADS=${SCALE_THREADS:-1}
log() { printf 'scale-e2e: %s\n' "$*" >&2; }
[ -x .venv/bin/python ] || { log "no .venv: run scripts/setup.sh test first"; exit 2; }

# shellcheck source=deploy/docker/dockerd.sh
source deploy/docker/dockerd.sh
compose=(docker-compose -p "$PROJECT" -f docker-compose.yml --profile scale)
teardown() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$rc" -ne 0 ]; then
        "${compose[@]}" ps >&2 || true
        "${compose[@]}" logs --no-color --tail=30 >&2 || true
    fi
    if [ "${SCALE_KEEP:-0}" = 1 ]; then
        log "SCALE_KEEP=1: left up; remove with: ${compose[*]} down -v --remove-orphans"
    else
        "${compose[@]}" down -v --remove-orphans --timeout 30 >&2 || true
        if [ -n "$started_dockerd" ]; then kill "$started_dockerd" 2>/dev/null || true; fi
    fi
    exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

E2E_UNTIL=build E2E_IMAGE=$IMAGE deploy/docker/e2e.sh
if ! docker image inspect "$ENVOY_IMAGE" >/dev/null 2>&1; then
    BASE_IMAGE=${BASE_IMAGE:-$(deploy/docker/build-base-image.sh)} deploy/envoy/build-image.sh >/dev/null
fi
ENVOY_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export ENVOY_PORT
t0=$SECONDS
"${compose[@]}" up -d envoy >&2
log "up; mode $COMPILATION_MODE, $SCALE_THREADS thread(s) per replica, Envoy on 127.0.0.1:$ENVOY_PORT"
PYTHONPATH=. .venv/bin/python deploy/docker/scale_check.py \
    --envoy "127.0.0.1:$ENVOY_PORT" --project "$PROJECT"
log "PASS in $((SECONDS - t0)) s after compose up"
