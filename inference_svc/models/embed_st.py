"""What a sentence-transformers directory declares, read as sentence-transformers reads it:
modules.json (Transformer, Pooling, Dense, Normalize), the pooling config, sentence_bert_config.json
(max_seq_length, do_lower_case) and config_sentence_transformers.json (prompts); and the
pooling itself, the same arithmetic as sentence-transformers' Pooling.

A directory without modules.json is a plain transformers encoder: mean pooling, no
normalisation (what sentence-transformers builds for it). Anything else a directory declares
that would change the vectors and is not done here is refused at load, by name.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# sentence-transformers' pooling modes, in the order it concatenates several of them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
SUPPORTED_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
# The prompts every SentenceTransformer accepts (empty unless the model declares them).
ALWAYS_PROMPTS = ("query", "document")
# sentence_bert_config.json keys that change nothing here, or only where the checks below say.
_TEXT_ONLY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass(frozen=True)
class DenseConfig:
    """A Dense module: activation(linear(x)), plus x (or a projection of it) with a residual."""

    path: Path  # its folder: config.json and the weights
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "torch.nn.modules.activation.Tanh"
    use_residual: bool = False

    def build(self) -> torch.nn.Module:
        """The module with its weights, as sentence-transformers' Dense holds them."""
        module = _Dense(self)
        module.load_state_dict(_weights(self.path))
        return module


class _Dense(torch.nn.Module):
    def __init__(self, c: DenseConfig) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(c.in_features, c.out_features, bias=c.bias)
        self.activation = _activation(c.activation)()
        self.use_residual = c.use_residual
        if c.use_residual and c.in_features != c.out_features:
            self.residual = torch.nn.Linear(c.in_features, c.out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out = self.activation(self.linear(x))
        if not self.use_residual:
            return out
        return out + (self.residual(x) if hasattr(self, "residual") else x)


def _activation(name: str) -> type[torch.nn.Module]:
    """A torch.nn module class by its dotted name (what sentence-transformers loads without
    trust_remote_code); anything else is refused (and never imported)."""
    module, _, cls = name.rpartition(".")
    found = None
    if module.startswith("torch."):
        with contextlib.suppress(ImportError):
            found = getattr(importlib.import_module(module), cls, None)
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        raise ValueError(f"Dense activation_function {name!r} is not supported (torch.nn only)")
    return found


def _weights(directory: Path) -> dict[str, Tensor]:
    if (directory / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(directory / "model.safetensors"))
    return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)


@dataclass(frozen=True)
class StConfig:
    """The sentence-transformers pipeline a directory declares."""

    pooling: tuple[str, ...] = ("mean",)
    include_prompt: bool = True  # False: prompt tokens are left out of the pooling
    dense: tuple[DenseConfig, ...] = ()  # Dense modules after the pooling, in order
    normalize: bool = False  # a Normalize module at the end
    max_seq_length: int | None = None
    do_lower_case: bool = False
    tokenizer_kwargs: dict[str, Any] = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=lambda: dict.fromkeys(ALWAYS_PROMPTS, ""))
    default_prompt_name: str | None = None

    def prompt_name(self, name: str) -> str:
        """The prompt a request names, or the default ("" when there is none)."""
        return name or self.default_prompt_name or ""

    def prompt(self, name: str) -> str:
        """The text of the prompt a request names, or of the default ("" = none)."""
        return self.prompts.get(self.prompt_name(name), "")


def _module_kind(entry: dict[str, Any]) -> str:
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def pooling_modes(cfg: dict[str, Any]) -> tuple[str, ...]:
    """The modes of a Pooling config, new style (``pooling_mode``) or legacy booleans."""
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = tuple(m for k, m in _LEGACY_POOLING_KEYS.items() if cfg.get(k))
        return modes or ("mean",)
    modes = (mode,) if isinstance(mode, str) else tuple(mode)
    for m in modes:
        if m not in POOLING_MODES:
            raise ValueError(f"pooling mode {m!r} is not supported; supported: {POOLING_MODES}")
    return modes


def _check_transformer(directory: Path, cfg: dict[str, Any]) -> None:
    """Refuse what sentence_bert_config.json asks that would change the vectors here."""
    task = cfg.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ValueError(f"{directory.name}: transformer_task {task!r} is not supported")
    modality = cfg.get("modality_config", _TEXT_ONLY)
    if modality != _TEXT_ONLY:
        raise ValueError(
            f"{directory.name}: modality_config {sorted(modality)} is not supported (text "
            "through forward's last_hidden_state only; chat-template 'message' inputs are not)"
        )
    for key in ("query_length", "document_length", "query_expansion", "processing_kwargs"):
        if cfg.get(key):
            raise ValueError(f"{directory.name}: sentence_bert_config {key} is not supported")
    if cfg.get("backend", "torch") != "torch":
        raise ValueError(f"{directory.name}: backend {cfg['backend']!r} is not supported")


def read_st_config(directory: Path) -> StConfig:
    """The pipeline ``directory`` declares; ValueError naming what is not supported."""
    modules = read_json(directory / "modules.json")
    if not modules:
        return StConfig()
    modules = sorted(modules, key=lambda m: int(m.get("idx", 0)))
    kinds = [_module_kind(m) for m in modules]
    for entry, kind in zip(modules, kinds, strict=True):
        if kind not in SUPPORTED_MODULES:
            raise ValueError(
                f"{directory.name}: sentence-transformers module {entry.get('type')!r} "
                f"({entry.get('path') or 'root'}) is not supported; supported: "
                f"{', '.join(SUPPORTED_MODULES)}"
            )
    normalize = kinds[-1] == "Normalize"
    middle = kinds[2 : len(kinds) - normalize]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Dense" for k in middle):
        raise ValueError(
            f"{directory.name}: modules {kinds} are not supported; supported: Transformer, "
            "Pooling, any Dense and optionally Normalize, in that order"
        )
    if modules[0].get("path", ""):
        raise ValueError(f"{directory.name}: a Transformer in a subfolder is not supported")
    bert = read_json(directory / "sentence_bert_config.json")
    _check_transformer(directory, bert)
    pool = read_json(directory / modules[1]["path"] / "config.json")
    st = read_json(directory / "config_sentence_transformers.json")
    prompts = dict.fromkeys(ALWAYS_PROMPTS, "")
    prompts.update({k: v or "" for k, v in (st.get("prompts") or {}).items()})
    default = st.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ValueError(
            f"{directory.name}: default_prompt_name {default!r} is not among the prompts "
            f"{sorted(prompts)}"
        )
    return StConfig(
        pooling=pooling_modes(pool),
        include_prompt=bool(pool.get("include_prompt", True)),
        dense=tuple(_dense(directory / m["path"]) for m in modules[2 : 2 + len(middle)]),
        normalize=normalize,
        max_seq_length=bert.get("max_seq_length"),
        do_lower_case=bool(bert.get("do_lower_case", False)),
        tokenizer_kwargs=dict(bert.get("processor_kwargs") or bert.get("tokenizer_args") or {}),
        prompts=prompts,
        default_prompt_name=default,
    )


def _dense(folder: Path) -> DenseConfig:
    cfg = read_json(folder / "config.json")
    for key in ("module_input_name", "module_output_name"):
        if cfg.get(key, "sentence_embedding") != "sentence_embedding":
            raise ValueError(f"{folder.name}: Dense {key} {cfg[key]!r} is not supported")
    activation = cfg.get("activation_function", DenseConfig.activation)
    _activation(activation)  # refused here, before any weights are read
    return DenseConfig(
        folder, int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)),
        activation, bool(cfg.get("use_residual", False)),
    )  # fmt: skip


def pool(hidden: Tensor, mask: Tensor, pooled: Tensor, modes: tuple[str, ...]) -> Tensor:
    """sentence-transformers' Pooling over ``hidden`` (batch, length, width): ``mask`` the
    tokens attended (padding on either side), ``pooled`` those pooled (``mask`` less an
    excluded prompt). Several modes are concatenated in ``POOLING_MODES`` order."""
    out = []
    length = hidden.shape[1]
    keep = pooled[..., None].to(hidden.dtype)
    for mode in modes:
        if mode == "cls":  # the first pooled token
            first = pooled.to(torch.int32).argmax(dim=1)
            out.append(hidden.gather(1, first[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0])
        elif mode == "max":
            out.append(hidden.masked_fill(keep == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total = (hidden * keep).sum(dim=1)
            count = keep.sum(dim=1).clamp(min=1e-9)
            out.append(total / (count if mode == "mean" else count.sqrt()))
        elif mode == "weightedmean":  # weights from 1 at the first token attended
            start = mask.to(torch.int32).argmax(dim=1)
            steps = torch.arange(1, length + 1, device=hidden.device, dtype=hidden.dtype)
            weights = keep * (steps[None, :] - start[:, None].to(hidden.dtype))[..., None]
            out.append((hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9))
        else:  # lasttoken: the last pooled token (a row with none: the last position)
            values, back = pooled.flip(1).max(dim=1)
            back = torch.where(values == 0, length - 1, back)
            index = (length - back - 1)[:, None, None].expand(-1, 1, hidden.shape[-1])
            out.append((hidden * keep).gather(1, index)[:, 0])
    return torch.cat(out, dim=-1)
