"""Real processes on loopback: a worker serves every psworker_ metric of docs/metrics.md while it
trains, the step phases say where a sync straggler's peer spends its time, and pscluster's
service discovery file lists every child's endpoint, also after a restart."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from psworker.metrics import PHASES
from tests.conftest import ROOT, child_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CONTRACT = {  # docs/metrics.md, the worker's families as the text parser names them: type, labels
    "psworker_info": ("gauge", {"worker", "task", "mode", "device"}),
    "psworker_steps": ("counter", set()),
    "psworker_samples": ("counter", set()),
    "psworker_step_phase_seconds": ("histogram", {"phase"}),
    "psworker_loss": ("gauge", set()),
    "psworker_test_accuracy": ("gauge", set()),
    "psworker_retries": ("counter", set()),
    "psworker_rejoins": ("counter", set()),
    "psworker_table_ids": ("counter", set()),
    "psworker_table_rows": ("counter", set()),
}


class _Process:
    """A CLI module as a subprocess whose stderr lines are collected as they come."""

    def __init__(self, *argv: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=child_env(), cwd=ROOT,
        )
        self.lines: list[str] = []
        self.stdout = ""
        self._changed = threading.Condition()  # guards lines
        self._threads = [threading.Thread(target=self._read_err, daemon=True),
                         threading.Thread(target=self._read_out, daemon=True)]
        for t in self._threads:
            t.start()

    def _read_err(self) -> None:
        for line in self.popen.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def _read_out(self) -> None:
        self.stdout = self.popen.stdout.read()

    def log(self, last: int = 60) -> str:
        with self._changed:
            return "\n".join(self.lines[-last:])

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first match of ``pattern`` in the stderr lines, once there."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if match := regex.search(line):
                        return match
                left = deadline - time.monotonic()
                assert left > 0 and self.popen.poll() is None, (
                    f"no {pattern!r} (exit {self.popen.poll()}):\n" + "\n".join(self.lines[-60:]))
                self._changed.wait(timeout=min(left, 1.0))

    def pace(self, seconds: float) -> None:
        """Pause between polls; returns early if the process ends."""
        try:
            self.popen.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 60) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=30)
        for t in self._threads:
            t.join(timeout=10)
        return self.popen.returncode


def _scrape(address: str) -> dict:
    """Metric families by name from ``http://ADDRESS/metrics`` (or a full URL)."""
    url = address if address.startswith("http") else f"http://{address}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _sample(families: dict, name: str, **labels) -> float | None:
    """The value of sample ``name`` (e.g. ``psworker_steps_total``) with ``labels``, if there."""
    family = families.get(re.sub(r"(_total|_sum|_count|_bucket)$", "", name))
    for sample in family.samples if family is not None else ():
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None


def _scrape_until(address: str, ready, proc: _Process, timeout: float, what: str) -> dict:
    """Scrape until ``ready(families)``; fails after ``timeout`` or if ``proc`` ends."""
    deadline = time.monotonic() + timeout
    while True:
        families = _scrape(address)
        if ready(families):
            return families
        assert time.monotonic() < deadline and proc.popen.poll() is None, f"no {what}:\n{proc.log()}"
        proc.pace(0.2)


def _worker(ps: str, *extra: str) -> _Process:
    return _Process("psworker", "--ps", ps, "--task", "mnist1d-mlp", "--threads", "1", "--progress", "log",
                    "--metrics-port", "0", *extra)


def test_a_training_worker_serves_every_psworker_metric_of_the_contract(shards):
    a, b = shards(2)
    worker = _worker(f"{a.address},{b.address}", "--steps", "100000", "--eval-every", "25", "--worker-name", "worker-0")
    try:
        url = worker.wait_for(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", 120)[1]
        families = _scrape_until(
            url, lambda f: (_sample(f, "psworker_steps_total") or 0) >= 50 and "psworker_test_accuracy" in f,
            worker, 180, "50 steps and an evaluation")
    finally:
        code = worker.stop()
    # Without --worker-index its data is dynamic: SIGTERM stops it after the step in hand, and it
    # hands back the rest of its data and exits 0.
    assert code == 0, worker.log()

    for name, (kind, labels) in CONTRACT.items():
        assert name in families, name
        family = families[name]
        assert family.type == kind, (name, family.type)
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
            assert math.isfinite(sample.value) or sample.labels.get("le") == "+Inf", sample
    assert [s.labels for s in families["psworker_info"].samples] == [
        {"worker": "worker-0", "task": "mnist1d-mlp", "mode": "async", "device": "cpu"}]
    assert families["psworker_info"].samples[0].value == 1

    steps = _sample(families, "psworker_steps_total")
    samples = _sample(families, "psworker_samples_total")
    assert steps >= 50 and samples / 100 in (steps - 1, steps)  # a scrape may fall between the two
    counts = {p: _sample(families, "psworker_step_phase_seconds_count", phase=p) for p in PHASES}
    sums = {p: _sample(families, "psworker_step_phase_seconds_sum", phase=p) for p in PHASES}
    assert all(steps - 1 <= c <= steps + 1 for c in counts.values()), (steps, counts)
    assert sums["compute"] > 0 and sums["push"] > 0 and sums["pull"] > 0, sums
    assert sums["wait"] == 0, sums  # async: nothing waits on a bound
    assert 0 < _sample(families, "psworker_loss") < 10
    assert 0.05 < _sample(families, "psworker_test_accuracy") <= 1
    assert _sample(families, "psworker_retries_total") == 0
    assert _sample(families, "psworker_rejoins_total") == 0
    assert _sample(families, "process_resident_memory_bytes") > 0
    # Dynamic data: 50 steps of batch 100 span several data tasks of 300 examples.
    assert _sample(families, "psworker_data_tasks_total") >= 1
    assert _sample(families, "psworker_data_wait_seconds_total") >= 0


def test_in_sync_the_peer_of_a_straggler_spends_its_steps_waiting(shards):
    (a,) = shards(1)
    common = ("--mode", "sync", "--num-workers", "2", "--steps", "100000")
    fast = _worker(a.address, *common, "--worker-index", "0")
    slow = _worker(a.address, *common, "--worker-index", "1", "--slowdown", "8")
    try:
        urls = [w.wait_for(r"metrics on (http://\S+/metrics)", 120)[1] for w in (fast, slow)]
        enough = lambda f: (_sample(f, "psworker_steps_total") or 0) >= 40  # noqa: E731
        fast_m, slow_m = (_scrape_until(u, enough, w, 180, "40 steps") for u, w in zip(urls, (fast, slow)))
    finally:
        codes = [w.stop() for w in (fast, slow)]
    assert codes == [130, 130], fast.log() + slow.log()

    def mean(families, phase):
        return (_sample(families, "psworker_step_phase_seconds_sum", phase=phase)
                / _sample(families, "psworker_step_phase_seconds_count", phase=phase))

    print({name: {p: round(mean(m, p) * 1000, 2) for p in PHASES} for name, m in (("fast", fast_m), ("slow", slow_m))},
          "ms per step")
    assert _sample(fast_m, "psworker_info", mode="sync") == 1
    # The straggler's steps are mostly its (stretched) compute; its peer's are mostly waiting for it.
    assert mean(slow_m, "compute") > 3 * mean(fast_m, "compute")
    assert mean(fast_m, "wait") > 2 * mean(slow_m, "wait")
    assert mean(fast_m, "wait") > mean(fast_m, "compute")
    assert mean(fast_m, "push") == mean(fast_m, "pull") == 0  # sync: the exchange is the shard's to hold


def _targets(path: Path) -> dict[str, list[str]]:
    try:
        groups = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return {g["labels"]["job"]: g["targets"] for g in groups}


def test_pscluster_service_discovery_file_lists_every_child_and_follows_a_restart(tmp_path):
    sd_file = tmp_path / "targets.json"
    run = _Process("psworker.cluster", "--restart", "--shards", "2", "--workers", "2", "--task", "linreg",
                   "--steps", "100000", "--metrics-sd-file", str(sd_file),
                   "--shard-arg=--lease-timeout=10")  # the restarted worker waits for the dead one's lease
    try:
        def listed(n_shards: int = 2, n_workers: int = 2):
            t = _targets(sd_file)
            return t if len(t.get("psserver", [])) == n_shards and len(t.get("psworker", [])) == n_workers else None

        deadline = time.monotonic() + 180
        while not (targets := listed()):
            assert time.monotonic() < deadline and run.popen.poll() is None, run.log()
            run.pace(0.2)
        for job, prefix in (("psserver", "psserver_"), ("psworker", "psworker_")):
            for target in targets[job]:
                assert re.fullmatch(r"127\.0\.0\.1:\d+", target), targets
                # Each target answers while the run goes on (a worker's own metrics come once it has set up).
                families = _scrape_until(target, lambda f: f"{prefix}info" in f, run, 60, f"{prefix}info")
                assert "process_resident_memory_bytes" in families, target
        for name, target in zip(("shard0", "shard1", "worker0", "worker1"), targets["psserver"] + targets["psworker"]):
            assert f"pscluster: {name} metrics on http://{target}/metrics" in run.log(400)

        # A worker killed and restarted serves on a new port, and the file follows.
        run.wait_for(r"worker0\] .*starts at step 1 of", 120)
        pid = int(run.wait_for(r"started worker0, pid (\d+)", 10)[1])
        old = targets["psworker"][0]
        os.kill(pid, signal.SIGKILL)
        run.wait_for(r"worker0 recovered in", 180)
        deadline = time.monotonic() + 60
        while (new := _targets(sd_file).get("psworker", [old])[0]) == old:
            assert time.monotonic() < deadline and run.popen.poll() is None, run.log()
            run.pace(0.2)
        assert _targets(sd_file)["psworker"][1] == targets["psworker"][1]
        families = _scrape_until(new, lambda f: "psworker_info" in f, run, 60, "the restarted worker's metrics")
        assert _sample(families, "psworker_info", worker="worker-0") == 1
    finally:
        code = run.stop()
    assert code == 130, run.log()
    assert _targets(sd_file) == {"psserver": [], "psworker": []}  # the stopped cluster lists nothing
