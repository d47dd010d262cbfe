"""What a user sees when a process cannot start its work: a worker whose shard is not there says
at once what it connects to and for how long it will wait, soon why nothing answers, and at the
end gives up naming the address and the reason; a shard whose port is taken says which port in
one line, without gRPC's own stderr noise."""

from __future__ import annotations

import logging
import socket
import time
from datetime import datetime

import pytest

from pswire import errors
from psworker.shard import ClientOptions, ShardClient
from tests.conftest import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CONNECT_TIMEOUT = 5
"""--connect-timeout of the worker that finds nothing: long enough that its first report (after
about a second) comes before it gives up even when the machine is busy."""


def _refusing() -> socket.socket:
    """A socket bound to a loopback port but not listening: connections to the port are refused,
    and no other process can take the port while it is held."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def _at(line: str) -> datetime:
    """The time stamp a log line starts with (``2026-01-02 03:04:05,678``)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


def test_a_worker_says_what_it_waits_for_and_why_nothing_answers():
    with _refusing() as held:
        address = f"127.0.0.1:{held.getsockname()[1]}"
        proc = run_cli("psworker", "--ps", address, "--task", "linreg", "--connect-timeout", str(CONNECT_TIMEOUT),
                       timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    waiting = [n for n, line in enumerate(lines) if "connecting to shard" in line]
    refused = [n for n, line in enumerate(lines) if f"nothing answers at {address} (connection refused)" in line]
    failed = [n for n, line in enumerate(lines) if " ERROR " in line]
    assert len(waiting) == 1 and len(refused) == 1 and len(failed) == 1, proc.stderr
    (waiting,), (refused,), (failed,) = waiting, refused, failed
    assert address in lines[waiting] and f"up to {CONNECT_TIMEOUT}s" in lines[waiting]
    assert "is psserver running there?" in lines[refused]
    assert address in lines[failed] and "nothing answers" in lines[failed] and "connection refused" in lines[failed]
    assert "did not accept a connection" in lines[failed]  # what the message said before
    # Said in that order, and the wait announced when it began, not when it ended: the whole
    # connect timeout lies between the first line and the last.
    assert waiting < refused < failed
    assert (_at(lines[failed]) - _at(lines[waiting])).total_seconds() >= CONNECT_TIMEOUT - 0.5, proc.stderr


def test_a_shard_client_names_the_reason_it_cannot_connect(caplog):
    with _refusing() as held, caplog.at_level(logging.INFO, logger="psworker.channel"):
        address = f"127.0.0.1:{held.getsockname()[1]}"
        client = ShardClient(address, ClientOptions(connect_timeout=3))
        try:
            started = time.monotonic()
            with pytest.raises(errors.UnavailableError) as caught:
                client.wait_connected(3)
            waited = time.monotonic() - started
        finally:
            client.close()
    assert f"shard {address} did not accept a connection within 3s" in str(caught.value)
    assert "connection refused" in str(caught.value)
    assert 3 <= waited < 3 + 30  # the whole timeout (a shard may be starting), and no longer than load explains
    assert any(f"nothing answers at {address} (connection refused)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("flag", ["--port", "--bulk-port", "--metrics-port"])
def test_a_shard_on_a_taken_port_says_which_once(flag):
    with socket.create_server(("127.0.0.1", 0)) as holder:  # listening, as another server would
        port = holder.getsockname()[1]
        extra = [] if flag == "--port" else ["--port", "0"]
        proc = run_cli("psserver", *extra, flag, str(port), timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert output.count(f"port {port} is already in use") == 1, output
    assert flag in output and f"127.0.0.1:{port}" in output
    assert "GRPC_VERBOSITY" not in output and "add_port" not in output and "Traceback" not in output, output


def test_a_second_shard_on_the_port_of_a_running_one_says_so(shards):
    (first,) = shards(1)
    proc = run_cli("psserver", "--port", str(first.port), timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert output.count(f"port {first.port} is already in use") == 1, output
    assert "GRPC_VERBOSITY" not in output and "add_port" not in output, output
    assert first.popen.poll() is None  # the running shard is untouched


def test_a_shard_given_one_port_twice_says_so():
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]
    proc = run_cli("psserver", "--port", str(port), "--bulk-port", str(port), timeout=120)
    assert proc.returncode != 0 and f"--port and --bulk-port are both {port}" in proc.stderr, proc.stderr
