"""Flags people can read: every flag of both programs says what it does in one line, with
its default (and, for the service, the environment variable that sets it). The service's
flags are generated from ServiceConfig's fields: one field, one flag, one variable."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from inference_api.plan import CompilationMode
from inference_svc.config import (
    ENV_PREFIX,
    LateCompilePolicy,
    ServiceConfig,
    build_parser,
    parse_config,
)
from warmup_ctl.config import Config as SidecarConfig
from warmup_ctl.config import _parser as sidecar_parser
from warmup_ctl.config import parse_args as sidecar_args

pytestmark = pytest.mark.unit


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_service_flag_says_what_it_does_its_default_and_its_variable() -> None:
    parser = build_parser({})
    for action in options(parser):
        env = ENV_PREFIX + action.dest.upper()
        assert action.help and "(default: " in action.help, action.dest
        assert f"env {env})" in action.help, action.dest
    text = parser.format_help()
    assert "INFERENCE_SVC_COMPILATION_MODE" in text and "INFERENCE_SVC_METRICS_PORT" in text
    assert "'inference-svc precompile [flags]'" in " ".join(text.split())


def test_every_field_has_a_flag_and_every_flag_a_field() -> None:
    flags = {a.option_strings[0] for a in options(build_parser({}))}
    fields = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(ServiceConfig)}
    # The admin token is never a flag's value (ps would show it): a file names it.
    assert flags == fields - {"--admin-token"} | {"--admin-token-file"}


# (field, variable's value, value it gives, flag's value, value it gives): one per kind.
KINDS = [
    ("max_queue", "7", 7, "9", 9),
    ("grace_period", "2.5", 2.5, "0.5", 0.5),
    ("compilation_mode", "default", CompilationMode.DEFAULT, "none", CompilationMode.NONE),
    ("on_late_compile", "fail", LateCompilePolicy.FAIL, "warn", LateCompilePolicy.WARN),
    ("freeze_weights", "on", True, "off", False),
    ("kv_cache_tokens", "192", 192, "", None),
    ("kv_cache_tokens", "", None, "64", 64),
    ("metrics_port", "9100", 9100, "0", 0),
    ("device", "cpu", "cpu", "cuda:1", "cuda:1"),
    ("dtype", "float16", "float16", "bfloat16", "bfloat16"),
    ("port_file", "/run/ports.json", "/run/ports.json", "", None),
]


@pytest.mark.parametrize(("name", "env_raw", "env_value", "flag_raw", "flag_value"), KINDS)
def test_the_environment_sets_a_default_and_a_flag_wins(
    name: str, env_raw: str, env_value: Any, flag_raw: str, flag_value: Any
) -> None:
    environ = {ENV_PREFIX + name.upper(): env_raw}
    flag = "--" + name.replace("_", "-")
    assert getattr(parse_config([], environ), name) == env_value
    assert getattr(parse_config([flag, flag_raw], environ), name) == flag_value
    assert getattr(parse_config([flag, flag_raw], {}), name) == flag_value


def test_without_flags_or_variables_every_field_keeps_its_default() -> None:
    assert parse_config([], {}) == ServiceConfig()


def test_the_process_environment_is_read_when_parsing(monkeypatch) -> None:
    monkeypatch.setenv("INFERENCE_SVC_MAX_QUEUE", "7")
    monkeypatch.setenv("INFERENCE_SVC_ON_LATE_COMPILE", "fail")
    c = parse_config([])
    assert c.max_queue == 7 and c.on_late_compile.value == "fail" and c.metrics_port is None
    assert parse_config(["--max-queue", "9"]).max_queue == 9


def fails(capsys, argv: list[str], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(SystemExit) as info:
        parse_config(argv, environ or {})
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--port", "x"], "argument --port: invalid int value: 'x'"),
        (["--grace-period", "soon"], "argument --grace-period: invalid float value"),
        (["--kv-cache-tokens", "many"], "argument --kv-cache-tokens: invalid int value"),
        (["--compilation-mode", "fast"], "argument --compilation-mode: invalid choice"),
        (["--freeze-weights", "yes"], "argument --freeze-weights: invalid choice"),
        (["--dtype", "int8"], "argument --dtype: invalid choice"),
    ],
)
def test_a_bad_flag_value_is_a_usage_error_naming_the_flag(capsys, argv, named) -> None:
    assert named in fails(capsys, argv)


def test_a_bad_variable_is_a_usage_error_naming_it(capsys) -> None:
    err = fails(capsys, [], {"INFERENCE_SVC_COMPILATION_MODE": "fast"})
    assert "INFERENCE_SVC_COMPILATION_MODE: invalid choice: 'fast'" in err
    assert "INFERENCE_SVC_FREEZE_WEIGHTS" in fails(
        capsys, [], {"INFERENCE_SVC_FREEZE_WEIGHTS": "1"}
    )
    assert "argument --port: invalid int" in fails(capsys, [], {"INFERENCE_SVC_PORT": "x"})
    # A flag replaces the variable, bad or not.
    assert parse_config(["--port", "5"], {"INFERENCE_SVC_PORT": "x"}).port == 5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gen-max-batch", "1"], "--gen-max-batch must be at least 2"),
        (["--embed-batch-wait-ms", "-1"], "--embed-batch-wait-ms must be 0 (off) or more"),
        (["--max-new-tokens", "0"], "--max-new-tokens at least 1"),
        (["--prefill-chunk-tokens", "8"], "--prefill-chunk-tokens must be at least 16"),
        (["--prefill-stall-steps", "-1"], "--prefill-stall-steps must be 0 (off) or more"),
        (["--kv-cache-memory-fraction", "1.5"], "--kv-cache-memory-fraction must be in (0, 1]"),
        (["--tls-cert-file", "c.pem"], "--tls-cert-file and --tls-key-file go together"),
        (["--tls-client-ca-file", "ca.pem"], "--tls-client-ca-file needs --tls-cert-file"),
        (["--admin-token-file", "/nonexistent/token"], "--admin-token-file: "),
    ],
)
def test_values_that_break_a_rule_are_usage_errors(capsys, argv, message) -> None:
    assert message in fails(capsys, argv)


def test_the_admin_token_comes_from_a_file_or_the_environment_and_stays_out_of_repr(
    tmp_path: Path,
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    env = {"INFERENCE_SVC_ADMIN_TOKEN": "from-the-env"}
    assert parse_config([], env).admin_token == "from-the-env"
    c = parse_config(["--admin-token-file", str(token_file)], env)
    assert c.admin_token == "from-the-file" and "from-the-file" not in repr(c)
    assert parse_config([], {"INFERENCE_SVC_ADMIN_TOKEN_FILE": str(token_file)}).admin_token
    assert parse_config([], {}).admin_token == ""


def test_every_sidecar_flag_says_what_it_does_and_its_default() -> None:
    parser = sidecar_parser({})
    for action in options(parser):
        assert action.help, action.dest
    assert "(default: " in parser.format_help()


def test_every_sidecar_field_has_a_flag_and_its_variable_is_named() -> None:
    parser = sidecar_parser({})
    flags = {a.option_strings[0]: a for a in options(parser)}
    for f in dataclasses.fields(SidecarConfig):
        flag = "--" + f.name.replace("_", "-") + ("-file" if f.metadata["secret"] else "")
        assert flag in flags, f.name
        if f.metadata["env"]:
            assert f.metadata["env"] in flags[flag].help, f.name
    assert len(flags) == len(dataclasses.fields(SidecarConfig))


def test_the_sidecar_environment_sets_a_default_and_a_flag_wins() -> None:
    env = {"WARMUP_CTL_PUBLIC": "10.0.0.2:1", "WARMUP_CTL_PUBLIC_TLS_CA": "ca.pem"}
    cfg = sidecar_args([], env)
    assert (cfg.public, cfg.public_tls_ca, cfg.once) == ("10.0.0.2:1", "ca.pem", False)
    cfg = sidecar_args(["--public", "h:2", "--public-tls-ca", "", "--once"], env)
    assert (cfg.public, cfg.public_tls_ca, cfg.once) == ("h:2", "", True)
    assert sidecar_args([], {}) == SidecarConfig()


def test_a_bad_sidecar_value_is_a_usage_error_naming_the_flag(capsys) -> None:
    for argv, named in [
        (["--retries", "x"], "argument --retries: invalid int value"),
        (["--log-level", "loud"], "argument --log-level: invalid choice"),
        (["--public-tls-cert", "c.pem"], "--public-tls-cert and --public-tls-key go together"),
    ]:
        with pytest.raises(SystemExit):
            sidecar_args(argv, {})
        assert named in capsys.readouterr().err
