"""Service tier: ``psctl health`` against real shards on port 0, as a container's HEALTHCHECK
runs it: exit 0 only when every shard says SERVING, one line per shard naming the address and
the status or why it could not be reached, within its timeout, with no token and over TLS."""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import time

import pytest
from grpc_health.v1 import health_pb2

from pswire.security import make_dev_pki, write_private_file
from psworker import ctl
from tests.conftest import ROOT, child_env
from tests.service.shard_harness import started_shards

pytestmark = pytest.mark.timeout(120)

SLACK = 5.0
"""Seconds a psctl process may take beyond its --timeout: starting Python and exiting, on a busy machine."""


def _psctl(*argv: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """``psctl ARGV`` in its own process, and the seconds it took."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "psworker.ctl", *argv], capture_output=True, text=True, timeout=60,
                          env=dict(child_env(), **(env or {})), cwd=ROOT)
    return done, time.monotonic() - started


def _refusing() -> socket.socket:
    """Bound to a loopback port but not listening: a connection there is refused, and no other
    process can take the port while it is held."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def _address(sock: socket.socket) -> str:
    return f"127.0.0.1:{sock.getsockname()[1]}"


def test_serving_shards_exit_0_with_a_line_each(shards):
    a, b = shards(2)
    done, _ = _psctl("health", "--ps", f"{a.address},{b.address}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [f"{a.address}: SERVING", f"{b.address}: SERVING"]
    assert done.stderr == ""


def test_a_shard_nobody_listens_for_fails_at_once_naming_it(shards):
    (up,) = shards(1)
    with _refusing() as held:
        down = _address(held)
        done, took = _psctl("health", "--ps", f"{up.address},{down}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [f"{up.address}: SERVING", f"{down}: UNREACHABLE: connection refused"]
    assert took < 3.0 + SLACK  # the default timeout, not waited out: a refusal is an answer
    assert "Traceback" not in done.stderr


def test_a_shard_that_never_answers_is_given_up_on_at_the_timeout():
    """A listener that never speaks gRPC (a hung process, a wrong port): one check, not retried."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = _address(silent)
        done, took = _psctl("health", "--ps", address, "--timeout", "1", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    assert json.loads(done.stdout) == [
        {"address": address, "status": "UNREACHABLE", "serving": False, "reason": "no answer within 1s"},
    ]
    assert 1.0 <= took < 1.0 + SLACK


def test_health_needs_no_token_where_every_other_call_does(shards, tmp_path):
    token = secrets.token_urlsafe(32)
    write_private_file(tmp_path / "tokens", f"admin {token}\n".encode())
    (shard,) = shards(1, "--auth-token-file", str(tmp_path / "tokens"))
    refused, _ = _psctl("status", "--ps", shard.address)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    # No token, and a malformed one in the environment is not even read.
    done, _ = _psctl("health", "--ps", shard.address, env={"PSGRPC_TOKEN": "short"})
    assert done.returncode == 0 and done.stdout == f"{shard.address}: SERVING\n", done.stdout + done.stderr


def test_a_tls_shard_answers_over_tls_and_says_what_to_give_without(shards, tmp_path):
    pki = make_dev_pki(tmp_path / "tls", ["127.0.0.1"])
    (shard,) = shards(1, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    done, _ = _psctl("health", "--ps", shard.address, "--tls-ca", str(pki.ca))
    assert done.returncode == 0 and done.stdout == f"{shard.address}: SERVING\n", done.stdout + done.stderr
    plain, took = _psctl("health", "--ps", shard.address)
    assert plain.returncode == 1, plain.stdout + plain.stderr
    assert plain.stdout.startswith(f"{shard.address}: UNREACHABLE: ") and "give --tls-ca" in plain.stdout, plain.stdout
    assert took < 3.0 + SLACK


def test_a_mutual_tls_shard_answers_a_client_with_a_certificate(shards, tmp_path):
    pki = make_dev_pki(tmp_path / "tls", ["127.0.0.1"])
    (shard,) = shards(1, *pki.shard_flags())
    done, _ = _psctl("health", "--ps", shard.address, *pki.client_flags())
    assert done.returncode == 0 and done.stdout == f"{shard.address}: SERVING\n", done.stdout + done.stderr
    refused, _ = _psctl("health", "--ps", shard.address, "--tls-ca", str(pki.ca))
    assert refused.returncode == 1 and "give --tls-cert/--tls-key" in refused.stdout, refused.stdout


def test_a_shard_that_is_not_serving_fails_the_check(capsys):
    with started_shards() as make_shard:
        shard = make_shard()
        assert ctl.main(["health", "--ps", shard.address]) == 0
        assert capsys.readouterr().out == f"{shard.address}: SERVING\n"
        shard.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # as a shard does on its way down
        assert ctl.main(["health", "--ps", shard.address, "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == [
        {"address": shard.address, "status": "NOT_SERVING", "serving": False, "reason": ""},
    ]


@pytest.mark.parametrize("argv, message", [
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--token-file", "x"], "unrecognized arguments: --token-file"),
])
def test_bad_flags_are_refused_before_any_call(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        ctl.main(["health", "--ps", "127.0.0.1:1", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err
