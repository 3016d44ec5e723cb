"""Domain types of the Inference API: validated requests and their results.

``from_pb`` checks every field and raises InvalidArgument with a message that
names the field and the limit; nothing below this layer sees protobuf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from inference_svc._pb.inference.v1 import inference_pb2 as pb
from inference_svc.errors import InvalidArgument
from inference_svc.sampling import MAX_LOGPROBS

DEFAULT_MAX_TOKENS = 64
MAX_STOP_STRINGS = 8
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class EmbedParams:
    inputs: tuple[str, ...]
    normalize: bool
    truncate: bool
    dimensions: int

    @classmethod
    def from_pb(cls, req: pb.EmbedRequest, max_batch: int) -> EmbedParams:
        n = len(req.inputs)
        if n == 0:
            raise InvalidArgument(f"inputs: empty batch; give 1 to {max_batch} strings")
        if n > max_batch:
            raise InvalidArgument(
                f"inputs: {n} strings; the limit is {max_batch} per call (--embed-max-batch)"
            )
        for i, text in enumerate(req.inputs):
            if not text.strip():
                raise InvalidArgument(f"inputs[{i}]: empty string")
        normalize = req.normalize if req.HasField("normalize") else True
        return cls(tuple(req.inputs), normalize, req.truncate, req.dimensions)


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

    @classmethod
    def from_pb(cls, req: pb.GenerateRequest, max_new_tokens: int) -> GenerateParams:
        if req.prompt and req.messages:
            raise InvalidArgument("prompt and messages: give one of them, not both")
        if not req.prompt and not req.messages:
            raise InvalidArgument("prompt: empty; give a prompt or chat messages")
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidArgument(
                    f"messages[{i}].role: {m.role!r}; expected one of {', '.join(CHAT_ROLES)}"
                )
        s = req.sampling
        if not math.isfinite(s.temperature) or s.temperature < 0:
            raise InvalidArgument(f"sampling.temperature: {s.temperature}; must be >= 0")
        top_p = s.top_p if s.HasField("top_p") else 1.0
        if not (0.0 < top_p <= 1.0):
            raise InvalidArgument(f"sampling.top_p: {top_p}; must be in (0, 1]")
        max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        if max_tokens <= 0:
            raise InvalidArgument(f"sampling.max_tokens: {max_tokens}; must be at least 1")
        if max_tokens > max_new_tokens:
            raise InvalidArgument(
                f"sampling.max_tokens: {max_tokens}; the limit is {max_new_tokens} "
                "(--max-new-tokens)"
            )
        if not 0 <= s.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"sampling.logprobs: {s.logprobs}; must be 0 to {MAX_LOGPROBS}")
        if len(s.stop) > MAX_STOP_STRINGS or any(not x for x in s.stop):
            raise InvalidArgument(f"sampling.stop: at most {MAX_STOP_STRINGS} non-empty strings")
        return cls(
            prompt=req.prompt,
            messages=tuple((m.role, m.content) for m in req.messages),
            temperature=float(s.temperature),
            top_k=int(s.top_k),
            top_p=float(top_p),
            seed=int(s.seed) if s.HasField("seed") else None,
            max_tokens=int(max_tokens),
            stop=tuple(s.stop),
            logprobs=int(s.logprobs),
        )


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...]

    def to_pb(self) -> pb.TokenLogprob:
        return pb.TokenLogprob(
            token_id=self.token_id,
            token=self.token,
            logprob=self.logprob,
            top=[pb.TopLogprob(token_id=i, token=t, logprob=lp) for i, t, lp in self.top],
        )


FINISH_PB = {
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "eos": pb.FINISH_REASON_EOS,
}


@dataclass
class GenChunk:
    """What one decode step adds for one request; the last one has ``finish``."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def usage_pb(self) -> pb.Usage:
        total = self.prompt_tokens + self.completion_tokens
        return pb.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=total,
        )

    def to_pb(self) -> pb.GenerateChunk:
        out = pb.GenerateChunk(
            text=self.text,
            token_ids=self.token_ids,
            logprobs=[lp.to_pb() for lp in self.logprobs],
        )
        if self.finish is not None:
            out.finish_reason = FINISH_PB[self.finish]
            out.usage.CopyFrom(self.usage_pb())
        return out
