"""`warmup-ctl`: the warmup controller sidecar of inference-svc."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from warmup_ctl import driver
from warmup_ctl.config import Config, parse_args

log = logging.getLogger("warmup_ctl")


async def _serve(cfg: Config) -> int:
    """Runs the driver until it returns or SIGTERM/SIGINT arrives."""
    loop = asyncio.get_running_loop()
    runner = asyncio.create_task(driver.run(cfg))
    received: list[signal.Signals] = []

    def stop(sig: signal.Signals) -> None:
        received.append(sig)
        runner.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    try:
        return await runner
    except asyncio.CancelledError:
        if not received:
            raise
        # Nothing to undo: every step is idempotent and the service keeps its own health.
        if cfg.once:
            log.error("stopped by %s before SERVING", received[0].name)
            return 1
        log.info("stopped by %s", received[0].name)
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv, os.environ)
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s warmup-ctl %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    log.info(
        "admin %s, public %s, %s; step timeout %g s, %d retries, connect timeout %g s",
        cfg.admin,
        cfg.public,
        "once" if cfg.once else "watching",
        cfg.step_timeout,
        cfg.retries,
        cfg.connect_timeout,
    )
    return asyncio.run(_serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
