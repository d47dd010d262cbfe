"""The client's retry loop and how it reads gRPC's connection failures: an unreachable shard is
retried in attempts a couple of seconds apart for the whole budget, and the error it ends with
names the shard, the reason, since when and how many attempts; a shard's own UNAVAILABLE answers
("not initialised") are not taken for an unreachable shard. Also the shard's port check, which
must pass a port left in TIME_WAIT (a shard restarted on its port) and name a taken one."""

from __future__ import annotations

import re
import socket
import time

import grpc
import pytest

from pswire import errors
from psserver.server import bind_check
from psworker.retry import retrying, translate, unreachable
from psworker.shard import ClientOptions

pytestmark = pytest.mark.timeout(60)


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


REFUSED = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
           "Failed to connect to remote host: Connection refused")


@pytest.mark.parametrize(("details", "reason"), [
    (REFUSED, "connection refused"),
    ("errors resolving nosuch.invalid:7000: [field:hostname lookup error:address lookup failed for "
     "nosuch.invalid:7000: Domain name not found]", "its host name does not resolve"),
    ("Socket closed", "connection lost"),
    ("recvmsg:Connection reset by peer", "connection reset"),
    ("shard not initialised yet", None),  # the shard's own answers: it is reachable
    ("worker 'w' is held by a live registration until its lease expires", None),
])
def test_connection_failures_are_told_from_a_shards_own_unavailable(details, reason):
    assert unreachable(details) == reason
    error = translate(_RpcError(grpc.StatusCode.UNAVAILABLE, details), "h:1")
    assert isinstance(error, errors.UnavailableError)
    if reason is not None:
        assert str(error) == f"shard h:1 unreachable: {reason}"
    else:
        assert details in str(error)


def test_an_unreachable_shard_is_retried_for_the_budget_and_named_at_the_end():
    attempts = []

    def refused():
        attempts.append(time.monotonic())
        raise translate(_RpcError(grpc.StatusCode.UNAVAILABLE, REFUSED), "h:1")

    seen: list[str] = []
    started = time.monotonic()
    with pytest.raises(errors.UnavailableError) as caught:
        retrying(refused, ClientOptions(retry_timeout=3.0, on_retry=seen.append), "h:1", "push")
    took = time.monotonic() - started
    message = str(caught.value)
    assert re.fullmatch(r"shard h:1 unreachable: connection refused since \d\d:\d\d:\d\d; "
                        r"giving up on push after \d+s \(\d+ attempts\)", message), message
    assert f"({len(attempts)} attempts)" in message and len(attempts) >= 5
    assert len(seen) == len(attempts) - 1  # every retry reached the hook, the last failure is raised
    # The budget is spent (give or take one pause, at most 2 s), in pauses of at most 2 s.
    assert 1.0 <= took < 3.0 + 20, took
    assert max(b - a for a, b in zip(attempts, attempts[1:])) < 2.0 + 10


def test_a_port_left_in_time_wait_passes_the_check_and_a_taken_one_does_not():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=10)
        accepted, _ = listener.accept()
        with pytest.raises(RuntimeError, match=rf"^cannot bind 127\.0\.0\.1:{port}: port {port} is already in use"):
            bind_check("127.0.0.1", port, "--port")
        accepted.close()  # the server's side closes first: its end waits in TIME_WAIT
        client.close()
    bind_check("127.0.0.1", port, "--port")  # as gRPC (SO_REUSEADDR) would bind it again
