#!/usr/bin/env bash
# End-to-end run of docker-compose.yml as an operator would, on this machine:
#
#   1. installs Debian's docker.io and docker-compose if missing, starts dockerd if none runs
#   2. builds a local base image (deploy/docker/build-base-image.sh: debootstrap + docker import)
#   3. builds the project image on it
#   4. docker-compose up: waits for the inference container to turn healthy (the grpc.health.v1
#      healthcheck), checks the example client waited for that and exited 0, and that the
#      client's calls compiled nothing (late compile events: 0)
#   5. checks the public port answers from the host and the admin port is reachable from
#      neither the host nor another container, only inside the shared network namespace
#   6. restarts the server container: the sidecar must warm the new process (from the compile
#      cache volume) and the client must pass again
#   7. tears everything down (containers, network, volumes), also on failure or Ctrl-C
#
#   deploy/docker/e2e.sh                 # everything (a cold compile: tens of minutes on 2 cores)
#   E2E_UNTIL=build deploy/docker/e2e.sh # stop after the image build (+ compose config check)
#   E2E_UNTIL=start deploy/docker/e2e.sh # also start the pair; check liveness and the ports
#
# Settings (environment):
#   E2E_UNTIL             build | start | all                    (default all)
#   E2E_COMPILATION_MODE  the service's --compilation-mode        (default default)
#   E2E_TIMEOUT           seconds to wait for healthy             (default 3000)
#   E2E_IMAGE             the project image tag                   (default inference-svc:e2e)
#   E2E_RESTART=0         skip step 6
#   E2E_ALLOW_LATE_COMPILES=1  report late compile events instead of failing on them
#   E2E_KEEP=1            leave the containers and volumes up at the end
#   E2E_TLS=1             TLS on the public port (deploy/docker/compose.tls.yml, a dev CA made
#                         by deploy/tls/make-dev-certs.sh): clients from the host speak TLS,
#                         plaintext is refused, the sidecar's public health check says SERVING
#   E2E_PRECOMPILE=1      ship warm: build with PRECOMPILE=<the mode> (the Dockerfile runs
#                         `inference-svc precompile` with this machine's thread count); the
#                         first start must load the image's artifacts: the sidecar's plan says
#                         "from kept artifacts" and its COMPILE steps report 0 compile events
#   BASE_IMAGE            skip step 2 and build on this image instead
# Prints a timing line per stage, and "e2e: PASS" last. Needs root.
set -euo pipefail
cd "$(dirname "$0")/../.."

UNTIL=${E2E_UNTIL:-all}
MODE=${E2E_COMPILATION_MODE:-default}
TIMEOUT=${E2E_TIMEOUT:-3000}
IMAGE=${E2E_IMAGE:-inference-svc:e2e}
PROJECT=inference-svc-e2e
ADMIN_PORT=50052
case "$UNTIL" in build | start | all) ;; *) echo "E2E_UNTIL: build, start or all" >&2; exit 2 ;; esac

log() { printf 'e2e: %s\n' "$*" >&2; }
timings=()
stage_start=$SECONDS
stage() {  # stage NAME: records the time since the last call
    local took=$((SECONDS - stage_start))
    timings+=("$(printf '%-44s %5ss' "$1" "$took")")
    log "stage '$1' took ${took}s"
    stage_start=$SECONDS
}
report() {
    log "timings:"
    local t
    for t in "${timings[@]}"; do log "  $t"; done
}

# --- 1. tools and the engine -----------------------------------------------------------------
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >&2
fi
# shellcheck source=deploy/docker/dockerd.sh
source deploy/docker/dockerd.sh
stage "tools + dockerd"

compose=(docker-compose -p "$PROJECT" -f docker-compose.yml)
tls_args=()
if [ "${E2E_TLS:-0}" = 1 ]; then
    export TLS_DIR=$PWD/.cache/e2e-tls
    deploy/tls/make-dev-certs.sh "$TLS_DIR"
    chmod 755 "$TLS_DIR"
    compose+=(-f deploy/docker/compose.tls.yml)
    tls_args=(-v "$TLS_DIR:/tls:ro")
fi
export INFERENCE_IMAGE=$IMAGE COMPILATION_MODE=$MODE
INFERENCE_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export INFERENCE_PORT
INFERENCE_METRICS_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export INFERENCE_METRICS_PORT

teardown() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$rc" -ne 0 ] && [ "$UNTIL" != build ]; then
        log "FAILED (exit $rc); the containers' last logs:"
        "${compose[@]}" ps >&2 || true
        "${compose[@]}" logs --no-color --tail=60 >&2 || true
    fi
    if [ "${E2E_KEEP:-0}" = 1 ]; then
        log "E2E_KEEP=1: left up; remove with: ${compose[*]} down -v --remove-orphans"
    elif [ "$UNTIL" != build ]; then
        "${compose[@]}" down -v --remove-orphans --timeout 30 >&2 || true
    fi
    if [ -n "$started_dockerd" ] && [ "${E2E_KEEP:-0}" != 1 ]; then
        kill "$started_dockerd" 2>/dev/null || true
        wait "$started_dockerd" 2>/dev/null || true
    fi
    report
    exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- 2. base image ---------------------------------------------------------------------------
if [ -z "${BASE_IMAGE:-}" ]; then
    BASE_IMAGE=$(deploy/docker/build-base-image.sh)
fi
export BASE_IMAGE
stage "base image ($BASE_IMAGE)"

# --- 3. project image ------------------------------------------------------------------------
# Local inputs for the build stage (git-ignored): the machine's CPU wheel of torch when pip
# has one without a network, and the CA bundle pip trusts here (a proxy may re-sign TLS).
mkdir -p deploy/docker/local/wheels
if ! ls deploy/docker/local/wheels/torch-*.whl >/dev/null 2>&1; then
    python3 -m pip download --quiet --no-deps --no-index -d deploy/docker/local/wheels \
        torch==2.13.0 >&2 || log "no local torch wheel: the build asks the PyTorch CPU index"
fi
ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
if [ -s "$ca" ]; then cp "$ca" deploy/docker/local/ca-certificates.crt; fi
build_args=(--build-arg BASE_IMAGE="$BASE_IMAGE")
if [ "${E2E_PRECOMPILE:-0}" = 1 ]; then
    build_args+=(--build-arg PRECOMPILE="$MODE" --build-arg PRECOMPILE_THREADS="$(nproc)")
fi
docker build "${build_args[@]}" -t "$IMAGE" . >.cache/e2e-build.log 2>&1 ||
    { tail -40 .cache/e2e-build.log >&2; log "image build failed (.cache/e2e-build.log)"; exit 1; }
size=$(docker image inspect --format '{{.Size}}' "$IMAGE")
stage "image build"
log "image $IMAGE: $((size / 1000000)) MB"
"${compose[@]}" config -q
docker run --rm "$IMAGE" sh -ec 'test "$(id -u)" != 0; inference-svc --help >/dev/null;
    warmup-ctl --help >/dev/null; inference-cli --help >/dev/null'
stage "compose config + entrypoints"
if [ "$UNTIL" = build ]; then
    log "PASS (until build)"
    exit 0
fi

# --- 4. compose up ---------------------------------------------------------------------------
state() {  # state CONTAINER -> "running healthy", "exited 0", "created", ...
    docker inspect --format \
        '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.ExitCode}}{{end}}' \
        "$1" 2>/dev/null || echo "absent"
}
cid_of() { "${compose[@]}" ps -q "$1" 2>/dev/null || true; }
cli() {  # cli SUBCOMMAND ARGS...: inference-cli against the published port, from the host
    local sub=$1
    shift
    if [ "${E2E_TLS:-0}" = 1 ]; then set -- "$@" --tls-ca /tls/ca.pem; fi
    docker run --rm --network host "${tls_args[@]}" "$IMAGE" \
        inference-cli "$sub" --addr "127.0.0.1:$INFERENCE_PORT" "$@"
}
check_tls() {  # a plaintext client is refused; the sidecar checked public health over TLS
    if docker run --rm --network host "$IMAGE" inference-cli health \
        --addr "127.0.0.1:$INFERENCE_PORT" --service liveness --timeout 5 >&2; then
        log "the TLS port answered a plaintext client"; exit 1
    fi
    "${compose[@]}" logs --no-color warmup-ctl 2>&1 | grep -q "public health SERVING" ||
        { log "the sidecar did not see SERVING over TLS"; exit 1; }
    log "TLS: plaintext refused, TLS clients served, the sidecar's health check speaks TLS"
}
info_field() {  # info_field NAME: a field of the Info reply
    cli info --json | python3 -c 'import json, sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"
}
metric() {  # metric NAME: its samples on the published /metrics port, from the host
    python3 - "$1" "$INFERENCE_METRICS_PORT" <<'PY'
import sys, urllib.request
name, port = sys.argv[1], sys.argv[2]
text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
print(" ".join(line for line in text.splitlines() if line.startswith(name)))
PY
}
check_late_compiles() {
    local late
    late=$(info_field late_compile_events)
    log "late compile events (compiles after SERVING): $late"
    log "metrics: $(metric inference_health_serving); $(metric inference_late_compile_events_total)"
    metric inference_health_serving | grep -q "inference_health_serving 1.0" ||
        { log "metrics do not say SERVING"; exit 1; }
    if [ "$late" != 0 ]; then
        "${compose[@]}" logs --no-color server 2>&1 | grep -i -E "late|recompil" | tail -20 >&2 || true
        if [ "${E2E_ALLOW_LATE_COMPILES:-0}" = 1 ]; then log "WARNING: requests hit cold paths"
        else log "requests hit cold paths after SERVING"; exit 1; fi
    fi
}

# `up -d` itself blocks until the healthcheck passes (the client depends on service_healthy).
"${compose[@]}" up -d --no-build >.cache/e2e-up.log 2>&1 &
up_pid=$!
svc=""
for _ in $(seq 120); do svc=$(cid_of inference); [ -n "$svc" ] && break; sleep 1; done
[ -n "$svc" ] || { log "the inference container was not created"; cat .cache/e2e-up.log >&2; exit 1; }
for _ in $(seq 120); do case "$(state "$svc")" in running* | exited* | dead*) break ;; esac; sleep 1; done
stage "containers created"

# The process listens at once; "liveness" answers SERVING before any warmup.
cli health --service liveness --wait --timeout 300 >&2
stage "liveness SERVING (listening)"

check_ports() {
    log "admin port $ADMIN_PORT: published? reachable from the host or another container?"
    local published ip net
    published=$(docker port "$svc")
    log "published: ${published//$'\n'/; }"
    if grep -q "^$ADMIN_PORT/" <<<"$published"; then log "admin port is published"; exit 1; fi
    grep -q "^50051/tcp" <<<"$published" || { log "public port is not published"; exit 1; }
    ip=$(docker inspect --format '{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}' "$svc")
    net=$(docker inspect --format '{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}' "$svc")
    local probe='import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((host, port), timeout=3).close()
except OSError as e:
    print(f"{host}:{port} unreachable ({e})"); sys.exit(1)
print(f"{host}:{port} reachable")'
    for addr in ${ip}; do
        if python3 -c "$probe" "$addr" "$ADMIN_PORT" >&2; then
            log "admin port reachable from the host at $addr"; exit 1
        fi
        python3 -c "$probe" "$addr" 50051 >&2 || { log "public port not reachable at $addr"; exit 1; }
    done
    if python3 -c "$probe" 127.0.0.1 "$INFERENCE_PORT" >&2; then :; else
        log "published port $INFERENCE_PORT not reachable from the host"; exit 1
    fi
    for n in ${net}; do
        if docker run --rm --network "$n" "$IMAGE" python3 -c "$probe" inference "$ADMIN_PORT" >&2
        then log "admin port reachable from another container on $n"; exit 1; fi
    done
    # Positive control: it is there, inside the shared namespace (where warmup-ctl runs).
    "${compose[@]}" exec -T warmup-ctl python3 -c "$probe" 127.0.0.1 "$ADMIN_PORT" >&2 ||
        { log "admin port not reachable even inside the pod's namespace"; exit 1; }
}
check_ports
stage "port checks"

if [ "$UNTIL" = start ]; then
    log "state: $(state "$svc"); warmup-ctl says:"
    "${compose[@]}" logs --no-color --tail=15 warmup-ctl >&2 || true
    kill "$up_pid" 2>/dev/null || true
    wait "$up_pid" 2>/dev/null || true
    log "PASS (until start)"
    exit 0
fi

log "waiting up to ${TIMEOUT}s for the healthcheck (compilation mode $MODE)"
deadline=$((SECONDS + TIMEOUT))
last=""
while :; do
    s=$(state "$svc")
    [ "$s" != "$last" ] && log "inference: $s" && last=$s
    case "$s" in
        "running healthy") break ;;
        "running unhealthy" | exited* | dead* | absent) log "inference is $s"; exit 1 ;;
    esac
    server=$(cid_of server)
    if [ -n "$server" ] && [ "$(docker inspect --format '{{.RestartCount}}' "$server")" != 0 ]; then
        log "the server container restarted during warmup"; exit 1
    fi
    client=$(cid_of client)
    if [ -n "$client" ] && [ "$(docker inspect --format '{{.State.StartedAt}}' "$client")" != \
        "0001-01-01T00:00:00Z" ]; then
        log "the client started before the service was healthy"; exit 1
    fi
    ((SECONDS < deadline)) || { log "not healthy after ${TIMEOUT}s"; exit 1; }
    sleep 5
done
stage "cold start to healthy"
if [ "${E2E_PRECOMPILE:-0}" = 1 ]; then  # shipped warm: nothing may have compiled
    ctl_log=$("${compose[@]}" logs --no-color warmup-ctl 2>&1)
    grep -E "step [0-9]+/[0-9]+: COMPILE .* compile events" <<<"$ctl_log" >&2 || true
    grep -q "from kept artifacts" <<<"$ctl_log" ||
        { log "the first start did not load the image's artifacts"; exit 1; }
    if grep -E "step [0-9]+/[0-9]+: COMPILE .* [1-9][0-9]* compile events" <<<"$ctl_log" >&2; then
        log "the first start compiled beside the image's artifacts"; exit 1
    fi
    log "shipped warm: the first start loaded the image's artifacts, 0 compile events"
fi

wait "$up_pid" || { cat .cache/e2e-up.log >&2; log "docker-compose up failed"; exit 1; }
client=$(cid_of client)
[ -n "$client" ] || { log "no client container"; exit 1; }
code=$(timeout 600 docker wait "$client")
log "client output:"
docker logs "$client" >&2
[ "$code" = 0 ] || { log "the client exited $code"; exit 1; }
stage "client (embed + generate)"

check_ports
cli info >&2
check_late_compiles
if [ "${E2E_TLS:-0}" = 1 ]; then check_tls; fi

# --- 6. restart the server: the sidecar warms the new process --------------------------------
if [ "${E2E_RESTART:-1}" = 1 ]; then
    boot=$(info_field boot_id)
    "${compose[@]}" restart server >&2
    cli health --wait --timeout "$TIMEOUT" >&2
    [ "$(info_field boot_id)" != "$boot" ] || { log "still the old process after restart"; exit 1; }
    stage "server restart to SERVING (cache)"
    code=$(docker start --attach "$client" >&2; docker wait "$client")
    [ "$code" = 0 ] || { log "the client exited $code after the restart"; exit 1; }
    check_late_compiles
    stage "client again"
fi
log "PASS"
