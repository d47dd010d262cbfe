"""``psworker``: train a task against the shards and print one JSON line with the result; with
``--metrics-port``, serve its Prometheus metrics meanwhile (``psworker.metrics``)."""

from __future__ import annotations

import ipaddress
import json
import logging
import signal
import sys
import threading
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
    # SIGTERM ends the run like Ctrl-C: the finally blocks close the channels. With dynamic data
    # the first one stops at the end of the step in hand instead: the worker reports what it
    # trained, hands back the rest of its data and exits 0 (a second signal interrupts at once).
    stop = threading.Event() if config.dynamic else None
    signal.signal(signal.SIGTERM, _stopper(stop, config.name))
    if stop is not None:
        signal.signal(signal.SIGINT, _stopper(stop, config.name))
    server = None
    try:
        if config.metrics_port is not None:
            from psworker.metrics import serve  # loads prometheus_client only when asked to

            try:
                server = serve(config.metrics_host, config.metrics_port)
            except OSError as exc:
                log.error("%s: %s", config.name, exc)
                return 1
            log.info("metrics on %s", server.url)
            if not _loopback(config.metrics_host):
                log.warning("metrics on %s are served without TLS or tokens: anyone who reaches that port reads "
                            "them", server.url)
        result = train(config, registry=server.registry if server is not None else None, stop=stop)
    except KeyboardInterrupt:
        log.error("%s: interrupted", config.name)
        return 130
    except (PSError, ValueError, FloatingPointError) as exc:
        log.error("%s: %s", config.name, exc)
        return 1
    finally:
        if server is not None:
            server.close()
    print(json.dumps(result), flush=True)
    # Done and reported: a stop asked from now on (a scale-down that crossed the job's end) has
    # nothing left to stop, and must not turn this exit into a death by signal, which would lose
    # the result to whoever waits on the exit status.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0


def _stopper(stop: threading.Event | None, name: str):
    def handle(signum, frame) -> None:
        if stop is None or stop.is_set():
            raise KeyboardInterrupt
        log.info("%s: %s: stopping after this step, handing back the rest of its data (again to interrupt now)",
                 name, signal.Signals(signum).name)
        stop.set()

    return handle


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
