"""What kept compiled artifacts are keyed on, and the check that a kept directory matches.

The key covers everything the artifacts depend on and torch does not check itself: the
torch and Python versions, the CPU's capabilities, the thread count, the compilation mode
and backend, the numerics, the shape limits, the weights (a hash of the model files), the
code of the compiled functions and inductor's header directory. ``verify`` says why a kept
directory cannot be used (no manifest, another key, a missing or corrupt file), or None.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from inference_svc.models.cpu import capabilities

MANIFEST = "manifest.json"
FORMAT = 1
# The code the compiled graphs come from (relative to the inference_svc package).
_CODE = ("models", "sampling.py")
_WEIGHT_SUFFIXES = {".safetensors", ".gguf", ".bin", ".pt", ".pth", ".json"}
# The settings that decide the shapes the graphs are compiled for.
SHAPE_SETTINGS = (
    "embed_max_batch", "gen_max_batch", "prefill_chunk_tokens", "max_input_tokens",
    "max_new_tokens", "kv_cache_tokens",
)  # fmt: skip
# What each key field means, for the log line that says why artifacts were not used.
FIELD_NAMES = {
    "torch": "torch version",
    "python": "Python version",
    "cpu": "CPU capabilities",
    "threads": "thread count",
    "mode": "compilation mode and backend",
    "numerics": "numerics (--dtype, --lm-weights, --embed-dtype, --kv-cache-dtype)",
    "shapes": "shape limits",
    "code": "code of the compiled functions",
    "headers": "inductor's precompiled-header directory (per user: $TMPDIR/torchinductor_<user>)",
}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(directory: Path) -> str:
    """A hash of a model directory's weight and config files (names and contents)."""
    h = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.suffix in _WEIGHT_SUFFIXES and not path.name.startswith("."):
            h.update(str(path.relative_to(directory)).encode())
            h.update(_sha256_file(path).encode())
    return h.hexdigest()[:20]


def code_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for part in _CODE:
        where = root / part
        for path in sorted(where.rglob("*.py")) if where.is_dir() else [where]:
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:20]


def cpu_digest() -> str:
    """The instruction sets the compiled kernels may use: torch's capability level and the
    CPU's feature flags (inductor picks vector ISAs from them), as models/cpu.py reads them
    (without /proc/cpuinfo: the processor's name)."""
    caps = capabilities()
    flags = " ".join(sorted(caps.flags)) or platform.processor()
    return f"{caps.isa}-{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def header_dir() -> str:
    """Where inductor keeps precompiled headers: its C++ kernels are keyed on their compile
    command, which names this directory, so kernels compiled by another user (another
    directory) are never found, and recompiling them beside loaded graphs fails."""
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config

    if not inductor_config.cpp_cache_precompile_headers:
        return "off"
    return str(getattr(codecache, "_HEADER_DIR", "unknown"))


@dataclass(frozen=True)
class ArtifactKey:
    fields: dict[str, str]

    @property
    def digest(self) -> str:
        raw = json.dumps(self.fields, sort_keys=True).encode()
        return hashlib.sha256(raw).hexdigest()[:24]

    def differences(self, other: dict[str, str]) -> list[str]:
        """What differs from another key's fields, in words."""
        out = []
        for name in sorted(set(self.fields) | set(other)):
            mine, theirs = self.fields.get(name), other.get(name)
            if mine != theirs:
                what = FIELD_NAMES.get(name) or name.replace("weights:", "weights of ")
                out.append(f"{what} ({theirs} there, {mine} here)")
        return out


def make_key(
    mode: str, numerics: str, shapes: dict[str, object], model_dirs: dict[str, Path]
) -> ArtifactKey:
    fields = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_digest(),
        "threads": str(torch.get_num_threads()),
        "mode": mode,
        "numerics": numerics,
        "shapes": json.dumps(shapes, sort_keys=True),
        "code": code_digest(),
        "headers": header_dir(),
    }
    for name, directory in sorted(model_dirs.items()):
        fields[f"weights:{name}"] = weights_digest(directory)
    return ArtifactKey(fields)


def manifest_files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): _sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST and "locks" not in p.relative_to(root).parts
    }


def verify(entry: Path, key: ArtifactKey) -> str | None:
    """Why the kept directory ``entry`` cannot be used for ``key``, or None if it can."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        fields, files = manifest["key"], manifest["files"]
    except FileNotFoundError:
        return "no manifest (an unfinished or foreign directory)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({type(e).__name__}: {e})"
    if manifest.get("format") != FORMAT:
        return f"manifest format {manifest.get('format')} (this service writes {FORMAT})"
    if fields != key.fields:
        return "made for another key: " + "; ".join(key.differences(fields))
    missing = [name for name in files if not (entry / name).is_file()]
    if missing:
        return f"file {missing[0]} is missing"
    # Hashed on every core (hashlib releases the GIL): the packages are hundreds of MiB.
    names = sorted(files, key=lambda n: -(entry / n).stat().st_size)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        digests = dict(zip(names, pool.map(lambda n: _sha256_file(entry / n), names), strict=True))
    for name, digest in files.items():
        if digests[name] != digest:
            return f"file {name} is corrupt (its hash differs from the manifest's)"
    return None
