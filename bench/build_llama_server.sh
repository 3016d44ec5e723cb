#!/usr/bin/env bash
# Builds llama.cpp's own HTTP server (llama-server), the Generate peer of bench/throughput.py
# and bench/compiled.py (bench/peer_server.py), from the llama.cpp that the llama-cpp-python
# sdist vendors (the pinned version below), without its Python binding.
#
#   bench/build_llama_server.sh          # prints the binary's path on its last line
#
# Where: ${LLAMA_SERVER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/inference-svc/llama-server}/VERSION/
# (outside git): the sdist, its unpacked sources, the cmake build folder and bin/llama-server.
# Idempotent: with bin/llama-server present it only prints the path. About 15 minutes on 2
# cores (-j2; LLAMA_SERVER_JOBS=N to change).
#
# Build: Release, CPU only, GGML_NATIVE=ON (-march=native: the binary is for this machine),
# static (no shared libraries to find at run time), no CURL, no OpenSSL, no web UI, only the
# llama-server target. LLAMA_SERVER_CMAKE_ARGS adds cmake arguments (e.g. "-DGGML_NATIVE=OFF
# -DGGML_AVX512=ON ..." for a portable build).
#
# Needs: the project's .venv (pip, to download the sdist from PyPI), tar, a C/C++ compiler
# (gcc/g++ >= 9 or clang; apt-get install build-essential), cmake >= 3.14 (apt-get install
# cmake, or .venv/bin/pip install cmake) and make or ninja. No internet but PyPI.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"  # the pin of pyproject.toml's 'peer' extra
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${LLAMA_SERVER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/inference-svc/llama-server}"
DEST="$CACHE/$VERSION"
BIN="$DEST/bin/llama-server"
JOBS="${LLAMA_SERVER_JOBS:-2}"

if [[ -x "$BIN" ]]; then
    echo "$BIN"
    exit 0
fi

PIP="$ROOT/.venv/bin/pip"
[[ -x "$PIP" ]] || PIP="pip"
CMAKE="$(command -v cmake || true)"
[[ -n "$CMAKE" ]] || CMAKE="$ROOT/.venv/bin/cmake"
if [[ ! -x "$CMAKE" ]]; then
    echo "cmake not found: apt-get install cmake, or $PIP install cmake" >&2
    exit 1
fi
for tool in tar c++ cc; do
    command -v "$tool" >/dev/null || { echo "$tool not found: apt-get install build-essential" >&2; exit 1; }
done
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)

mkdir -p "$DEST"
SDIST="$DEST/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    "$PIP" download --no-binary :all: --no-deps -d "$DEST" "llama-cpp-python==$VERSION" >&2
fi
SRC="$DEST/llama_cpp_python-$VERSION"
if [[ ! -d "$SRC/vendor/llama.cpp" ]]; then
    tar -xzf "$SDIST" -C "$DEST"
fi
LLAMA="$SRC/vendor/llama.cpp"

# shellcheck disable=SC2086  # LLAMA_SERVER_CMAKE_ARGS is a list of words
"$CMAKE" -S "$LLAMA" -B "$DEST/build" "${GENERATOR[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENCL=OFF -DGGML_RPC=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    ${LLAMA_SERVER_CMAKE_ARGS:-} >&2
"$CMAKE" --build "$DEST/build" --config Release --target llama-server -j "$JOBS" >&2

mkdir -p "$DEST/bin"
cp "$DEST/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"  # present only once whole: the next run skips the build
echo "llama-cpp-python==$VERSION (vendored llama.cpp), GGML_NATIVE=ON ${LLAMA_SERVER_CMAKE_ARGS:-}" \
    > "$DEST/bin/BUILD"
echo "$BIN"
