"""Who may import what: the rules that keep the contract, the service, the sidecar and the
client apart. Each package is read as source (every import statement, lazy ones too) and
imported in a fresh interpreter (what it really pulls in)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}
# Top-level modules each package may import besides the standard library and itself.
ALLOWED = {
    "inference_api": {"grpc", "google"},  # torch-free: a sidecar or a client needs no model stack
    "warmup_ctl": {"inference_api", "grpc", "grpc_health", "tenacity"},
    "inference_cli": {"inference_api", "grpc", "grpc_health", "google"},
}
# The only module of the service that touches protobuf messages.
WIRE = ROOT / "inference_svc" / "wire.py"


def modules(package: str) -> list[Path]:
    skip = ROOT / "inference_api" / "stubs"  # generated: checked by test_stubs
    files = sorted((ROOT / package).rglob("*.py"))
    return [p for p in files if skip not in p.parents]


def imports(path: Path) -> set[str]:
    """Every module named by an import statement in ``path`` (absolute imports only)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            base = node.module or ""
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_it_may(package: str) -> None:
    allowed = STDLIB | ALLOWED[package] | {package}
    bad = {
        f"{p.relative_to(ROOT)}: {name}"
        for p in modules(package)
        for name in imports(p)
        if top(name) not in allowed
    }
    assert not bad, f"{package} imports outside its rule: {sorted(bad)}"


def test_the_service_never_imports_the_sidecar_or_the_client() -> None:
    bad = {
        f"{p.relative_to(ROOT)}: {name}"
        for p in modules("inference_svc")
        for name in imports(p)
        if top(name) in {"warmup_ctl", "inference_cli"}
    }
    assert not bad, sorted(bad)


def is_protobuf(name: str) -> bool:
    """Protobuf messages: google.protobuf or a generated *_pb2 module (the *_pb2_grpc
    service stubs hold servicer base classes and are allowed to the servicers)."""
    return top(name) == "google" or name.endswith("_pb2")


def test_only_wire_imports_protobuf() -> None:
    users = {
        str(p.relative_to(ROOT))
        for p in modules("inference_svc")
        if any(is_protobuf(n) for n in imports(p))
    }
    assert users == {str(WIRE.relative_to(ROOT))}


def loaded_after_import(*names: str) -> set[str]:
    """Top-level modules a fresh interpreter holds after importing ``names``."""
    code = (
        "import importlib, json, sys\n"
        f"for n in {list(names)!r}: importlib.import_module(n)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    )
    return set(json.loads(out.stdout))


def test_the_sidecar_process_loads_neither_torch_nor_the_service() -> None:
    loaded = loaded_after_import("warmup_ctl.__main__", "warmup_ctl.driver", "warmup_ctl.plan")
    assert not loaded & {"torch", "inference_svc", "inference_cli", "transformers"}


def test_the_contract_loads_neither_torch_nor_either_side() -> None:
    names = [f"inference_api.{p.stem}" for p in modules("inference_api") if p.stem != "__init__"]
    loaded = loaded_after_import(*names)
    assert not loaded & {"torch", "inference_svc", "warmup_ctl", "inference_cli"}


def test_the_scheduler_and_the_output_stage_load_no_torch() -> None:
    """The Generate scheduler, the output stage, the inbox and the batcher are plain Python:
    unit-testable without torch or gRPC."""
    pure = ("scheduler", "output", "inbox", "batcher", "compute")
    loaded = loaded_after_import(*(f"inference_svc.engine.{m}" for m in pure))
    assert not loaded & {"torch", "grpc", "transformers", "numpy"}


def test_no_import_cycle_inside_a_package() -> None:
    """Module-level imports only (an import inside a function runs later, by design)."""
    graph: dict[str, set[str]] = {}
    for package in ("inference_svc", "inference_api", "warmup_ctl", "inference_cli"):
        for path in modules(package):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            deps: set[str] = set()
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module:
                    deps.add(node.module)
                    deps.update(f"{node.module}.{a.name}" for a in node.names)
            graph[name] = deps
    edges = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    done: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(m) :], m]))
        if m in done:
            return
        for d in sorted(edges[m]):
            visit(d, [*stack, m])
        done.add(m)

    for m in sorted(edges):
        visit(m, [])
