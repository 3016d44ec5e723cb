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
exec .venv/bin/pytest -ra "$@"
