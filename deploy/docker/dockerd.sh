# Sourced by deploy/docker/e2e.sh and scale-e2e.sh (which define `log`): starts dockerd when no
# Docker engine answers and sets started_dockerd to its pid ("" when one was running already).
started_dockerd=""
if ! docker info >/dev/null 2>&1; then
    mkdir -p .cache
    log "starting dockerd (log: .cache/dockerd.log)"
    dockerd >.cache/dockerd.log 2>&1 &
    started_dockerd=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { log "dockerd did not come up"; tail -20 .cache/dockerd.log >&2; exit 1; }
fi
