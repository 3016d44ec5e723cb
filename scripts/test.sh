#!/usr/bin/env bash
# The test command: installs what is missing (venv, CPU torch, packages, models), then runs
# the whole suite (what CI runs). Extra arguments go to pytest, e.g. scripts/test.sh -k health;
# the fast tier while developing: scripts/test.sh -m "unit or rpc" (tests/README.md).
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
exec .venv/bin/pytest -ra "$@"
