"""A recording WarmupAdmin double: for the driver tests, and as a stand-in service process.

It records every call, injects failures on demand, and refuses MarkServing the way
DESIGN.md says the real service does. `python tests/warmup_fakes.py --port-file F` runs it as
a process (admin and health on one port) for the scripts/run.sh test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import uuid
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import inference_api
from inference_api import convert, plan
from inference_api.plan import (
    Bucket,
    CompilationMode,
    LogprobsMode,
    ModelKind,
    ModelProfile,
    Phase,
)
from inference_api.stubs.inference.v1 import admin_pb2, admin_pb2_grpc
from inference_svc.engine.gate import ServingGate
from inference_svc.errors import FailedPrecondition

MINILM = ModelProfile(
    "minilm", ModelKind.EMBEDDING, False, False, CompilationMode.DEFAULT,
    buckets=(Bucket(Phase.EMBED, 2, 16), Bucket(Phase.EMBED, 8, 64)),
)  # fmt: skip
SMOLLM = ModelProfile(
    "smollm2", ModelKind.GENERATIVE, True, False, CompilationMode.DEFAULT, LogprobsMode.RAW,
    buckets=(Bucket(Phase.PREFILL, 2, 16), Bucket(Phase.DECODE, 2, 1)),
)  # fmt: skip
PROFILES = (MINILM, SMOLLM)
# Warmup steps plan() gives PROFILES, in order.
EXPECTED = [
    ("COMPILE", "minilm"),
    ("PROFILE", "smollm2"),
    ("COMPILE", "smollm2"),
    ("SAMPLER", "smollm2"),
]
SEED = 4242


class FakeAdmin(admin_pb2_grpc.WarmupAdminServicer):
    """Records calls; fails steps on demand; refuses MarkServing like the real service."""

    def __init__(self, profiles: tuple[ModelProfile, ...] = PROFILES) -> None:
        self.boot_id = uuid.uuid4().hex[:8]
        self.profiles = profiles
        # Planned like the real service: Describe carries both lists and the version.
        planned = plan.plan(profiles)
        self.required = list(planned.steps)
        self.skipped = list(planned.skipped)
        self.version = inference_api.__version__
        self.calls: list[tuple[str, ...]] = []
        self.loading_polls = 0  # Describe answers models_loaded=false this many times
        self.failures: dict[tuple[str, str], int] = {}  # (step, model) -> failures left; -1 always
        self.fail_code = grpc.StatusCode.INTERNAL
        self.step_delay = 0.0
        self.gate = ServingGate()  # the real service's gate: its rules, no copy of them
        self.lose_mark_replies = 0  # MarkServing marks, then answers UNAVAILABLE this often
        self.health = health.aio.HealthServicer()
        self.describe_hook: Callable[[admin_pb2.DescribeResponse], None] = lambda resp: None

    @property
    def serving(self) -> bool:
        return self.gate.serving

    def serve_now(self) -> None:
        """Bring the gate to SERVING as a completed warmup would."""
        for step in self.required:
            self.gate.record_warmup(step)
        self.gate.record_reseed()
        self.gate.mark_serving(self.required)

    def warmups(self) -> list[tuple[str, str]]:
        return [(c[1], c[2]) for c in self.calls if c[0] == "Warmup"]

    def names(self) -> list[str]:
        return [c[0] for c in self.calls if c[0] != "Describe"]

    async def Describe(
        self, request: admin_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DescribeResponse:
        self.calls.append(("Describe",))
        loaded = self.loading_polls <= 0
        self.loading_polls -= 1
        required = [convert.step_to_pb(s, done=self.gate.is_done(s)) for s in self.required]
        resp = admin_pb2.DescribeResponse(
            boot_id=self.boot_id,
            models=[convert.profile_to_pb(p) for p in self.profiles] if loaded else [],
            required_steps=required if loaded else [],
            skipped_steps=[convert.step_to_pb(s) for s in self.skipped] if loaded else [],
            version=self.version,
            seed=SEED,
            serving=self.serving,
            models_loaded=loaded,
        )
        self.describe_hook(resp)
        return resp

    async def Warmup(
        self, request: admin_pb2.WarmupRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.WarmupResponse:
        key = (admin_pb2.WarmupStepKind.Name(request.step).split("_KIND_")[1], request.model)
        self.calls.append(("Warmup", *key))
        await asyncio.sleep(self.step_delay)
        left = self.failures.get(key, 0)
        if left:
            self.failures[key] = left - 1 if left > 0 else left
            await context.abort(self.fail_code, f"injected failure of {key[0]} {key[1]}")
        self.gate.invalidate_reseed()
        self.gate.record_warmup(convert.warmup_step_from_request(request))
        return admin_pb2.WarmupResponse(
            model=request.model, step=request.step, seconds=0.01, compile_events=1,
            sampler_paths=request.sampler_paths, detail="fake",
        )  # fmt: skip

    async def Reseed(
        self, request: admin_pb2.ReseedRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ReseedResponse:
        self.calls.append(("Reseed", str(request.seed)))
        try:
            self.gate.check_rewarm("Reseed", request.rewarm)
        except FailedPrecondition as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        self.gate.record_reseed()
        return admin_pb2.ReseedResponse(seed=request.seed)

    async def MarkServing(
        self, request: admin_pb2.MarkServingRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.MarkServingResponse:
        self.calls.append(("MarkServing",))
        try:  # the real service's gate: its rules, not a copy of them
            self.gate.check_rewarm("MarkServing", request.rewarm)
            self.gate.mark_serving(self.required)
        except FailedPrecondition as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        if self.lose_mark_replies > 0:  # marked, but the reply never reaches the caller
            self.lose_mark_replies -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: reply lost")
        return admin_pb2.MarkServingResponse(serving=True, boot_id=self.boot_id)


async def start(fake: FakeAdmin, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    admin_pb2_grpc.add_WarmupAdminServicer_to_server(fake, server)
    health_pb2_grpc.add_HealthServicer_to_server(fake.health, server)
    await fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def _serve(port_file: str) -> None:
    fake = FakeAdmin()
    server, port = await start(fake)
    with open(port_file + ".tmp", "w") as f:
        json.dump({"port": port, "admin_port": port, "pid": os.getpid()}, f)
    os.replace(port_file + ".tmp", port_file)
    print(f"fake service listening on {port}, boot {fake.boot_id}", flush=True)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopped.set)
    await stopped.wait()
    print("fake service stopping", flush=True)
    await server.stop(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    args, _ = parser.parse_known_args()
    asyncio.run(_serve(args.port_file))
