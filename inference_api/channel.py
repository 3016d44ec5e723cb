"""How a client opens a channel to the service: one gRPC service config for every client.

gRPC keeps one HTTP/2 connection per channel and sends every call over it. Behind a
ClusterIP Service that is one replica per client. To spread calls over the replicas, give
the channel every replica's address (``dns:///inference-svc-headless:50051``, a headless
Service, or ``ipv4:10.0.0.1:50051,10.0.0.2:50051``) and this config: ``round_robin``
keeps a connection to each address and picks the next one per call; the server's
``--max-connection-age`` makes the client resolve the name again now and then, so
replicas added since get their share.

Retries: Embed, Info and the health Check have no side effects, so a call answered
UNAVAILABLE (a replica stopping, or not warmed yet) or CANCELLED (a replica stopping cancels
a call it had received but not begun) is sent again, to the next replica.
Generate and GenerateStream are never retried by this config: a sampled completion sent
twice is two completions, and a stream may have delivered half its tokens. (gRPC's own
transparent retry still resends any call that never reached a server's application.)

Used by inference-cli, the README's Python example and the tests, with the interceptors of
inference_api/resets.py (a stream a proxy cut when its replica died ends UNAVAILABLE)::

    channel = intercept(grpc.insecure_channel(target, options=channel_options()))
"""

from __future__ import annotations

import json
from typing import Any

from inference_api.names import INFERENCE_SERVICE

HEALTH_SERVICE = "grpc.health.v1.Health"

# (service, method) pairs retried on UNAVAILABLE or CANCELLED: they change nothing on the server.
RETRIED_METHODS = (
    (INFERENCE_SERVICE, "Embed"),
    (INFERENCE_SERVICE, "Info"),
    (HEALTH_SERVICE, "Check"),
)
# Never retried: each attempt samples (and streams) a new completion.
NOT_RETRIED_METHODS = ((INFERENCE_SERVICE, "Generate"), (INFERENCE_SERVICE, "GenerateStream"))

# Four attempts: with round_robin each goes to the next connected replica, so one replica
# restarting costs a call one retry, and a fresh channel (a CLI run) whose first connected
# replicas are cold still reaches a warm one. Backoff 0.1, 0.2, 0.4 s (gRPC draws each wait
# at random up to that bound). A service down everywhere sees each call four times.
RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    # CANCELLED: grpc's graceful stop cancels the calls a replica had received but not yet
    # begun (measured, 32 Embed clients on one replica: 1-6 failed CANCELLED in 5 of 8
    # SIGTERMs; none in 8 once retried). A call the client cancels or times out is not retried.
    "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
}

# How soon a channel may resolve a ``dns:`` name again after its last resolution. gRPC asks
# again whenever a connection goes away (the server's --max-connection-age GOAWAY, a replica
# stopping or dying) but by default no sooner than 30 s after the last answer. A replica added
# to the name is resolved by the first GOAWAY after it is added (within the age) or, where
# that comes too soon, by this interval after the last resolution: so within max(age, this)
# of being added, whatever the server's age. 5 s keeps that within age + 5 s, and costs a
# client at most one A and one AAAA query per 5 s (only while connections turn over).
DNS_MIN_RESOLUTION_INTERVAL_S = 5

SERVICE_CONFIG: dict[str, Any] = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [
        {
            "name": [{"service": s, "method": m} for s, m in RETRIED_METHODS],
            "retryPolicy": RETRY_POLICY,
        },
        # Named so that no wider entry added later can give them a retry policy by mistake.
        {"name": [{"service": s, "method": m} for s, m in NOT_RETRIED_METHODS]},
    ],
}


def service_config_json() -> str:
    """SERVICE_CONFIG as the ``grpc.service_config`` channel argument takes it."""
    return json.dumps(SERVICE_CONFIG)


def channel_options(*extra: tuple[str, Any]) -> list[tuple[str, Any]]:
    """Channel arguments for a client of the service: the service config (never replaced by
    one a DNS TXT record might carry), retries on, a ``dns:`` name resolved again at most
    every DNS_MIN_RESOLUTION_INTERVAL_S. An ``extra`` argument of the same name replaces
    the default (gRPC itself keeps the first of two)."""
    options: dict[str, Any] = {
        "grpc.service_config": service_config_json(),
        "grpc.service_config_disable_resolution": 1,
        "grpc.enable_retries": 1,
        "grpc.dns_min_time_between_resolutions_ms": DNS_MIN_RESOLUTION_INTERVAL_S * 1000,
        **dict(extra),
    }
    return list(options.items())
