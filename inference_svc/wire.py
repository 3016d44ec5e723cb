"""Conversions between the engine's domain types and the protobuf messages."""

from __future__ import annotations

from inference_svc._pb.inference.v1 import admin_pb2 as apb
from inference_svc._pb.inference.v1 import inference_pb2 as pb
from inference_svc.engine.core import EMBED_NAME, LM_NAME, Engine
from inference_svc.engine.warmup import Bucket, StepReport
from inference_svc.errors import InvalidArgument
from warmup_ctl.plan import CompilationMode, LogprobsMode, ModelKind, SamplerPath, StepKind

MODE_PB = {
    CompilationMode.NONE: pb.COMPILATION_MODE_NONE,
    CompilationMode.DEFAULT: pb.COMPILATION_MODE_DEFAULT,
    CompilationMode.MAX_AUTOTUNE: pb.COMPILATION_MODE_MAX_AUTOTUNE,
}
KIND_PB = {
    ModelKind.EMBEDDING: pb.MODEL_KIND_EMBEDDING,
    ModelKind.GENERATIVE: pb.MODEL_KIND_GENERATIVE,
}
LOGPROBS_PB = {
    LogprobsMode.RAW: apb.LOGPROBS_MODE_RAW,
    LogprobsMode.PROCESSED: apb.LOGPROBS_MODE_PROCESSED,
}
STEP_PB = {
    StepKind.PROFILE: apb.WARMUP_STEP_KIND_PROFILE,
    StepKind.COMPILE: apb.WARMUP_STEP_KIND_COMPILE,
    StepKind.SAMPLER: apb.WARMUP_STEP_KIND_SAMPLER,
    StepKind.RESEED: apb.WARMUP_STEP_KIND_RESEED,
    StepKind.MARK_SERVING: apb.WARMUP_STEP_KIND_MARK_SERVING,
}
PATH_PB = {
    SamplerPath.GREEDY: apb.SAMPLER_PATH_GREEDY,
    SamplerPath.RANDOM: apb.SAMPLER_PATH_RANDOM,
    SamplerPath.SEEDED: apb.SAMPLER_PATH_SEEDED,
    SamplerPath.LOGPROBS: apb.SAMPLER_PATH_LOGPROBS,
}
PHASE_PB = {"embed": apb.PHASE_EMBED, "prefill": apb.PHASE_PREFILL, "decode": apb.PHASE_DECODE}


def step_from_pb(value: int) -> StepKind:
    for kind, v in STEP_PB.items():
        if v == value and kind in (StepKind.PROFILE, StepKind.COMPILE, StepKind.SAMPLER):
            return kind
    raise InvalidArgument(
        f"step: {apb.WarmupStepKind.Name(value) if value in STEP_PB.values() else value}; "
        "Warmup runs PROFILE, COMPILE or SAMPLER (Reseed and MarkServing are their own calls)"
    )


def sampler_path_from_pb(value: int) -> SamplerPath:
    for path, v in PATH_PB.items():
        if v == value:
            return path
    raise InvalidArgument(f"sampler_paths: unknown path {value}")


def bucket_pb(bucket: Bucket) -> apb.ShapeBucket:
    phase, batch, length = bucket
    return apb.ShapeBucket(phase=PHASE_PB[phase], batch_size=batch, seq_len=length)


def describe_pb(engine: Engine) -> apb.DescribeResponse:
    c = engine.config
    out = apb.DescribeResponse(
        boot_id=engine.boot_id,
        seed=c.seed,
        serving=engine.gate.serving,
        models_loaded=engine.models_loaded,
    )
    if not engine.models_loaded:
        return out
    for p in engine.profiles():
        has_kv = p.has_kv_cache
        sizing = apb.KV_CACHE_SIZING_NONE
        kv_tokens = 0
        if has_kv and engine.gen is not None:
            explicit = p.kv_cache_explicit
            sizing = apb.KV_CACHE_SIZING_EXPLICIT if explicit else apb.KV_CACHE_SIZING_AUTOMATIC
            kv_tokens = engine.gen.model.kv_cache_tokens
        out.models.append(
            apb.ModelProfile(
                name=p.name,
                kind=KIND_PB[p.kind],
                has_kv_cache=has_kv,
                kv_cache_sizing=sizing,
                kv_cache_tokens=kv_tokens,
                compilation_mode=MODE_PB[p.compilation_mode],
                logprobs_mode=LOGPROBS_PB[p.logprobs_mode],
                buckets=[bucket_pb(b) for b in p.buckets],
                compiled_buckets=[bucket_pb(b) for b in sorted(engine.compiled[p.name])],
            )
        )
    for step in engine.required_steps():
        out.required_steps.append(
            apb.PlannedStep(
                step=STEP_PB[step.kind],
                model=step.model,
                sampler_paths=[PATH_PB[x] for x in step.sampler_paths],
                reason=step.reason,
                done=engine.gate.is_done(step),
            )
        )
    return out


def warmup_report_pb(r: StepReport) -> apb.WarmupResponse:
    return apb.WarmupResponse(
        model=r.model,
        step=STEP_PB[r.step],
        skipped=r.skipped,
        skip_reason=r.skip_reason,
        shapes=[bucket_pb(b) for b in r.shapes],
        sampler_paths=[PATH_PB[p] for p in r.paths],
        seconds=r.seconds,
        compile_events=r.compile_events,
        kv_cache_tokens=r.kv_cache_tokens,
        detail=r.detail,
    )


def info_pb(engine: Engine, version: str) -> pb.InfoResponse:
    c = engine.config
    mon = engine.monitor
    out = pb.InfoResponse(
        compilation_mode=MODE_PB[c.compilation_mode],
        late_compile_events=mon.late,
        boot_id=engine.boot_id,
        serving=engine.gate.serving and not engine.gate.failed,
        version=version,
    )
    if engine.embed is not None:
        e = engine.embed.model
        out.models.append(
            pb.ModelInfo(
                name=engine.display_names[EMBED_NAME],
                kind=pb.MODEL_KIND_EMBEDDING,
                dimensions=e.dimensions,
                max_input_tokens=e.max_input_tokens,
                max_batch_size=e.max_batch,
                has_kv_cache=False,
                vocab_size=e.vocab_size,
                dtype=str(e.dtype).removeprefix("torch."),
                device=str(e.device),
                compilation_mode=MODE_PB[e.mode],
                late_compile_events=mon.late_by_model[EMBED_NAME],
            )
        )
    if engine.gen is not None:
        g = engine.gen.model
        out.models.append(
            pb.ModelInfo(
                name=engine.display_names[LM_NAME],
                kind=pb.MODEL_KIND_GENERATIVE,
                dimensions=g.lm.shape.hidden_size,
                max_input_tokens=g.limits.max_input_tokens,
                max_batch_size=max(g.cache_rows, 0) or g.limits.max_batch,
                max_new_tokens=g.limits.max_new_tokens,
                has_kv_cache=True,
                vocab_size=g.lm.shape.vocab_size,
                dtype=str(g.dtype).removeprefix("torch."),
                device=str(g.device),
                compilation_mode=MODE_PB[g.mode],
                late_compile_events=mon.late_by_model[LM_NAME],
            )
        )
    return out
