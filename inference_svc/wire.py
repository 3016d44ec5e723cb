"""Protobuf <-> the engine's domain types: the service's only module that touches messages.

Requests are decoded into domain params, every field checked against the limits the
engine exposes (InvalidArgument names the field and the limit); every reply is encoded
here. Admin messages go through the contract's one conversion (inference_api.convert),
whose ConversionError is answered as INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from inference_api import convert
from inference_api.names import ADMIN_SERVICE, INFERENCE_SERVICE
from inference_api.plan import Step
from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from inference_svc.engine.runtime import StepReport
from inference_svc.engine.types import (
    CHAT_ROLES,
    DEFAULT_MAX_TOKENS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    EmbedParams,
    EmbedResult,
    FinishReason,
    GenChunk,
    GenerateParams,
    RuntimeInfo,
    TokenLogprob,
)
from inference_svc.errors import InvalidArgument
from inference_svc.limits import MAX_TEXT_CHARS, EmbedLimits, GenLimits
from inference_svc.sampling import MAX_LOGPROBS

if TYPE_CHECKING:
    from inference_svc.engine.core import Engine

log = logging.getLogger(__name__)
M = TypeVar("M")

HEALTH_SERVING = health_pb2.HealthCheckResponse.SERVING
HEALTH_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
PUBLIC_SERVICES = (INFERENCE_SERVICE, HEALTH_SERVICE)
FINISH_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
}


# -- registering servicers: requests decoded here, not by grpc ----------------------------
@dataclass(frozen=True)
class Undecodable:
    """What arrived instead of a request that does not parse (truncated, corrupt, bad UTF-8)."""

    type_name: str
    size: int
    error: str


def _deserializer(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError) as e:  # never raise here: grpc would answer UNKNOWN
            return Undecodable(cls.DESCRIPTOR.full_name, len(data), str(e) or type(e).__name__)

    return parse


def decoded(request: Any) -> Any:
    """The request, or InvalidArgument naming the message type when it did not parse."""
    if isinstance(request, Undecodable):
        log.info("undecodable %s (%d bytes): %s", request.type_name, request.size, request.error)
        raise InvalidArgument(
            f"request: {request.size} bytes are not a valid {request.type_name} ({request.error})"
        )
    return request


def add_servicer(server: grpc.aio.Server, service: str, servicer: object) -> None:
    """Register ``servicer``'s methods for ``service`` (e.g. inference.v1.Inference), with
    deserializers that never fail: an undecodable request reaches the servicer as
    Undecodable, which ``decoded`` answers with INVALID_ARGUMENT."""
    files = {INFERENCE_SERVICE: pb.DESCRIPTOR, ADMIN_SERVICE: apb.DESCRIPTOR}
    desc = files[service].services_by_name[service.rsplit(".", 1)[1]]
    handlers = {}
    for m in desc.methods:
        make = grpc.unary_stream_rpc_method_handler
        if not m.server_streaming:
            make = grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(
            getattr(servicer, m.name),
            request_deserializer=_deserializer(message_factory.GetMessageClass(m.input_type)),
            response_serializer=message_factory.GetMessageClass(m.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def quote(value: str, limit: int = 40) -> str:
    """A client's value for an error message: whole when short, else a prefix and the length."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def _check_text(field: str, text: str) -> None:
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidArgument(
            f"{field}: {len(text)} characters; the limit is {MAX_TEXT_CHARS} per text"
        )


# -- requests -------------------------------------------------------------------------
def embed_params(req: pb.EmbedRequest, limits: EmbedLimits) -> EmbedParams:
    n, most = len(req.inputs), limits.max_batch
    if n == 0:
        raise InvalidArgument(f"inputs: empty batch; give 1 to {most} strings")
    if n > most:
        raise InvalidArgument(
            f"inputs: {n} strings; the limit is {most} per call (--embed-max-batch)"
        )
    for i, text in enumerate(req.inputs):
        _check_text(f"inputs[{i}]", text)
        if not text.strip():
            raise InvalidArgument(f"inputs[{i}]: empty string")
    if req.dimensions > limits.dimensions:
        raise InvalidArgument(
            f"dimensions: {req.dimensions}; the model has {limits.dimensions} (0 keeps all)"
        )
    if req.prompt_name and req.prompt_name not in limits.prompt_names:
        raise InvalidArgument(
            f"prompt_name: {quote(req.prompt_name)}; the model declares "
            f"{', '.join(map(repr, limits.prompt_names)) or 'none'}"
        )
    normalize = req.normalize if req.HasField("normalize") else True
    return EmbedParams(tuple(req.inputs), normalize, req.truncate, req.dimensions, req.prompt_name)


def generate_params(req: pb.GenerateRequest, limits: GenLimits) -> GenerateParams:
    if req.prompt and req.messages:
        raise InvalidArgument("prompt and messages: give one of them, not both")
    if not req.prompt and not req.messages:
        raise InvalidArgument("prompt: empty; give a prompt or chat messages")
    _check_text("prompt", req.prompt)
    for i, m in enumerate(req.messages):
        _check_text(f"messages[{i}].content", m.content)
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"messages[{i}].role: {quote(m.role)}; expected one of {', '.join(CHAT_ROLES)}"
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
    if max_tokens > limits.max_new_tokens:
        raise InvalidArgument(
            f"sampling.max_tokens: {max_tokens}; the limit is {limits.max_new_tokens} "
            "(--max-new-tokens)"
        )
    if not 0 <= s.logprobs <= MAX_LOGPROBS:
        raise InvalidArgument(f"sampling.logprobs: {s.logprobs}; must be 0 to {MAX_LOGPROBS}")
    if len(s.stop) > MAX_STOP_STRINGS or any(not 0 < len(x) <= MAX_STOP_CHARS for x in s.stop):
        raise InvalidArgument(
            f"sampling.stop: at most {MAX_STOP_STRINGS} non-empty strings of at most "
            f"{MAX_STOP_CHARS} characters"
        )
    return GenerateParams(
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


def warmup_step(req: apb.WarmupRequest) -> Step:
    try:
        return convert.warmup_step_from_request(req)
    except convert.ConversionError as e:
        raise InvalidArgument(str(e)) from e


def reseed_value(req: apb.ReseedRequest) -> int | None:
    return req.seed if req.HasField("seed") else None


# -- replies ----------------------------------------------------------------------------
def embed_response(result: EmbedResult, model: str) -> pb.EmbedResponse:
    tokens = result.prompt_tokens
    return pb.EmbedResponse(
        embeddings=[pb.Embedding(values=v) for v in result.vectors],
        usage=pb.Usage(prompt_tokens=tokens, total_tokens=tokens),
        model=model,
    )


def _logprob(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        token=lp.token,
        logprob=lp.logprob,
        top=[pb.TopLogprob(token_id=i, token=t, logprob=v) for i, t, v in lp.top],
    )


def _usage(chunk: GenChunk) -> pb.Usage:
    total = chunk.prompt_tokens + chunk.completion_tokens
    return pb.Usage(
        prompt_tokens=chunk.prompt_tokens,
        completion_tokens=chunk.completion_tokens,
        total_tokens=total,
    )


def generate_chunk(chunk: GenChunk) -> pb.GenerateChunk:
    out = pb.GenerateChunk(
        text=chunk.text,
        token_ids=chunk.token_ids,
        logprobs=[_logprob(lp) for lp in chunk.logprobs],
    )
    if chunk.finish is not None:
        out.finish_reason = FINISH_PB[chunk.finish]
        out.usage.CopyFrom(_usage(chunk))
    return out


def generate_response(chunks: Sequence[GenChunk], model: str) -> pb.GenerateResponse:
    """The unary reply: every chunk of one generation, joined."""
    out = pb.GenerateResponse(
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        logprobs=[_logprob(lp) for c in chunks for lp in c.logprobs],
        model=model,
    )
    final = chunks[-1] if chunks else None
    if final is not None and final.finish is not None:
        out.finish_reason = FINISH_PB[final.finish]
        out.usage.CopyFrom(_usage(final))
    return out


def _message(cls: type[M], source: object, omit: tuple[str, ...] = (), **converted: Any) -> M:
    """A message from a dataclass: each field copied to the message's field of the same
    name, except those ``converted`` (given here) and those omitted."""
    plain = {
        f.name: getattr(source, f.name)
        for f in dataclasses.fields(source)  # type: ignore[arg-type]
        if f.name not in converted and f.name not in omit
    }
    return cls(**plain, **converted)


def _model_info(i: RuntimeInfo) -> pb.ModelInfo:
    mode = convert.to_pb(i.compilation_mode)
    return _message(pb.ModelInfo, i, kind=convert.to_pb(i.kind), compilation_mode=mode)


def info_response(engine: Engine, version: str) -> pb.InfoResponse:
    return pb.InfoResponse(
        models=[_model_info(i) for i in engine.infos()],
        compilation_mode=convert.to_pb(engine.config.compilation_mode),
        late_compile_events=engine.monitor.late,
        boot_id=engine.boot_id,
        serving=engine.gate.healthy,
        version=version,
    )


def describe_response(engine: Engine, version: str) -> apb.DescribeResponse:
    out = apb.DescribeResponse(
        boot_id=engine.boot_id,
        seed=engine.config.seed,
        serving=engine.gate.serving,
        models_loaded=engine.models_loaded,
        version=version,
    )
    if not engine.models_loaded:
        return out
    for runtime in engine.runtimes.values():
        compiled = sorted(runtime.compiled, key=lambda b: (b.phase.value, b.batch_size, b.seq_len))
        profile = convert.profile_to_pb(runtime.profile(), runtime.kv_cache_tokens, compiled)
        out.models.append(profile)
    planned = engine.plan()
    out.required_steps.extend(convert.step_to_pb(s, engine.gate.is_done(s)) for s in planned.steps)
    out.skipped_steps.extend(convert.step_to_pb(s) for s in planned.skipped)
    return out


def warmup_response(r: StepReport) -> apb.WarmupResponse:
    return _message(
        apb.WarmupResponse, r, omit=("buckets",),
        step=convert.to_pb(r.step),
        shapes=[convert.bucket_to_pb(b) for b in r.buckets],
        sampler_paths=[convert.to_pb(p) for p in r.sampler_paths],
    )  # fmt: skip


def reseed_response(seed: int) -> apb.ReseedResponse:
    return apb.ReseedResponse(seed=seed)


def mark_serving_response(boot_id: str) -> apb.MarkServingResponse:
    return apb.MarkServingResponse(serving=True, boot_id=boot_id)


def warm_messages() -> None:
    """Build, serialize and parse each message once: protobuf sets a message class up
    lazily on its first use, and that first use should not be a client's request."""
    samples = [
        pb.EmbedResponse(embeddings=[pb.Embedding(values=[0.5, 1.5])], usage=pb.Usage()),
        pb.GenerateResponse(token_ids=[1], logprobs=[pb.TokenLogprob(top=[pb.TopLogprob()])]),
        pb.GenerateChunk(token_ids=[1], logprobs=[pb.TokenLogprob(top=[pb.TopLogprob()])]),
        pb.EmbedRequest(inputs=["x"], normalize=True),
        pb.GenerateRequest(messages=[pb.ChatMessage()], sampling=pb.SamplingParams(seed=1)),
        pb.InfoResponse(models=[pb.ModelInfo()]),
    ]
    for msg in samples:
        type(msg).FromString(msg.SerializeToString())
