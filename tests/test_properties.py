"""Property-based tests (hypothesis) against a real service process (tiny models, SERVING):
random field values built from the message descriptors, very short deadlines, streams
cancelled mid-way. Every answer is OK or a clear status that is never INTERNAL or UNKNOWN;
the process never dies; afterwards the next good request succeeds, health stays SERVING
and nothing is left behind (queue depth and rows in use back to 0)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from harness.procs import ServiceProc
from inference_api.stubs.inference.v1 import admin_pb2 as apb
from inference_api.stubs.inference.v1 import admin_pb2_grpc, inference_pb2_grpc
from inference_api.stubs.inference.v1 import inference_pb2 as pb
from tests.conftest import tiny_args

pytestmark = pytest.mark.proc

# Answers a random request may get: never INTERNAL, UNKNOWN or UNAVAILABLE.
ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}
F = FieldDescriptor
INTS = {
    F.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    F.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    F.TYPE_UINT32: st.integers(0, 2**32 - 1),
    F.TYPE_UINT64: st.integers(0, 2**64 - 1),
}
TEXT = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=40),  # control chars too
    st.sampled_from(["", " ", "\x00", "system", "user", "assistant", "\u2603" * 50]),
    st.integers(1_000, 120_000).map(lambda n: "word " * (n // 5)),  # up to past the limit
)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)


def value_of(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.type == F.TYPE_MESSAGE:
        return message_of(field.message_type, depth + 1)
    if field.type == F.TYPE_STRING:
        return TEXT
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return FLOATS
    if field.type == F.TYPE_ENUM:
        return st.integers(-3, 12)  # known and unknown values
    return INTS[field.type]


@st.composite
def _fill(draw, desc: Descriptor, depth: int) -> dict:
    out = {}
    for field in desc.fields:
        if depth > 2 or not draw(st.booleans()):
            continue
        one = value_of(field, depth)
        repeated = field.is_repeated
        out[field.name] = draw(st.lists(one, max_size=6) if repeated else one)
    return out


def message_of(desc: Descriptor, depth: int = 0) -> st.SearchStrategy:
    return _fill(desc, depth)


def request_of(cls: type) -> st.SearchStrategy:
    return message_of(cls.DESCRIPTOR).map(lambda fields: cls(**fields))


SHORT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30)
# Requests near the valid ones, so OK answers (and the model's paths) are fuzzed too.
NEAR_EMBED = st.builds(
    pb.EmbedRequest,
    inputs=st.lists(SHORT, min_size=1, max_size=5),
    normalize=st.booleans(),
    truncate=st.booleans(),
    dimensions=st.integers(0, 400),
)
NEAR_GENERATE = st.builds(
    pb.GenerateRequest,
    prompt=SHORT,
    sampling=st.builds(
        pb.SamplingParams,
        temperature=st.one_of(st.just(0.0), st.floats(0.0, 2.0), FLOATS),
        top_k=st.integers(0, 100),
        top_p=st.floats(0.01, 1.0),
        seed=st.integers(0, 2**64 - 1),
        max_tokens=st.integers(-2, 20),
        stop=st.lists(SHORT, max_size=3),
        logprobs=st.integers(-1, 21),
    ),
)
ANY_EMBED = st.one_of(request_of(pb.EmbedRequest), NEAR_EMBED)
ANY_GENERATE = st.one_of(request_of(pb.GenerateRequest), NEAR_GENERATE)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_embed_dir, tiny_lm_dir) -> Iterator[ServiceProc]:
    tmp: Path = tmp_path_factory.mktemp("properties")
    args = tiny_args(tiny_embed_dir, tiny_lm_dir, "--kv-cache-tokens", "192")
    svc = ServiceProc(tmp, [*args, "--metrics-port", "0", "--metrics-host", "127.0.0.1"])
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{svc.admin_port}")
        admin = admin_pb2_grpc.WarmupAdminStub(channel)
        while not admin.Describe(
            apb.DescribeRequest(), wait_for_ready=True, timeout=120
        ).models_loaded:
            time.sleep(0.2)
        admin.Reseed(apb.ReseedRequest(), timeout=30)  # explicit KV cache, mode none: no steps
        admin.MarkServing(apb.MarkServingRequest(), timeout=30)
        channel.close()
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def stub(served) -> Iterator[inference_pb2_grpc.InferenceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def check(call) -> None:
    try:
        call()
        event("OK")
    except grpc.RpcError as e:
        event(e.code().name)
        assert e.code() in ALLOWED, f"{e.code()}: {e.details()}"
        assert e.details() and len(e.details()) < 1000, e.details()


FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(request=ANY_EMBED)
def test_embed_answers_any_request_clearly(stub, request) -> None:
    check(lambda: stub.Embed(request, timeout=60))


@FUZZ
@given(request=ANY_GENERATE)
def test_generate_answers_any_request_clearly(stub, request) -> None:
    check(lambda: stub.Generate(request, timeout=60))


@FUZZ
@given(request=ANY_GENERATE)
def test_generate_stream_answers_any_request_clearly(stub, request) -> None:
    check(lambda: list(stub.GenerateStream(request, timeout=60)))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(seconds=st.floats(0.0005, 0.2), cancel_after=st.integers(0, 3))
def test_short_deadlines_and_cancelled_streams(stub, seconds, cancel_after) -> None:
    req = pb.GenerateRequest(prompt="count to ten", sampling=pb.SamplingParams(max_tokens=16))
    check(lambda: stub.Generate(req, timeout=seconds))
    check(lambda: stub.Embed(pb.EmbedRequest(inputs=["a text"] * 4), timeout=seconds))
    stream = stub.GenerateStream(req, timeout=60)
    for i, _chunk in enumerate(stream):
        if i >= cancel_after:
            stream.cancel()
            break


def gauge(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    lines = [
        ln for ln in text.splitlines() if ln.startswith(name + "{") or ln.startswith(name + " ")
    ]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def test_afterwards_the_service_is_whole(served, stub) -> None:
    """Runs after the fuzzing above (file order): alive, SERVING, nothing left behind."""
    assert served.popen.poll() is None, served.tail()
    reply = stub.Embed(pb.EmbedRequest(inputs=["still fine"]), timeout=30)
    assert len(reply.embeddings) == 1
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="inference.v1.Inference"))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    port = served.wait_ports()["metrics_port"]
    deadline = time.monotonic() + 30
    while gauge(port, "inference_queue_depth") or gauge(port, "inference_rows_in_use"):
        assert time.monotonic() < deadline, "requests left behind after their callers left"
        time.sleep(0.2)
    assert "Traceback" not in served.text()
