"""Prometheus metrics (prometheus-client), served over HTTP on ``--metrics-port``.

Two sources. Per call, the servicers count and time RPCs, tokens, time to first token and
the gaps between tokens. At scrape time, a collector reads the engine: health, model load
times, each warmup step's time and compile events, compile events before and after
SERVING (late compiles: the counter an alert watches), queue depth, batch sizes, rows in use
and the KV cache's use per model (what a gateway's endpoint picker reads: docs/scale-out.md),
and the boot id. Each service has its own registry (several services can live in one
process, as in the tests).

The sidecar exports nothing of its own: every step it drives, and every re-warm after a
restart, shows here as warmup-step metrics and a new boot id; its retries are in its log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from inference_svc.engine.core import Engine
    from inference_svc.engine.runtime import ModelRuntime

log = logging.getLogger(__name__)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class EngineCollector(Collector):
    """Reads the engine's state at scrape time."""

    def __init__(self, engine: Engine, serving: Callable[[], bool], version: str) -> None:
        self.engine = engine
        self.serving = serving
        self.version = version

    def collect(self) -> Iterator[object]:
        e = self.engine
        info = InfoMetricFamily(
            "inference_build", "The service's version and this process's boot id"
        )
        info.add_metric([], {"version": self.version, "boot_id": e.boot_id})
        yield info
        yield GaugeMetricFamily(
            "inference_health_serving",
            "1 while grpc.health.v1 says SERVING for inference.v1.Inference, else 0",
            value=1.0 if self.serving() else 0.0,
        )
        load = GaugeMetricFamily(
            "inference_model_load_seconds", "Model load time", labels=["model"]
        )
        for m in e.loaded:
            load.add_metric([m.name], m.seconds)
        yield load
        yield from self._warmup()
        yield from self._compiles()
        yield from self._workers()

    def _warmup(self) -> Iterator[object]:
        seconds = GaugeMetricFamily(
            "inference_warmup_step_seconds",
            "Time of each warmup step run",
            labels=["model", "step"],
        )
        events = GaugeMetricFamily(
            "inference_warmup_step_compile_events",
            "Compile events each warmup step caused",
            labels=["model", "step"],
        )
        for r in self.engine.warmup_reports:
            if not r.skipped:
                seconds.add_metric([r.model, r.step.value], r.seconds)
                events.add_metric([r.model, r.step.value], r.compile_events)
        yield seconds
        yield events

    def _compiles(self) -> Iterator[object]:
        mon = self.engine.monitor
        total = CounterMetricFamily(
            "inference_compile_events",
            "torch.compile events, before and after the service was marked SERVING",
            labels=["when"],
        )
        total.add_metric(["before_serving"], mon.total - mon.late)
        total.add_metric(["after_serving"], mon.late)
        yield total
        late = CounterMetricFamily(
            "inference_late_compile_events",
            "Compiles after SERVING, per model: a cold path reached a request (alert on > 0)",
            labels=["model"],
        )
        for name in self.engine.runtimes:
            late.add_metric([name], mon.late_by_model[name])
        yield late

    def _workers(self) -> Iterator[object]:
        depth = GaugeMetricFamily(
            "inference_queue_depth", "Requests waiting for their model", labels=["model"]
        )
        rows = GaugeMetricFamily(
            "inference_rows_in_use",
            "Rows of the batch running now (Generate: KV-cache rows in use)",
            labels=["model"],
        )
        batches = CounterMetricFamily(
            "inference_batches", "Batches run, by their rows", labels=["model", "rows"]
        )
        chunks = CounterMetricFamily(
            "inference_prefill_chunks",
            "Generate prefill chunks run, by their padded width in tokens (narrower while "
            "streams decode: --prefill-stall-steps)",
            labels=["model", "tokens"],
        )
        kv = GaugeMetricFamily(
            "inference_kv_cache_tokens", "Tokens the KV cache holds (0: none yet)", labels=["model"]
        )
        usage = GaugeMetricFamily(
            "inference_kv_cache_usage_ratio",
            "Share of the KV cache held by running sequences, 0 to 1: each holds a row of "
            "max input + max new tokens (1: a new Generate waits for a row)",
            labels=["model"],
        )
        for name, runtime in self.engine.runtimes.items():
            worker = runtime.inbox
            depth.add_metric([name], worker.depth())
            rows.add_metric([name], worker.rows_in_use)
            for n, count in sorted(worker.batches_by_rows.items()):
                batches.add_metric([name, str(n)], count)
            for n, count in sorted(worker.chunks_by_tokens.items()):
                chunks.add_metric([name, str(n)], count)
            if runtime.kv_cache_tokens or runtime.profile().has_kv_cache:
                kv.add_metric([name], runtime.kv_cache_tokens)
                usage.add_metric([name], kv_cache_usage(runtime, worker.rows_in_use))
        yield from (depth, rows, batches, chunks, kv, usage)


def kv_cache_usage(runtime: ModelRuntime, rows_in_use: int) -> float:
    """Rows in use times a row's slots over the cache's slots (0 before it is sized)."""
    total = runtime.kv_cache_tokens
    if not total:
        return 0.0
    return min(1.0, rows_in_use * runtime.limits.max_seq_len / total)


class Metrics:
    """The service's registry, the per-call metrics, and the HTTP endpoint."""

    def __init__(self, engine: Engine, serving: Callable[[], bool], version: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "inference_requests",
            "RPCs answered, by method and status code",
            ["rpc", "code"],
            registry=r,
        )
        self.latency = Histogram(
            "inference_request_duration_seconds",
            "Time to answer an RPC (a stream: until its last chunk)",
            ["rpc"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "inference_time_to_first_token_seconds",
            "Generate: from the call to its first token",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "inference_inter_token_latency_seconds",
            "Generate: between two tokens of one stream",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "inference_tokens",
            "Tokens in (prompt) and out (completion), per model",
            ["model", "direction"],
            registry=r,
        )
        self.in_flight = Gauge(
            "inference_requests_in_flight",
            "RPCs begun and not yet answered, by method",
            ["rpc"],
            registry=r,
        )
        self.calls_in_flight = 0  # all methods: what a stopping service waits for
        r.register(EngineCollector(engine, serving, version))
        self._server: object | None = None
        self.port = 0

    def begin_call(self, rpc: str) -> None:
        self.calls_in_flight += 1
        self.in_flight.labels(rpc).inc()

    def observe_call(self, rpc: str, code: str, seconds: float) -> None:
        """A call answered with ``code`` (it was begun with ``begin_call``)."""
        self.calls_in_flight -= 1
        self.in_flight.labels(rpc).dec()
        self.requests.labels(rpc, code).inc()
        self.latency.labels(rpc).observe(seconds)

    def observe_tokens(self, model: str, prompt: int, completion: int) -> None:
        self.tokens.labels(model, "prompt").inc(prompt)
        if completion:
            self.tokens.labels(model, "completion").inc(completion)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP; returns the port (0 picks a free one)."""
        server, _thread = start_http_server(port, host, registry=self.registry)
        self._server = server
        self.port = server.server_port
        log.info("metrics: http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server.server_close()  # type: ignore[attr-defined]
            self._server = None
