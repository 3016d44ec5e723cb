"""The sidecar's settings: parsed once, from flags and the environment, into a frozen Config.

Environment variables (read only by parse_args, never at import time):
  WARMUP_CTL_ADMIN   the service's admin address, host:port (the default for --admin)
  WARMUP_CTL_PUBLIC  the service's public address, host:port (the default for --public)
  WARMUP_CTL_PUBLIC_TLS_CA  CA bundle to trust when the public port speaks TLS
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from inference_api import names

ENV_ADMIN = "WARMUP_CTL_ADMIN"
ENV_PUBLIC = "WARMUP_CTL_PUBLIC"
ENV_TOKEN = "WARMUP_CTL_ADMIN_TOKEN"
ENV_PUBLIC_TLS_CA = "WARMUP_CTL_PUBLIC_TLS_CA"
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Config:
    # WarmupAdmin address (loopback: the sidecar shares the service's network namespace).
    admin: str = f"{names.DEFAULT_ADMIN_HOST}:{names.DEFAULT_ADMIN_PORT}"
    # Public address: checked with grpc.health.v1 after MarkServing, and shown to the operator.
    public: str = f"127.0.0.1:{names.DEFAULT_PORT}"
    # Warm once and exit: 0 once SERVING, 1 with the reason otherwise.
    once: bool = False
    # Seconds to wait for the admin port to answer and the models to load.
    connect_timeout: float = 900.0
    # Deadline of one Warmup call. A cold compile of a real model on 2 CPU cores takes
    # minutes per graph, and one COMPILE step may compile several graphs.
    step_timeout: float = 1800.0
    # Retries of a failed step (attempts = retries + 1), and of Reseed / MarkServing.
    retries: int = 3
    # Seconds between Describe polls while watching for a restart.
    poll_interval: float = 2.0
    # Exponential backoff between retries: first wait, and the cap.
    backoff_initial: float = 0.5
    backoff_max: float = 5.0
    # Deadline of Describe, Reseed, MarkServing and the health check.
    rpc_timeout: float = 10.0
    log_level: str = "info"
    # The service's admin token ("" = none): from --admin-token-file or WARMUP_CTL_ADMIN_TOKEN.
    admin_token: str = field(default="", repr=False)
    # The public port speaks TLS: the CA to trust ("" = plaintext), and a client certificate
    # and key when the service requires one (mutual TLS). Paths to PEM files.
    public_tls_ca: str = ""
    public_tls_cert: str = ""
    public_tls_key: str = ""

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "step_timeout", "poll_interval", "rpc_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if not 0 < self.backoff_initial <= self.backoff_max:
            raise ValueError(
                f"need 0 < backoff_initial <= backoff_max, got "
                f"{self.backoff_initial} and {self.backoff_max}"
            )
        if bool(self.public_tls_cert) != bool(self.public_tls_key):
            raise ValueError("--public-tls-cert and --public-tls-key go together")
        if self.public_tls_cert and not self.public_tls_ca:
            raise ValueError("--public-tls-cert needs --public-tls-ca")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log level {self.log_level!r}; expected one of {LOG_LEVELS}")


def _parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    d = Config()
    p = argparse.ArgumentParser(
        prog="warmup-ctl",
        description="Drives the warmup of inference-svc (the steps its Describe requires), "
        "reseeds it, marks it SERVING, then watches for a restart and does it again.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add(
        "--admin",
        default=environ.get(ENV_ADMIN, d.admin),
        help=f"WarmupAdmin address, host:port (env {ENV_ADMIN})",
    )
    add(
        "--public",
        default=environ.get(ENV_PUBLIC, d.public),
        help=f"public address, for the health check and the hint (env {ENV_PUBLIC})",
    )
    add("--once", action="store_true", help="warm once and exit: 0 SERVING, 1 failed")
    add(
        "--connect-timeout",
        type=float,
        default=d.connect_timeout,
        metavar="S",
        help="seconds to wait for the admin port and the models to load",
    )
    add(
        "--step-timeout",
        type=float,
        default=d.step_timeout,
        metavar="S",
        help="deadline of one warmup step (a cold compile takes minutes per graph)",
    )
    add("--retries", type=int, default=d.retries, help="retries of a failed step")
    add(
        "--poll-interval",
        type=float,
        default=d.poll_interval,
        metavar="S",
        help="seconds between Describe polls while watching for a restart",
    )
    add(
        "--backoff-initial",
        type=float,
        default=d.backoff_initial,
        metavar="S",
        help="first wait between retries (doubles each retry)",
    )
    add(
        "--backoff-max",
        type=float,
        default=d.backoff_max,
        metavar="S",
        help="longest wait between retries",
    )
    add(
        "--rpc-timeout",
        type=float,
        default=d.rpc_timeout,
        metavar="S",
        help="deadline of Describe, Reseed, MarkServing and the health check",
    )
    add(
        "--admin-token-file",
        metavar="FILE",
        help=f"file holding the service's admin token (or set {ENV_TOKEN}; default: none)",
    )
    add(
        "--public-tls-ca",
        default=environ.get(ENV_PUBLIC_TLS_CA, d.public_tls_ca),
        metavar="FILE",
        help=f"the public port speaks TLS: trust this CA bundle (env {ENV_PUBLIC_TLS_CA}; "
        "default: plaintext)",
    )
    add("--public-tls-cert", default="", metavar="FILE", help="client certificate (mutual TLS)")
    add("--public-tls-key", default="", metavar="FILE", help="client key (mutual TLS)")
    add("--log-level", default=d.log_level, choices=LOG_LEVELS, help="log verbosity")
    return p  # fmt: skip


def _token(path: str | None, environ: Mapping[str, str]) -> str:
    if not path:
        return environ.get(ENV_TOKEN, "").strip()
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"--admin-token-file: {e}") from e


def parse_args(argv: Sequence[str] | None, environ: Mapping[str, str]) -> Config:
    """Flags over environment over defaults; exits with a usage message on a bad value."""
    parser = _parser(environ)
    a = parser.parse_args(argv)
    try:
        return Config(
            admin=a.admin,
            public=a.public,
            once=a.once,
            connect_timeout=a.connect_timeout,
            step_timeout=a.step_timeout,
            retries=a.retries,
            poll_interval=a.poll_interval,
            backoff_initial=a.backoff_initial,
            backoff_max=a.backoff_max,
            rpc_timeout=a.rpc_timeout,
            log_level=a.log_level,
            public_tls_ca=a.public_tls_ca,
            public_tls_cert=a.public_tls_cert,
            public_tls_key=a.public_tls_key,
            admin_token=_token(a.admin_token_file, environ),
        )
    except ValueError as e:
        parser.error(str(e))
