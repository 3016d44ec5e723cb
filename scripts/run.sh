#!/usr/bin/env bash
# The main job: installs what is missing, then runs the service and its warmup sidecar
# together in the foreground, their logs prefixed. The sidecar logs the warmup plan and each
# step; this script says when the service is SERVING and how to call it. Ctrl-C (or SIGTERM)
# stops both.
#
#   scripts/run.sh                              # eager (compilation mode none): quick start
#   scripts/run.sh --compilation-mode default   # compiled: minutes of warmup on a small CPU
#
# Arguments go to inference-svc. Ports default to 50051 (public) and 50052 (admin, loopback);
# pass --port / --admin-port to change them (0 = any free port; the script reads the ports
# the service reports in its --port-file).
#   WARMUP_CTL_ARGS   extra flags for warmup-ctl, e.g. "--step-timeout 3600 --retries 1"
#   RUN_SKIP_SETUP=1  skip scripts/setup.sh (the venv is known to be complete)
#   RUN_SVC, RUN_CTL  the two commands (default .venv/bin/inference-svc, .venv/bin/warmup-ctl)
set -euo pipefail
cd "$(dirname "$0")/.."

export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ "${RUN_SKIP_SETUP:-0}" != 1 ]; then
    # Runtime only; a venv already set up with the test tools keeps them (and its stamp).
    if [ -x .venv/bin/pytest ]; then scripts/setup.sh test; else scripts/setup.sh; fi
fi
svc_cmd=${RUN_SVC:-.venv/bin/inference-svc}
ctl_cmd=${RUN_CTL:-.venv/bin/warmup-ctl}
python=.venv/bin/python
[ -x "$python" ] || python=python3

svc_pid=""
ctl_pid=""
filters=""  # the log filters' pids
tmp=$(mktemp -d)
port_file="$tmp/ports.json"

say() { printf 'run    | %s\n' "$*" >&2; }
prefix() { while IFS= read -r line; do printf '%s | %s\n' "$1" "$line"; done; }

# Stops both processes (sidecar first, so it does not report the service as lost), waits for
# the service's grace period, then kills what is left. Runs once, on any exit.
stop() {
    trap - EXIT INT TERM
    local pid deadline=$((SECONDS + 30))
    for pid in $ctl_pid $svc_pid; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in $ctl_pid $svc_pid; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    # Reap everything, the log filters too (they end at EOF), so nothing is left behind.
    for pid in $ctl_pid $svc_pid $filters; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap stop EXIT
trap 'say "stopping"; stop; exit 130' INT
trap 'say "stopping"; stop; exit 143' TERM

serving_banner() {
    say "=== SERVING on 127.0.0.1:$1 (inference.v1.Inference, grpc.health.v1, reflection) ==="
    say "  .venv/bin/inference-cli embed --addr 127.0.0.1:$1 \"hello\""
    say "  .venv/bin/inference-cli generate --addr 127.0.0.1:$1 --max-tokens 32 \"Once upon a time\""
    say "  .venv/bin/inference-cli info --addr 127.0.0.1:$1"
    say "  Ctrl-C stops the service and the sidecar"
}

sidecar_log() {
    while IFS= read -r line; do
        printf 'warmup | %s\n' "$line"
        case $line in *" SERVING: boot "*) serving_banner "$1" >&2 ;; esac
    done
}

say "starting inference-svc $*"
exec {log_fd}> >(prefix "svc   ")
filters="$filters $!"
# shellcheck disable=SC2086  # RUN_SVC may be a command with arguments
$svc_cmd "$@" --port-file "$port_file" >&"$log_fd" 2>&1 &
svc_pid=$!
exec {log_fd}>&-

# The ports the service listens on, once it has written them.
read_ports() {
    "$python" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(d["port"], d["admin_port"])' \
        "$port_file" 2>/dev/null
}
ports=""
until ports=$(read_ports); do
    if ! kill -0 "$svc_pid" 2>/dev/null; then
        status=0
        wait "$svc_pid" || status=$?
        say "inference-svc exited (status $status) before it listened"
        exit $((status == 0 ? 1 : status))
    fi
    sleep 0.2
done
read -r port admin_port <<<"$ports"
say "inference-svc listens on $port (public) and $admin_port (admin); starting warmup-ctl"

exec {log_fd}> >(sidecar_log "$port")
filters="$filters $!"
# shellcheck disable=SC2086  # RUN_CTL may have arguments; WARMUP_CTL_ARGS is a list of flags
$ctl_cmd --admin "127.0.0.1:$admin_port" --public "127.0.0.1:$port" ${WARMUP_CTL_ARGS:-} \
    >&"$log_fd" 2>&1 &
ctl_pid=$!
exec {log_fd}>&-

# Runs until either one exits (or a signal arrives); then the EXIT trap stops the other.
status=0
wait -n "$svc_pid" "$ctl_pid" || status=$?
if kill -0 "$svc_pid" 2>/dev/null; then
    say "warmup-ctl exited (status $status); stopping inference-svc"
else
    say "inference-svc exited (status $status)"
fi
exit "$status"
