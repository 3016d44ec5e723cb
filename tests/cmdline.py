"""Reading flags out of the command lines that deploy files give a container."""

from __future__ import annotations


def flag(args: list[str], name: str) -> str:
    """The value of --name=V or --name V in a command line."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {args}")
