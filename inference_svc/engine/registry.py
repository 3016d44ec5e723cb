"""The kinds of model the service can load, in the order they load and warm.

A new kind is one module (a runtime implementing ``ModelRuntime`` and its
``ModelKindEntry``) and one line here; the engine, ``wire`` and the servicers route by
runtime name and RPC and need no change (tests/test_registry.py adds a kind that exists
only in the tests).
"""

from __future__ import annotations

from inference_svc.engine import embed_runtime, generate_runtime
from inference_svc.engine.runtime import ModelKindEntry

KINDS: tuple[ModelKindEntry, ...] = (embed_runtime.KIND, generate_runtime.KIND)
