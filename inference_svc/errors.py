"""Domain errors. The server maps each to one gRPC status code (server.STATUS_OF)."""

from __future__ import annotations


class ServiceError(Exception):
    """Base class: the message is what the client sees."""


class InvalidArgument(ServiceError):
    """The request is wrong; the message names the field and the limit."""


class Unavailable(ServiceError):
    """Not ready (warming up, shutting down, model not loaded yet): retry later."""


class FailedPrecondition(ServiceError):
    """The call is out of order (e.g. MarkServing before the warmup steps)."""


class ResourceExhausted(ServiceError):
    """The queue is full: back off and retry."""
