"""The sidecar's settings: parsed once, from flags and the environment, into a frozen Config.

Each setting is written once, as a `Config` field declared with `option()`: its default,
its help text, its choices and, for the few the deployments set that way, the environment
variable supplying its default (read only by parse_args, never at import time). The flags
are generated from the fields: field `step_timeout` is flag `--step-timeout`; a bool is a
switch (`--once`). The admin token is never a flag's value: `--admin-token-file` names a
file holding it, or WARMUP_CTL_ADMIN_TOKEN holds it.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_api import names

ENV_ADMIN = "WARMUP_CTL_ADMIN"
ENV_PUBLIC = "WARMUP_CTL_PUBLIC"
ENV_TOKEN = "WARMUP_CTL_ADMIN_TOKEN"
ENV_PUBLIC_TLS_CA = "WARMUP_CTL_PUBLIC_TLS_CA"
LOG_LEVELS = ("debug", "info", "warning", "error")
SECONDS = "S"  # the metavar of a duration


def option(
    default: Any,
    help: str,
    *,
    env: str | None = None,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    secret: bool = False,
) -> Any:
    """A `Config` field with its flag's help, metavar, choices and environment variable.

    A secret is kept out of repr and has no flag of its own: `--<name>-file` reads it.
    """
    meta = {"help": help, "env": env, "metavar": metavar, "choices": choices, "secret": secret}
    return dataclasses.field(default=default, repr=not secret, metadata=meta)


@dataclass(frozen=True)
class Config:
    # Loopback: the sidecar shares the service's network namespace.
    admin: str = option(
        f"{names.DEFAULT_ADMIN_HOST}:{names.DEFAULT_ADMIN_PORT}",
        "WarmupAdmin address, host:port",
        env=ENV_ADMIN,
    )
    public: str = option(
        f"127.0.0.1:{names.DEFAULT_PORT}",
        "public address, for the health check (after MarkServing) and the hint",
        env=ENV_PUBLIC,
    )
    once: bool = option(False, "warm once and exit: 0 SERVING, 1 failed (with the reason)")
    connect_timeout: float = option(
        900.0, "seconds to wait for the admin port and the models to load", metavar=SECONDS
    )
    # A cold compile of a real model on 2 CPU cores takes minutes per graph, and one COMPILE
    # step may compile several graphs.
    step_timeout: float = option(
        1800.0,
        "deadline of one warmup step (a cold compile takes minutes per graph)",
        metavar=SECONDS,
    )
    retries: int = option(
        3, "retries of a failed step (attempts = retries + 1), and of Reseed and MarkServing"
    )
    poll_interval: float = option(
        2.0, "seconds between Describe polls while watching for a restart", metavar=SECONDS
    )
    backoff_initial: float = option(
        0.5, "first wait between retries (doubles each retry)", metavar=SECONDS
    )
    backoff_max: float = option(5.0, "longest wait between retries", metavar=SECONDS)
    rpc_timeout: float = option(
        10.0, "deadline of Describe, Reseed, MarkServing and the health check", metavar=SECONDS
    )
    admin_token: str = option("", "the service's admin token", env=ENV_TOKEN, secret=True)
    # Paths to PEM files.
    public_tls_ca: str = option(
        "",
        "the public port speaks TLS: trust this CA bundle (none: plaintext)",
        env=ENV_PUBLIC_TLS_CA,
        metavar="FILE",
    )
    public_tls_cert: str = option(
        "", "client certificate, when the service requires one (mutual TLS)", metavar="FILE"
    )
    public_tls_key: str = option("", "client key (mutual TLS)", metavar="FILE")
    log_level: str = option("info", "log verbosity", choices=LOG_LEVELS)

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


def _flag(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-") + ("-file" if field.metadata["secret"] else "")


def _add(p: argparse.ArgumentParser, f: dataclasses.Field, kind: Any, environ: Mapping) -> None:
    """The field's flag; its default is its variable's value, else the field's default."""
    m = f.metadata
    if m["secret"]:  # the flag names a file; the variable holds the secret itself
        p.add_argument(
            _flag(f),
            metavar="FILE",
            help=f"file holding {m['help']} (or set {m['env']}; default: none)",
        )
        return
    shown = ("on" if f.default else "off") if kind is bool else (f.default or "none")
    env = f"; env {m['env']}" if m["env"] else ""
    text = f"{m['help']} (default: {shown}{env})".replace("%", "%%")
    if kind is bool:
        p.add_argument(_flag(f), action="store_true", help=text)
        return
    default = environ.get(m["env"], f.default) if m["env"] else f.default
    p.add_argument(
        _flag(f),
        type=kind,
        default=default,
        metavar=m["metavar"],
        choices=m["choices"],
        help=text,
    )


def _parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """warmup-ctl's flags, one per `Config` field; defaults from `environ`."""
    p = argparse.ArgumentParser(
        prog="warmup-ctl",
        description="Drives the warmup of inference-svc (the steps its Describe requires), "
        "reseeds it, marks it SERVING, then watches for a restart and does it again.",
    )
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        _add(p, f, hints[f.name], environ)
    return p


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
    a = vars(parser.parse_args(argv))
    try:
        values = {
            f.name: _token(a[f.name + "_file"], environ) if f.metadata["secret"] else a[f.name]
            for f in dataclasses.fields(Config)
        }
        return Config(**values)
    except ValueError as e:
        parser.error(str(e))
