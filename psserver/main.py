"""``psserver``: run one shard until SIGTERM or Ctrl-C, then shut down gracefully."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence

from psserver.config import parse_args
from psserver.server import create_server


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s psserver[%(process)d] %(name)s: %(message)s",
    )
    try:
        shard = create_server(config)
    except (RuntimeError, ValueError) as exc:  # cannot bind or restore; a TLS or token file is unusable
        logging.getLogger("psserver").error("%s", exc)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(timeout=3600):
            pass
    finally:
        logging.getLogger("psserver").info("shutting down (grace %.1fs)", config.grace)
        shard.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
