"""``inference-svc``: run the service until SIGTERM or Ctrl-C.

``inference-svc precompile [flags]`` fills --compile-cache-dir instead and exits
(inference_svc/precompile.py)."""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import signal
import sys
from collections.abc import Sequence

from inference_svc.config import ServiceConfig, parse_config

log = logging.getLogger("inference_svc")


# Exit status when the engine asks for a restart (kept artifacts broke a warmup step and
# were set aside): the supervisor's next start compiles without them.
EXIT_RESTART = 3


def import_frozen(module: str) -> None:
    """Import ``module`` (the service: torch, transformers, grpc, several hundred thousand
    objects that live as long as the process) with the cyclic collector off, then move what
    it made out of the collector's sight (``gc.freeze``). Imported with it on, a start ran
    five full collections over them on the way, 12 to 110 ms each, 0.3 s of a 4.6 s start
    in mode none, each finding 0 to 20 objects; and every later full collection (two while
    the models load, 0.15 and 0.18 s) scanned them again."""
    gc.disable()
    try:
        importlib.import_module(module)
    finally:
        gc.freeze()
        gc.enable()


async def serve(config: ServiceConfig) -> int:
    from inference_svc.app import Service

    service = Service(config)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    assert service.load_task is not None
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({service.load_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if service.load_task.done() and service.load_task.exception() is not None:
        exc = service.load_task.exception()
        log.error("loading the models failed: %s", exc, exc_info=exc)
        await service.stop(0)
        return 1
    restart = asyncio.create_task(service.restart_required.wait())
    await asyncio.wait({stopper, restart}, return_when=asyncio.FIRST_COMPLETED)
    await service.stop()
    if restart.done():
        log.error("stopping: this process must be restarted (see the error above)")
        return EXIT_RESTART
    restart.cancel()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args[:1] == ["precompile"] else "serve"
    config = parse_config(args)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import_frozen("inference_svc.precompile" if command == "precompile" else "inference_svc.app")
    if command == "precompile":
        from inference_svc.precompile import precompile

        return asyncio.run(precompile(config))
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
