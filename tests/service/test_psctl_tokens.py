"""``psctl tokens``: the files it writes are the ones psserver and the clients read, mode 600; a
shard started on them checks them (psctl status answers with the reader token, not without);
``--keep`` leaves a complete set alone. Also: psctl status names a shard bound to every
interface (a container's 0.0.0.0) by the address it reached it at."""

from __future__ import annotations

import json
import stat

import pytest

from psserver.auth import Role, load_token_file
from pswire.security import read_token
from tests.conftest import run_cli

pytestmark = pytest.mark.timeout(120)


def _modes(directory) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}


def test_tokens_are_what_the_shard_and_the_clients_read(tmp_path):
    out = tmp_path / "secrets"
    result = run_cli("psworker.ctl", "tokens", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert _modes(out) == {"tokens": 0o600, "reader.token": 0o600, "worker.token": 0o600, "admin.token": 0o600}
    table = load_token_file(str(out / "tokens"))
    for role in Role:
        token = read_token(str(out / f"{role.label}.token"))
        assert table.role_of(token) is role
    assert len({read_token(str(out / f"{r.label}.token")) for r in Role}) == 3


def test_keep_leaves_a_complete_set_and_without_it_the_tokens_are_new(tmp_path):
    out = tmp_path / "secrets"
    assert run_cli("psworker.ctl", "tokens", "--out", str(out)).returncode == 0
    before = {p.name: p.read_text() for p in out.iterdir()}
    assert run_cli("psworker.ctl", "tokens", "--out", str(out), "--keep").returncode == 0
    assert {p.name: p.read_text() for p in out.iterdir()} == before
    (out / "admin.token").unlink()  # an incomplete set is written afresh, whole
    assert run_cli("psworker.ctl", "tokens", "--out", str(out), "--keep").returncode == 0
    after = {p.name: p.read_text() for p in out.iterdir()}
    assert after.keys() == before.keys() and after["tokens"] != before["tokens"]
    assert run_cli("psworker.ctl", "tokens", "--out", str(out)).returncode == 0
    assert (out / "tokens").read_text() != after["tokens"]


def test_an_unwritable_directory_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = run_cli("psworker.ctl", "tokens", "--out", str(blocker / "sub"))
    assert result.returncode == 1 and "psctl: tokens:" in result.stderr and str(blocker) in result.stderr


def test_a_shard_on_the_tokens_checks_them_and_status_names_it_by_the_reached_address(tmp_path, shards):
    out = tmp_path / "secrets"
    assert run_cli("psworker.ctl", "tokens", "--out", str(out)).returncode == 0
    (shard,) = shards(1, "--host", "0.0.0.0", "--auth-token-file", str(out / "tokens"))
    refused = run_cli("psworker.ctl", "status", "--ps", shard.address, "--timeout", "5")
    assert refused.returncode == 1 and "token" in refused.stderr.lower(), refused.stderr
    shown = run_cli("psworker.ctl", "status", "--ps", shard.address, "--json", "--token-file",
                    str(out / "reader.token"))
    assert shown.returncode == 0, shown.stderr
    assert [s["address"] for s in json.loads(shown.stdout)] == [shard.address]
