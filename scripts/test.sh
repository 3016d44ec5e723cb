#!/usr/bin/env bash
# The test command: installs what is missing (venv, CPU torch, packages, models), then runs
# the whole suite (what CI runs). Extra arguments go to pytest, e.g. scripts/test.sh -k health;
# The fast tier while developing: scripts/test.sh --fast [more pytest arguments], the same as
# -m "(unit or rpc) and not slow" (tests/README.md).
#
# The end-to-end tests start the real service and sidecar as processes; the Docker
# end-to-end test runs only with RUN_DOCKER_E2E=1 (see deploy/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# Compiled artifacts are cached between runs (a rerun skips most of inductor's work).
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
scripts/setup.sh test
.venv/bin/ruff check .
if [[ ${1:-} == --fast ]]; then
    shift
    set -- -m "(unit or rpc) and not slow" "$@"
fi
# One test module per worker at a time (module fixtures stay in one process); as many workers
# as CPUs, at most 4, TEST_WORKERS to choose (TEST_WORKERS=0: all in this process).
cpus=$(nproc)
workers=${TEST_WORKERS:-$((cpus < 4 ? cpus : 4))}
if [[ $workers -gt 0 ]]; then
    set -- -n "$workers" --dist loadfile "$@"
fi
# The slowest tests are listed at the end: the suite must stay under 20 minutes on 2 cores.
exec .venv/bin/pytest -ra --durations=15 "$@"
