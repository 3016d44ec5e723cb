"""Domain types of the Inference API: validated requests and their results.

``wire`` decodes protobuf requests into these (checking every field against the
model's limits) and encodes the results; nothing below ``wire`` sees protobuf.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from inference_api.plan import CompilationMode, ModelKind

DEFAULT_MAX_TOKENS = 64
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256  # each stop string is matched against the text at every step
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class EmbedParams:
    inputs: tuple[str, ...]
    normalize: bool
    truncate: bool
    dimensions: int
    prompt_name: str = ""  # a prompt the model declares; "" = its default prompt, if any


@dataclass(frozen=True)
class EmbedResult:
    vectors: list[list[float]]
    prompt_tokens: int


@dataclass(frozen=True)
class GenerateParams:
    prompt: str
    messages: tuple[tuple[str, str], ...]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    logprobs: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...]


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # a stop string was produced
    EOS = "eos"  # the model's end-of-sequence token


@dataclass
class GenChunk:
    """What one decode step adds for one request; the last one has ``finish``."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class RuntimeInfo:
    """What Info says about one loaded model."""

    name: str  # the model's own name, e.g. "all-MiniLM-L6-v2"
    kind: ModelKind
    dimensions: int  # embedding width, or the hidden size
    max_input_tokens: int
    max_batch_size: int
    max_new_tokens: int  # 0 for embedding models
    has_kv_cache: bool
    vocab_size: int
    dtype: str
    device: str
    compilation_mode: CompilationMode
    late_compile_events: int
    prompt_names: tuple[str, ...] = ()  # Embed's prompt_name values (embedding models)
    default_prompt_name: str = ""  # the prompt applied when a request names none
