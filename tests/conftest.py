"""Shared fixtures: tiny model directories and real services on port 0.

Every test module carries one tier marker (unit, rpc, proc, deploy: tests/README.md);
tests/test_tiers.py fails for a module without one. An in-process service for a test:
``async with serving(tiny_args(...), warm=True) as (service, clients):`` (tests/rpc.py)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from tests.models import build_tiny_embedder, build_tiny_lm
from tests.rpc import Clients, serving

if TYPE_CHECKING:
    pass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Hermetic compiles: no test (in process or a child process) loads or keeps compiled
# artifacts unless it passes --compile-cache-dir itself (tests/test_artifacts.py does).
os.environ["INFERENCE_SVC_COMPILE_CACHE_DIR"] = ""

# The longest modules first (the full suite's --durations, 2 cores, 2026-12-07: test_e2e
# ~400 s, test_artifacts ~280, test_compiled_tiny ~230, test_bench_quick ~190, ...). Workers
# take whole modules in collection order (--dist loadfile), so one of these started last
# would run on alone after the other worker is done; the rest keep their order.
LONGEST_FIRST = (
    "test_e2e.py", "test_artifacts.py", "test_compiled_tiny.py", "test_bench_quick.py",
    "test_families_compiled.py", "test_decode_attention.py", "test_quant_linear.py",
    "test_scaleout_envoy.py", "test_aoti.py", "test_generate.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-lm"))


@pytest.fixture(scope="session")
def tiny_embed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_embedder(tmp_path_factory.mktemp("tiny-embed"))


# Dynamo in the process: the compiled modes' backend where a test is about torch.compile
# (its caches, late compiles, freezing); the default on a CPU is aoti (tests/test_aoti.py).
TORCH_COMPILE = ("--compile-backend", "torch-compile")


def tiny_args(tiny_embed_dir: Path, tiny_lm_dir: Path, *extra: str) -> list[str]:
    return [
        "--port",
        "0",
        "--admin-port",
        "0",
        "--embed-model",
        str(tiny_embed_dir),
        "--lm-model",
        str(tiny_lm_dir),
        "--max-input-tokens",
        "32",
        "--max-new-tokens",
        "16",
        "--embed-max-batch",
        "4",
        *extra,
    ]


@pytest_asyncio.fixture(scope="session")
async def real() -> AsyncIterator[Clients]:
    """The packaged real models, eager (mode NONE), warmed and SERVING."""
    async with serving(["--port", "0", "--admin-port", "0", "--seed", "7"], warm=True) as (_, c):
        yield c
