"""``psbench``: measure the parameter server against its limits on this machine, in one
invocation, on loopback. Prints a table and writes the results as JSON (``--out``).

Exit status: 0 when every section ran (whatever the checks say), 1 when a section failed (its
error is in the table and the JSON), 130 when interrupted. Every child process is stopped on
the way out, however the run ends.
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

log = logging.getLogger("psbench")


def main(argv: Sequence[str] | None = None) -> int:
    from psbench.config import parse_args

    config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s psbench: %(message)s")
    import torch  # after argument parsing: --help answers without loading torch

    from psbench.report import render, write_json
    from psbench.suite import run

    # This process drives the clients; it must not take more than its share of the cores.
    torch.set_num_threads(1)
    # SIGTERM ends the run like Ctrl-C, so the cleanup below and in the suite runs.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    plan = config.plan()
    if config.keep_logs:
        workdir = Path(config.keep_logs)
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="psbench-"))
    log.info("sections %s; child logs in %s", ", ".join(plan.sections), workdir)
    try:
        doc = run(plan, workdir)
    except KeyboardInterrupt:
        log.error("interrupted; every child process was stopped")
        return 130
    finally:
        if not config.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
    path = write_json(doc, config.out)
    print(render(doc), flush=True)
    log.info("results written to %s", path)
    return 1 if doc.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
