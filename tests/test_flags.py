"""Flags people can read: every flag of both programs says what it does in one line, with
its default (and, for the service, the environment variable that sets it)."""

from __future__ import annotations

import argparse

from inference_svc.config import ENV_PREFIX, build_parser, parse_config
from warmup_ctl.config import _parser as sidecar_parser


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_service_flag_says_what_it_does_its_default_and_its_variable() -> None:
    parser = build_parser()
    for action in options(parser):
        env = ENV_PREFIX + action.dest.upper()
        assert action.help and "(default: " in action.help, action.dest
        assert f"env {env})" in action.help, action.dest
    text = parser.format_help()
    assert "INFERENCE_SVC_COMPILATION_MODE" in text and "INFERENCE_SVC_METRICS_PORT" in text


def test_every_sidecar_flag_says_what_it_does_and_its_default() -> None:
    parser = sidecar_parser({})
    for action in options(parser):
        assert action.help, action.dest
    assert "(default: " in parser.format_help()


def test_the_environment_sets_a_default_and_a_flag_wins(monkeypatch) -> None:
    monkeypatch.setenv("INFERENCE_SVC_MAX_QUEUE", "7")
    monkeypatch.setenv("INFERENCE_SVC_ON_LATE_COMPILE", "fail")
    c = parse_config([])
    assert c.max_queue == 7 and c.on_late_compile.value == "fail" and c.metrics_port is None
    assert parse_config(["--max-queue", "9"]).max_queue == 9
