"""inference-cli: a health probe and a small client for the service.

    inference-cli health [--addr TARGET] [--service NAME] [--wait] [--timeout S]
    inference-cli embed "some text" "more text" [--dimensions N] [--prompt-name NAME] [--json]
    inference-cli generate "Once upon a time" [--stream] [--seed N] [--temperature T] [--json]
    inference-cli info [--json]

``health`` uses the exit codes of the common gRPC health probe, so it can serve as
a compose healthcheck or a script's gate:

    0  SERVING
    1  bad arguments
    2  cannot connect
    3  the health RPC failed (timeout, UNIMPLEMENTED, unknown service name, ...)
    4  answered, but not SERVING

``embed``, ``generate`` and ``info`` exit 0 on success, 1 on bad arguments and 3
when the call fails, printing ``error: <STATUS_CODE>: <message>`` to stderr.
The address defaults to $INFERENCE_ADDR, else 127.0.0.1:50051. Any gRPC target works:
``dns:///inference-svc-headless:50051`` (every address the name resolves to) or
``ipv4:10.0.0.1:50051,10.0.0.2:50051``; calls are spread over them (round_robin) and Embed,
Info and health are retried on UNAVAILABLE and CANCELLED, Generate never (inference_api/channel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_api.channel import channel_options
from inference_api.names import DEFAULT_PORT, HEALTH_INFERENCE
from inference_api.resets import intercept
from inference_api.stubs.inference.v1 import inference_pb2, inference_pb2_grpc

EXIT_OK = 0
EXIT_USAGE = 1
EXIT_CONNECT = 2
EXIT_RPC = 3
EXIT_UNHEALTHY = 4

ADDR_ENV = "INFERENCE_ADDR"  # the service's address: HOST:PORT or any gRPC target
DEFAULT_ADDR = f"127.0.0.1:{DEFAULT_PORT}"
HEALTH_TIMEOUT_S = 2.0  # one health check: connect + call (the probe's default is 1 s)
WAIT_TIMEOUT_S = 900.0  # `health --wait`: long enough for a cold compile on 2 cores
WAIT_POLL_S = 0.5
CALL_TIMEOUT_S = 300.0  # embed / generate / info deadline
EMBED_PREVIEW = 4  # components shown at each end of a vector without --json


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 1, as the health probe's do: 2 means 'cannot connect'."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


class _UsageError(Exception):
    """A combination of flags argparse cannot reject by itself."""


def _fail(err: grpc.RpcError) -> int:
    code = err.code() if isinstance(err, grpc.Call) else None
    name = code.name if code is not None else "UNKNOWN"
    details = (err.details() if isinstance(err, grpc.Call) else None) or str(err)
    print(f"error: {name}: {details}", file=sys.stderr)
    return EXIT_RPC


def _to_dict(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


# --- health ---------------------------------------------------------------------------


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to --addr: plaintext, or TLS when --tls-ca is given (with a client
    certificate when --tls-cert and --tls-key are); round_robin over the addresses the
    target names, idempotent calls retried (inference_api/channel.py), a stream reset by a
    proxy ended UNAVAILABLE (inference_api/resets.py)."""
    if not args.tls_ca:
        return intercept(grpc.insecure_channel(args.addr, options=channel_options()))
    cert = Path(args.tls_cert).read_bytes() if args.tls_cert else None
    key = Path(args.tls_key).read_bytes() if args.tls_key else None
    creds = grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes(), key, cert)
    return intercept(grpc.secure_channel(args.addr, creds, options=channel_options()))


def _check_once(args: argparse.Namespace, timeout: float) -> tuple[int, str]:
    """One probe, as grpc-health-probe does it: connect, then Check. (exit code, message)."""
    addr, service = args.addr, args.service
    with open_channel(args) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            return EXIT_CONNECT, f"error: cannot connect to {addr} within {timeout:g}s"
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            code = err.code().name if isinstance(err, grpc.Call) else "UNKNOWN"
            details = err.details() if isinstance(err, grpc.Call) else str(err)
            return EXIT_RPC, f"error: {code}: health check of {service!r} failed: {details}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return EXIT_OK, f"status: {status}"
    return EXIT_UNHEALTHY, f"status: {status}"


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 only when `args.service` is SERVING; with --wait, poll until it is."""
    if not args.wait:
        timeout = args.timeout if args.timeout is not None else HEALTH_TIMEOUT_S
        code, message = _check_once(args, timeout)
        print(message, file=sys.stdout if code in (EXIT_OK, EXIT_UNHEALTHY) else sys.stderr)
        return code
    deadline = time.monotonic() + (args.timeout if args.timeout is not None else WAIT_TIMEOUT_S)
    last: str | None = None
    while True:
        remaining = deadline - time.monotonic()
        code, message = _check_once(args, max(0.1, min(2.0, remaining)))
        if code == EXIT_OK:
            print(message)
            return code
        if message != last:  # each change once, to stderr: stdout is for the result
            print(f"waiting for {args.service!r} at {args.addr}: {message}", file=sys.stderr)
            last = message
        if time.monotonic() + WAIT_POLL_S >= deadline:
            print(message, file=sys.stdout if code == EXIT_UNHEALTHY else sys.stderr)
            return code
        time.sleep(WAIT_POLL_S)


# --- embed ----------------------------------------------------------------------------


def _preview(values: Sequence[float]) -> str:
    if len(values) <= 2 * EMBED_PREVIEW:
        return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"
    head = ", ".join(f"{v:.4f}" for v in values[:EMBED_PREVIEW])
    tail = ", ".join(f"{v:.4f}" for v in values[-EMBED_PREVIEW:])
    return f"[{head}, ..., {tail}]"


def cmd_embed(args: argparse.Namespace) -> int:
    """Embed each TEXT and print one line per vector (or the reply as JSON)."""
    request = inference_pb2.EmbedRequest(
        inputs=args.texts,
        normalize=args.normalize,
        truncate=args.truncate,
        dimensions=args.dimensions,
        prompt_name=args.prompt_name,
    )
    with open_channel(args) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        reply = stub.Embed(request, timeout=args.timeout)
    if args.json:
        print(json.dumps(_to_dict(reply)))
        return EXIT_OK
    for text, emb in zip(args.texts, reply.embeddings, strict=False):
        norm = sum(v * v for v in emb.values) ** 0.5
        print(f"{len(emb.values)} dims, norm {norm:.4f}: {_preview(emb.values)}  {text!r}")
    print(f"model: {reply.model}, prompt tokens: {reply.usage.prompt_tokens}", file=sys.stderr)
    return EXIT_OK


# --- generate -------------------------------------------------------------------------


def _generate_request(args: argparse.Namespace) -> inference_pb2.GenerateRequest:
    sampling = inference_pb2.SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        stop=args.stop,
        logprobs=args.logprobs,
    )
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    if args.max_tokens is not None:
        sampling.max_tokens = args.max_tokens
    if args.chat:
        messages = [inference_pb2.ChatMessage(role="user", content=args.prompt)]
        if args.system:
            messages.insert(0, inference_pb2.ChatMessage(role="system", content=args.system))
        return inference_pb2.GenerateRequest(messages=messages, sampling=sampling)
    return inference_pb2.GenerateRequest(prompt=args.prompt, sampling=sampling)


def _summary(finish_reason: int, usage: inference_pb2.Usage) -> str:
    reason = inference_pb2.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_")
    return (
        f"[finish: {reason.lower()}, tokens: {usage.prompt_tokens} prompt"
        f" + {usage.completion_tokens} completion]"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate a completion; --stream prints the text as it comes."""
    if args.system and not args.chat:
        raise _UsageError("--system needs --chat")
    request = _generate_request(args)
    with open_channel(args) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        if not args.stream:
            reply = stub.Generate(request, timeout=args.timeout)
            if args.json:
                print(json.dumps(_to_dict(reply)))
            else:
                print(reply.text)
                print(_summary(reply.finish_reason, reply.usage), file=sys.stderr)
            return EXIT_OK
        last = None
        for chunk in stub.GenerateStream(request, timeout=args.timeout):
            if args.json:
                print(json.dumps(_to_dict(chunk)), flush=True)
            else:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            last = chunk
        if not args.json:
            sys.stdout.write("\n")
            if last is not None:
                print(_summary(last.finish_reason, last.usage), file=sys.stderr)
    return EXIT_OK


# --- info -----------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    """What is loaded, how it is compiled, and the late-compile count."""
    with open_channel(args) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        reply = stub.Info(inference_pb2.InfoRequest(), timeout=args.timeout)
    if args.json:
        print(json.dumps(_to_dict(reply)))
        return EXIT_OK
    mode = inference_pb2.CompilationMode.Name(reply.compilation_mode)
    print(f"version {reply.version}, boot {reply.boot_id}, serving: {reply.serving}")
    print(f"compilation: {mode}, late compile events: {reply.late_compile_events}")
    for m in reply.models:
        kind = inference_pb2.ModelKind.Name(m.kind).removeprefix("MODEL_KIND_").lower()
        print(
            f"  {m.name}: {kind}, {m.dimensions} dims, max input {m.max_input_tokens} tokens,"
            f" max batch {m.max_batch_size}, {m.dtype} on {m.device}"
        )
        if m.prompt_names:
            default = f" (default {m.default_prompt_name})" if m.default_prompt_name else ""
            print(f"    prompts: {', '.join(m.prompt_names)}{default}")
    return EXIT_OK


# --- parsing --------------------------------------------------------------------------


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of inference-cli."""
    parser = _Parser(prog="inference-cli", description=__doc__.split("\n")[0])
    common = _Parser(add_help=False)
    common.add_argument(
        "--addr",
        default=os.environ.get(ADDR_ENV) or DEFAULT_ADDR,
        help=f"HOST:PORT of the service, or a gRPC target (dns:///HOST:PORT, "
        f"ipv4:A:P,B:P) whose addresses calls are spread over (default ${ADDR_ENV} or "
        f"{DEFAULT_ADDR})",
    )
    common.add_argument(
        "--tls-ca",
        default=os.environ.get("INFERENCE_TLS_CA") or None,
        metavar="FILE",
        help="speak TLS, trusting this CA bundle (default $INFERENCE_TLS_CA; plaintext if unset)",
    )
    common.add_argument("--tls-cert", metavar="FILE", help="client certificate (mutual TLS)")
    common.add_argument("--tls-key", metavar="FILE", help="client key (mutual TLS)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    h = sub.add_parser("health", parents=[common], help="grpc.health.v1 probe (exit 0: SERVING)")
    h.add_argument("--service", default=HEALTH_INFERENCE, help="health name to check")
    h.add_argument("--wait", action="store_true", help="poll until SERVING or --timeout")
    h.add_argument(
        "--timeout",
        type=_positive_float,
        help=f"seconds: one check ({HEALTH_TIMEOUT_S:g}) or, with --wait, all ({WAIT_TIMEOUT_S:g})",
    )
    h.set_defaults(func=cmd_health)

    e = sub.add_parser("embed", parents=[common], help="embed one or more texts")
    e.add_argument("texts", nargs="+", metavar="TEXT")
    e.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--dimensions", type=int, default=0, help="keep the first N components")
    e.add_argument("--truncate", action="store_true", help="cut inputs over the limit")
    e.add_argument(
        "--prompt-name",
        default="",
        metavar="NAME",
        help="a prompt the model declares (e.g. query, document; `info` lists them); "
        "default: the model's default prompt, if any",
    )
    e.add_argument("--timeout", type=_positive_float, default=CALL_TIMEOUT_S)
    e.add_argument("--json", action="store_true", help="print the reply as JSON")
    e.set_defaults(func=cmd_embed)

    g = sub.add_parser("generate", parents=[common], help="generate a completion")
    g.add_argument("prompt", metavar="PROMPT")
    g.add_argument("--stream", action="store_true", help="print tokens as they come")
    g.add_argument("--chat", action="store_true", help="send PROMPT as a user chat message")
    g.add_argument("--system", help="a system message before PROMPT (with --chat)")
    g.add_argument("--seed", type=int, help="per-request seed: same seed, same tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float)
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--logprobs", type=int, default=0, help="top alternatives per token")
    g.add_argument("--timeout", type=_positive_float, default=CALL_TIMEOUT_S)
    g.add_argument("--json", action="store_true", help="print the reply (each chunk) as JSON")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", parents=[common], help="what is loaded and how it is compiled")
    i.add_argument("--timeout", type=_positive_float, default=CALL_TIMEOUT_S)
    i.add_argument("--json", action="store_true", help="print the reply as JSON")
    i.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `inference-cli` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except grpc.RpcError as err:
        return _fail(err)
    except _UsageError as err:
        parser.print_usage(sys.stderr)
        print(f"inference-cli: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `inference-cli generate --stream ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
