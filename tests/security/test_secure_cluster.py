"""The README's secure cluster: ``pscluster --tls --auth`` trains end to end with mutual TLS and
tokens, every child started from flags and environment alone (no token on any command line)."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_pscluster_with_tls_and_tokens_trains_mnist1d_to_the_usual_accuracy():
    proc = run_cli("psworker.cluster", "--shards", "2", "--workers", "2", "--task", "mnist1d-mlp",
                   "--tls", "--auth", "--steps", "600", timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["workers"] == 2 and summary["test_accuracy"] > 0.5, summary
    assert "--tls: shards require client certificates" in proc.stderr
    assert "--auth: shards check tokens from" in proc.stderr
    # Tokens travel in files and the environment: no child's command line or log shows one.
    assert not re.search(r"--token(?!-file)|Bearer|PSGRPC_TOKEN=", proc.stderr + proc.stdout)
    assert "UNAUTHENTICATED" not in proc.stderr and "PERMISSION_DENIED" not in proc.stderr
