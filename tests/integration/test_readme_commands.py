"""Every shell block of the README runs as written, after the setup command, from the
repository root: each in its own bash, its fixed ports (7000-7003) swapped for free ones chosen
now (the only change), and whatever it left running stopped afterwards. The blocks not run
here are listed with the reason; a new block fails the test until it is run or listed."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT, child_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

README = ROOT / "README.md"

NOT_RUN_HERE = {
    "scripts/setup.sh --test && .venv/bin/python -m pytest":
        "the test command itself: .ci/run runs exactly this line (checked below)",
    "python3 -m venv .venv && .venv/bin/pip install torch":
        "installs the CUDA build of torch (several GB); CI machines have no GPU",
    "# machine A, the head: a shard or a worker":
        "machines of a Ray cluster: tests/ray/test_ray.py runs these lines, as written, on Ray nodes in namespaces",
    "docker compose -f docker/compose.yaml":
        "a Docker engine's commands: tests/docker/test_compose.py runs each, as written",
    ".venv/bin/pscluster --shards 2 --workers 2 --task mnist1d-mlp --mode ssp --staleness 1":
        "runs Prometheus in the foreground until stopped; tests/observability runs this setup for real",
}


def _blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _run(block: str, timeout: float = 420) -> subprocess.CompletedProcess:
    ports = dict(zip(("7000", "7001", "7002", "7003"), map(str, _free_ports(4))))
    script = re.sub(r"\b700[0-3]\b", lambda m: ports[m.group(0)], block)
    proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:  # whatever the block left running (shards it started in the background)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _block(start: str) -> str:
    found = [b for b in _blocks() if b.startswith(start)]
    assert len(found) == 1, f"no README block starts with {start!r}"
    return found[0]


MAIN_JOB = "scripts/setup.sh && .venv/bin/pscluster"
BY_HAND = ".venv/bin/psserver --port 7000 & S0=$!\n.venv/bin/psserver --port 7001 & S1=$!\n.venv/bin/psworker"
ELASTIC = ".venv/bin/psserver --port 7000 & S0=$!\n.venv/bin/psserver --port 7001 & S1=$!\nPS="
SAMPLER = ".venv/bin/psserver --port 7002"
SECURE = ".venv/bin/pscluster --shards 2 --workers 2 --task mnist1d-cnn --tls --auth"
TABLES = ".venv/bin/pscluster --shards 2 --workers 2 --task dlrm-synth"
RUN = (MAIN_JOB, BY_HAND, ELASTIC, SAMPLER, SECURE, TABLES)


def test_every_block_is_run_here_or_listed_with_a_reason():
    for block in _blocks():
        assert any(block.startswith(s) for s in [*RUN, *NOT_RUN_HERE]), f"README block not run by any test:\n{block}"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "scripts/setup.sh --test && .venv/bin/python -m pytest" in ci


def test_ten_million_row_table_job_reaches_the_teachers_auc():
    result = _run(_block(TABLES))
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["test_auc"] >= 0.95 * summary["teacher_auc"], summary
    assert summary["steps"] > 0 and summary["samples"] >= 490_000, summary


def test_main_job_trains_and_its_last_line_is_the_json_summary():
    result = _run(_block(MAIN_JOB))
    assert result.returncode == 0, result.stderr[-4000:]
    last = result.stdout.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["test_accuracy"] > 0.85, last


def test_by_hand_cluster_trains_exports_and_ends_the_job(tmp_path):
    model = ROOT / "model.safetensors"
    model.unlink(missing_ok=True)
    try:
        result = _run(_block(BY_HAND))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        summaries = _json_lines(result.stdout)
        assert len(summaries) == 2 and all(s["test_accuracy"] > 0.5 for s in summaries), result.stdout
        assert model.stat().st_size > 0
        assert "ended job 'task=mnist1d-mlp'" in result.stdout
        # The README's Python block that loads it, as written, in the same place.
        (code,) = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
                   if 'load_file("model.safetensors")' in b]
        loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True,
                                text=True, timeout=240)
        assert loaded.returncode == 0, loaded.stderr[-3000:]
        accuracy = float(re.search(r"'test_accuracy': ([0-9.]+)", loaded.stdout).group(1))
        # The shards' model after both workers' last pushes: what the last to finish reported,
        # give or take the other's final steps.
        assert min(abs(accuracy - s["test_accuracy"]) for s in summaries) < 0.03, (loaded.stdout, summaries)
    finally:
        model.unlink(missing_ok=True)


def test_elastic_workers_share_the_data_exactly():
    result = _run(_block(ELASTIC))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = _json_lines(result.stdout)
    assert len(lines) == 3, result.stdout
    assert sum(line["data"]["examples"] for line in lines) == 20 * 4000
    assert "dynamic data: epoch" in result.stdout  # psctl status showed the queue


def test_elastic_sampler_example_runs_as_two_copies():
    result = _run(_block(SAMPLER))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_secure_cluster_trains():
    result = _run(_block(SECURE))
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["test_accuracy"] > 0.85
