"""``psworker``: train a task against the shards and print one JSON line with the result."""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Sequence

from pswire.errors import PSError
from psworker.config import parse_args
from psworker.training import train

log = logging.getLogger("psworker")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s psworker[%(process)d] %(message)s",
    )
    # SIGTERM ends the run like Ctrl-C: the finally blocks close the channels.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        result = train(config)
    except KeyboardInterrupt:
        log.error("%s: interrupted", config.name)
        return 130
    except (PSError, ValueError, FloatingPointError) as exc:
        log.error("%s: %s", config.name, exc)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
