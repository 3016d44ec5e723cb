"""inference-cli against real grpc.aio servers on port 0.

Health runs against the stock grpc.health.v1 aio servicer with statuses the test
sets (the real protocol); embed/generate/info against a small real Inference
servicer that answers canned replies, or aborts with a status for error formatting.
The CLI is synchronous: it runs in a thread (or a subprocess) so the server's
event loop keeps answering.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inference_api.names import HEALTH_INFERENCE, HEALTH_LIVENESS, HEALTH_OVERALL
from inference_api.stubs.inference.v1 import inference_pb2, inference_pb2_grpc
from inference_cli import cli

pytestmark = pytest.mark.rpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class FakeInference(inference_pb2_grpc.InferenceServicer):
    """Canned replies; any input "fail" aborts with INVALID_ARGUMENT."""

    requests: list[object] = field(default_factory=list)

    async def Embed(self, request, context):
        self.requests.append(request)
        if "fail" in request.inputs:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "input 1 is empty")
        dims = request.dimensions or 10
        return inference_pb2.EmbedResponse(
            embeddings=[
                inference_pb2.Embedding(values=[0.1 * (i + 1)] * dims)
                for i, _ in enumerate(request.inputs)
            ],
            usage=inference_pb2.Usage(prompt_tokens=7, total_tokens=7),
            model="fake-embed",
        )

    async def Generate(self, request, context):
        self.requests.append(request)
        if request.prompt == "fail":
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "not warmed up yet: the service is NOT_SERVING"
            )
        return inference_pb2.GenerateResponse(
            text=" there once was",
            token_ids=[1, 2, 3],
            finish_reason=inference_pb2.FINISH_REASON_LENGTH,
            usage=inference_pb2.Usage(prompt_tokens=4, completion_tokens=3, total_tokens=7),
            model="fake-lm",
        )

    async def GenerateStream(self, request, context):
        self.requests.append(request)
        if request.prompt == "fail":
            yield inference_pb2.GenerateChunk(text=" half")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (64 waiting)")
        for i, piece in enumerate([" there", " once", " was"]):
            yield inference_pb2.GenerateChunk(text=piece, token_ids=[i + 1])
        yield inference_pb2.GenerateChunk(
            finish_reason=inference_pb2.FINISH_REASON_STOP,
            usage=inference_pb2.Usage(prompt_tokens=4, completion_tokens=3, total_tokens=7),
        )

    async def Info(self, request, context):
        return inference_pb2.InfoResponse(
            models=[
                inference_pb2.ModelInfo(name="fake-lm", kind=inference_pb2.MODEL_KIND_GENERATIVE)
            ],
            compilation_mode=inference_pb2.COMPILATION_MODE_DEFAULT,
            boot_id="b00t",
            serving=True,
            version="0.1.0",
        )


@dataclass
class Served:
    addr: str
    health: health.aio.HealthServicer
    fake: FakeInference


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[Served]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    fake = FakeInference()
    inference_pb2_grpc.add_InferenceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield Served(f"127.0.0.1:{port}", servicer, fake)
    await server.stop(None)


@pytest.fixture(scope="module")
async def bare_server() -> AsyncIterator[str]:
    """A gRPC server with no health service at all."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_cli(argv: Sequence[str]) -> int:
    return await asyncio.to_thread(cli.main, list(argv))


async def run_subprocess(argv: Sequence[str], env: dict[str, str] | None = None):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "inference_cli.cli", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode, out.decode(), err.decode()


# --- health ---------------------------------------------------------------------------


async def test_health_serving_exits_0(served: Served, capsys) -> None:
    await served.health.set(HEALTH_INFERENCE, SERVING)
    assert await run_cli(["health", "--addr", served.addr]) == cli.EXIT_OK
    assert capsys.readouterr().out.strip() == "status: SERVING"


async def test_health_not_serving_exits_4(served: Served, capsys) -> None:
    await served.health.set(HEALTH_INFERENCE, NOT_SERVING)
    await served.health.set(HEALTH_LIVENESS, SERVING)
    code = await run_cli(["health", "--addr", served.addr, "--service", HEALTH_INFERENCE])
    assert code == cli.EXIT_UNHEALTHY
    assert "NOT_SERVING" in capsys.readouterr().out
    # Another name on the same server answers for itself.
    assert await run_cli(["health", "--addr", served.addr, "--service", HEALTH_LIVENESS]) == 0


async def test_health_default_service_is_inference(served: Served) -> None:
    await served.health.set(HEALTH_OVERALL, SERVING)
    await served.health.set(HEALTH_INFERENCE, NOT_SERVING)
    assert await run_cli(["health", "--addr", served.addr]) == cli.EXIT_UNHEALTHY
    assert await run_cli(["health", "--addr", served.addr, "--service", ""]) == cli.EXIT_OK


async def test_health_unknown_service_is_rpc_failure(served: Served, capsys) -> None:
    code = await run_cli(["health", "--addr", served.addr, "--service", "no.such.Service"])
    assert code == cli.EXIT_RPC
    assert "error: NOT_FOUND" in capsys.readouterr().err


async def test_health_without_health_service_is_rpc_failure(bare_server: str, capsys) -> None:
    assert await run_cli(["health", "--addr", bare_server]) == cli.EXIT_RPC
    assert "error: UNIMPLEMENTED" in capsys.readouterr().err


async def test_health_closed_port_exits_2(capsys) -> None:
    addr = f"127.0.0.1:{closed_port()}"
    assert await run_cli(["health", "--addr", addr, "--timeout", "0.5"]) == cli.EXIT_CONNECT
    assert "cannot connect" in capsys.readouterr().err


async def test_health_wait_returns_when_serving(served: Served, capsys) -> None:
    await served.health.set(HEALTH_INFERENCE, NOT_SERVING)

    async def flip() -> None:
        await asyncio.sleep(1.0)
        await served.health.set(HEALTH_INFERENCE, SERVING)

    flipper = asyncio.create_task(flip())
    code = await run_cli(["health", "--addr", served.addr, "--wait", "--timeout", "20"])
    await flipper
    assert code == cli.EXIT_OK
    captured = capsys.readouterr()
    assert "status: NOT_SERVING" in captured.err  # what it waited on, said once
    assert captured.out.strip() == "status: SERVING"


async def test_health_wait_times_out_with_last_state(served: Served) -> None:
    await served.health.set(HEALTH_INFERENCE, NOT_SERVING)
    args = ["health", "--addr", served.addr, "--wait", "--timeout", "1.5"]
    assert await run_cli(args) == cli.EXIT_UNHEALTHY
    addr = f"127.0.0.1:{closed_port()}"
    assert await run_cli(["health", "--addr", addr, "--wait", "--timeout", "1"]) == 2


async def test_health_process_exit_codes_and_no_traceback(served: Served) -> None:
    """As a compose healthcheck runs it: a process, its exit code, its output."""
    await served.health.set(HEALTH_INFERENCE, SERVING)
    code, out, _ = await run_subprocess(["health"], env={cli.ADDR_ENV: served.addr})
    assert (code, out.strip()) == (0, "status: SERVING")
    addr = f"127.0.0.1:{closed_port()}"
    code, _, err = await run_subprocess(["health", "--addr", addr, "--timeout", "0.5"])
    assert code == cli.EXIT_CONNECT
    assert "Traceback" not in err
    code, _, err = await run_subprocess(["health", "--no-such-flag"])
    assert code == cli.EXIT_USAGE  # not 2, which would read as "cannot connect"


# --- embed ----------------------------------------------------------------------------


async def test_embed_prints_one_line_per_input(served: Served, capsys) -> None:
    argv = ["embed", "--addr", served.addr, "--dimensions", "3", "--no-normalize", "a", "b"]
    assert await run_cli(argv) == 0
    request = served.fake.requests[-1]
    assert list(request.inputs) == ["a", "b"]
    assert request.HasField("normalize") and request.normalize is False
    assert request.dimensions == 3
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("3 dims") and lines[0].endswith("'a'")


async def test_embed_json_is_the_reply(served: Served, capsys) -> None:
    assert await run_cli(["embed", "--addr", served.addr, "--json", "--truncate", "x"]) == 0
    assert served.fake.requests[-1].truncate is True
    assert served.fake.requests[-1].normalize is True  # the default is sent explicitly
    reply = json.loads(capsys.readouterr().out)
    assert reply["model"] == "fake-embed"
    assert len(reply["embeddings"][0]["values"]) == 10
    assert reply["usage"]["prompt_tokens"] == 7


async def test_embed_error_prints_status_not_traceback(served: Served, capsys) -> None:
    assert await run_cli(["embed", "--addr", served.addr, "ok", "fail"]) == cli.EXIT_RPC
    err = capsys.readouterr().err
    assert err.strip() == "error: INVALID_ARGUMENT: input 1 is empty"


# --- generate -------------------------------------------------------------------------


async def test_generate_sends_sampling_params(served: Served, capsys) -> None:
    argv = ["generate", "--addr", served.addr, "Once upon a time", "--seed", "7",
            "--temperature", "0.8", "--top-k", "40", "--top-p", "0.9", "--max-tokens", "3",
            "--stop", "\n", "--stop", "The end"]  # fmt: skip
    assert await run_cli(argv) == 0
    req = served.fake.requests[-1]
    assert req.prompt == "Once upon a time" and not req.messages
    s = req.sampling
    assert (s.seed, s.top_k, s.max_tokens, list(s.stop)) == (7, 40, 3, ["\n", "The end"])
    assert s.temperature == pytest.approx(0.8) and s.top_p == pytest.approx(0.9)
    captured = capsys.readouterr()
    assert captured.out == " there once was\n"
    assert "[finish: length, tokens: 4 prompt + 3 completion]" in captured.err


async def test_generate_unset_options_stay_unset(served: Served) -> None:
    assert await run_cli(["generate", "--addr", served.addr, "hi"]) == 0
    s = served.fake.requests[-1].sampling
    assert not s.HasField("seed") and not s.HasField("top_p") and not s.HasField("max_tokens")
    assert s.temperature == 0.0  # greedy


async def test_generate_chat_sends_messages(served: Served) -> None:
    argv = ["generate", "--addr", served.addr, "--chat", "--system", "Be brief.", "Hello"]
    assert await run_cli(argv) == 0
    req = served.fake.requests[-1]
    assert req.prompt == ""
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "Be brief."),
        ("user", "Hello"),
    ]
    assert await run_cli(["generate", "--addr", served.addr, "--system", "x", "Hi"]) == 1


async def test_generate_stream_prints_as_it_comes(served: Served, capsys) -> None:
    assert await run_cli(["generate", "--addr", served.addr, "--stream", "Once"]) == 0
    captured = capsys.readouterr()
    assert captured.out == " there once was\n"
    assert "[finish: stop," in captured.err


async def test_generate_stream_json_lines(served: Served, capsys) -> None:
    assert await run_cli(["generate", "--addr", served.addr, "--stream", "--json", "x"]) == 0
    chunks = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "".join(c["text"] for c in chunks) == " there once was"
    assert chunks[-1]["finish_reason"] == "FINISH_REASON_STOP"


async def test_generate_errors_print_status(served: Served, capsys) -> None:
    assert await run_cli(["generate", "--addr", served.addr, "fail"]) == cli.EXIT_RPC
    err = capsys.readouterr().err
    assert err.strip() == "error: UNAVAILABLE: not warmed up yet: the service is NOT_SERVING"
    assert await run_cli(["generate", "--addr", served.addr, "--stream", "fail"]) == 3
    captured = capsys.readouterr()
    assert captured.out == " half"  # what came before the error is kept
    assert captured.err.strip() == "error: RESOURCE_EXHAUSTED: queue full (64 waiting)"


async def test_generate_error_in_a_process_has_no_traceback(served: Served) -> None:
    code, _, err = await run_subprocess(["generate", "--addr", served.addr, "fail"])
    assert code == cli.EXIT_RPC
    assert err == "error: UNAVAILABLE: not warmed up yet: the service is NOT_SERVING\n"
    addr = f"127.0.0.1:{closed_port()}"
    code, _, err = await run_subprocess(["embed", "--addr", addr, "--timeout", "5", "x"])
    assert code == cli.EXIT_RPC
    assert err.startswith("error: UNAVAILABLE: ") and "Traceback" not in err


# --- info -----------------------------------------------------------------------------


async def test_info(served: Served, capsys) -> None:
    assert await run_cli(["info", "--addr", served.addr]) == 0
    out = capsys.readouterr().out
    assert "COMPILATION_MODE_DEFAULT" in out and "fake-lm: generative" in out
    assert await run_cli(["info", "--addr", served.addr, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["boot_id"] == "b00t"


async def test_cli_does_not_import_torch() -> None:
    """The healthcheck runs every few seconds: it must stay a light process."""
    code = "import sys, inference_cli.cli; sys.exit('torch' in sys.modules)"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
    assert await asyncio.wait_for(proc.wait(), timeout=60) == 0
