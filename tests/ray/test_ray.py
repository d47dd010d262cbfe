"""``pscluster --ray`` on a real multi-node Ray cluster (a head and two nodes, each in its own
network namespace): placement across nodes, Ray restarting a killed shard that restores, a node
that goes away with its worker, a worker added while the job runs, and what a CUDA job asks of
Ray. Everything the jobs send stays inside the namespaces."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import pytest

from tests.conftest import ROOT
from tests.ray.conftest import readme_block
from tests.ray.netcluster import NetCluster

pytestmark = pytest.mark.timeout(240)
T = TypeVar("T")

TASK = "mnist1d-cnn"
TOTAL = 600_000
"""The job's examples: mnist1d-cnn's default job, 150 epochs of 4,000."""
GROWN_EPOCHS = 600
"""The scaled job's length: long enough to add a worker and take it away while it trains (about
30 s; at 200 epochs a CI run's job ran out of data 1.2 s after the third worker started, and the
scale-down's signal reached it as it exited)."""
RESOURCES = ["--shard-resources", '{"ps_shard": 1}', "--worker-resources", '{"ps_worker": 1}']
"""As the README's job asks for them (the Python API test passes them itself)."""
_SERVES = re.compile(r"shard(\d+) serves on ([\d.]+):(\d+) \(Ray actor pid (\d+)")
_RUNS_ON = re.compile(r"(worker-\d+) runs on ([\d.]+) \(Ray actor pid (\d+)")
_WRITTEN = re.compile(r"checkpoint (\d+) written .* \(version (\d+)(, complete)?\)")


@dataclass
class Job:
    """A driver (``pscluster --ray`` or a Python script) run in the head node's namespace."""

    popen: subprocess.Popen
    out: Path
    err: Path

    def log(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        return self.wait_until(lambda log: re.search(pattern, log), repr(pattern), timeout)

    def wait_until(self, found: Callable[[str], T | None], what: str, timeout: float) -> T:
        """``found(log)``'s first true answer, polling the driver's log until ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if answer := found(self.log()):
                return answer
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {what} in the driver's log within {timeout:.0f}s "
                             f"(exit status {self.popen.poll()}):\n{self.log()[-6000:]}")

    def summary(self, timeout: float) -> dict:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            raise AssertionError(f"the job did not end within {timeout:.0f}s:\n{self.log()[-6000:]}") from None
        assert code == 0, f"the job failed with exit status {code}:\n{self.log()[-8000:]}"
        lines = [line for line in self.out.read_text().splitlines() if line.startswith("{")]
        assert lines, f"no summary line:\n{self.log()[-4000:]}"
        return json.loads(lines[-1])

    def shards(self) -> dict[int, tuple[str, int]]:
        """shard index -> (node address, Ray actor pid), as the driver logged them first."""
        found: dict[int, tuple[str, int]] = {}
        for m in _SERVES.finditer(self.log()):
            found.setdefault(int(m[1]), (m[2], int(m[4])))
        return found

    def workers(self) -> dict[str, str]:
        """worker name -> the address of the node it last ran on."""
        return {m[1]: m[2] for m in _RUNS_ON.finditer(self.log())}


def start_job(cluster: NetCluster, tmp_path: Path, argv: list[str], name: str = "job") -> Job:
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with open(out, "w") as o, open(err, "w") as e:
        popen = subprocess.Popen(cluster.exec_argv(cluster.head, argv), stdout=o, stderr=e, cwd=ROOT,
                                 env=cluster.env())
    return Job(popen, out, err)


def readme_line(start: str, cluster: NetCluster, run_dir: Path) -> list[str]:
    """The README's command line that starts with ``start``, as argv: the head's address for
    ``A``, ``run_dir`` for the shared ``/shared/job1``, and this interpreter for the script."""
    lines = [line for line in readme_block().splitlines() if line.startswith(start)]
    assert len(lines) == 1, f"the README's Ray block has no line {start!r}"
    argv = [{"A:6379": cluster.gcs, "/shared/job1": str(run_dir)}.get(a, a) for a in shlex.split(lines[0])]
    assert argv[0] == ".venv/bin/pscluster"
    return [sys.executable, "-m", "psworker.cluster", *argv[1:]]


def pscluster(cluster: NetCluster, tmp_path: Path, *flags: str, name: str = "job") -> Job:
    """The README's job command, with ``flags`` added (a later flag wins over the README's)."""
    argv = readme_line(".venv/bin/pscluster --ray A:6379 --task", cluster, tmp_path / f"{name}-run")
    assert "--task" in argv and TASK in argv
    return start_job(cluster, tmp_path, [*argv, *flags], name)


def early_complete_checkpoint(log: str, updates: int) -> int | None:
    """The first checkpoint id the log shows complete with a shard at >= ``updates`` versions."""
    versions: dict[int, int] = {}
    complete: set[int] = set()
    for m in _WRITTEN.finditer(log):
        versions[int(m[1])] = max(versions.get(int(m[1]), 0), int(m[2]))
        if m[3]:
            complete.add(int(m[1]))
    return next((i for i in sorted(complete) if versions[i] >= updates), None)


def assert_all_data(summary: dict) -> None:
    data = summary["data"]
    assert data["finished"] and data["examples_done"] == data["job"]["total"] == TOTAL, data


def scrape(cluster: NetCluster, target: str) -> str:
    """A metrics endpoint's text, fetched from the head node (the test's own namespace reaches none)."""
    return cluster.run(cluster.head, [sys.executable, "-c", "import sys, urllib.request; sys.stdout.write("
                                      f"urllib.request.urlopen('http://{target}/metrics', timeout=10).read().decode())"
                                      ], timeout=30).stdout


@pytest.fixture(scope="module")
def baseline(ray_cluster, tmp_path_factory):
    """Scenario 1's job (2 shards, 2 workers), run once: test 1 checks it, test 2 compares with it.
    Returns the job, its summary, and its Prometheus service discovery file while it trained with
    each target's metrics."""
    tmp = tmp_path_factory.mktemp("baseline")
    sd_file = tmp / "targets.json"
    job = pscluster(ray_cluster, tmp, "--metrics-sd-file", str(sd_file))
    try:
        deadline = time.monotonic() + 120
        while True:
            groups = json.loads(sd_file.read_text()) if sd_file.exists() else []
            targets = {g["labels"]["job"]: g["targets"] for g in groups}
            if len(targets.get("psserver", [])) == 2 and len(targets.get("psworker", [])) == 2:
                break
            assert time.monotonic() < deadline and job.popen.poll() is None, \
                f"the service discovery file never listed 2 shards and 2 workers: {groups}\n{job.log()[-3000:]}"
            time.sleep(0.2)
        scraped = {target: scrape(ray_cluster, target) for ts in targets.values() for target in ts}
    except BaseException:
        job.popen.kill()
        raise
    return job, job.summary(timeout=200), targets, scraped


def test_two_shards_on_different_nodes_and_two_workers_train_mnist1d_cnn(baseline):
    job, summary, _, _ = baseline
    shards = job.shards()
    assert len(shards) == 2 and shards[0][0] != shards[1][0], f"the shards share a node: {shards}"
    assert summary["test_accuracy"] >= 0.90, summary
    assert summary["workers"] == 2 and summary["restarts"] == [], summary
    assert_all_data(summary)
    assert sum(summary["data"]["worker_examples"]) == TOTAL
    # The final evaluation read the shards over the namespaces' network, on their nodes' addresses.
    assert re.search(r"\d+ shard\(s\) listening: 10\.215\.\d+\.\d+:\d+,10\.215\.", job.log())


def test_every_shard_and_worker_is_listed_for_prometheus_on_its_node(baseline):
    job, _, targets, scraped = baseline
    shard_hosts = {host for host, _ in job.shards().values()}
    assert {t.rpartition(":")[0] for t in targets["psserver"]} == shard_hosts
    assert all(t.startswith("10.215.") for ts in targets.values() for t in ts), targets
    for target in targets["psserver"]:
        assert "psserver_pushes" in scraped[target], scraped[target][:500]
    for target in targets["psworker"]:
        assert "psworker_steps_total" in scraped[target], scraped[target][:500]


def test_a_shard_actor_killed_is_restarted_by_ray_restores_and_the_workers_finish(ray_cluster, tmp_path, baseline):
    job = pscluster(ray_cluster, tmp_path, "--checkpoint-every", "2s")
    try:
        job.wait_for(r"\[shard\d\].*checkpoint \d+ written .*complete\)", timeout=120)
        job.wait_for(r"worker-\d+ step \d+", timeout=60)
        host, pid = job.shards()[0]
        os.kill(pid, signal.SIGKILL)  # the shard actor's own process: its psserver dies with it
        restarted = job.wait_for(r"shard0 was restarted by Ray \(restart 1\): serving on ([\d.]+:\d+) .*"
                                 r"restored checkpoint (\d+)", timeout=120)
        assert restarted[1].startswith(host + ":"), "the shard came back on another node"
        summary = job.summary(timeout=200)
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
    assert [r["process"] for r in summary["restarts"]] == ["shard0"], summary["restarts"]
    assert summary["restarts"][0]["restored"] == int(restarted[2])
    assert_all_data(summary)
    # The band of the tier's other two-worker jobs, not the baseline's own draw less 0.02: at the
    # task's constant rate a job's final accuracy is one draw from a spread wider than that (the
    # 3-worker job ended at 0.903-0.943 in five runs, docs/consistency.md "Learning-rate
    # schedules"), and a CI run's baseline read 0.939 with this job at 0.913.
    assert summary["test_accuracy"] >= 0.88, (summary, baseline[1]["test_accuracy"])


def test_a_worker_added_while_the_job_runs_joins_takes_data_and_leaves_when_scaled_down(ray_cluster, tmp_path):
    """Through the Python API (psworker.ray.run) with tokens on, scaled by the README's command
    (--set-workers): 2 workers, then 3, then 2 again, the newest stopping and handing back."""
    script = (f"import json, logging, psworker.ray\n"
              f"logging.basicConfig(level=logging.INFO)\n"
              f"summary = psworker.ray.run({TASK!r}, address={ray_cluster.gcs!r}, shards=2, workers=2, "
              f"job_name='grow', run_dir={str(tmp_path / 'run')!r}, shard_resources={{'ps_shard': 1}}, "
              f"worker_resources={{'ps_worker': 1}}, auth=True, "
              f"worker_args=['--epochs', '{GROWN_EPOCHS}', '--log-every', '1'])\n"
              f"print(json.dumps(summary))\n")
    job = start_job(ray_cluster, tmp_path, [sys.executable, "-c", script])
    scale = readme_line(".venv/bin/pscluster --ray A:6379 --job-name", ray_cluster, tmp_path)
    scale[scale.index("--job-name") + 1] = "grow"

    def set_workers(n: int) -> None:
        scale[scale.index("--set-workers") + 1] = str(n)
        scaled = ray_cluster.run(ray_cluster.head, scale, cwd=ROOT)
        assert json.loads(scaled.stdout.splitlines()[-1])["workers"] == n

    try:
        job.wait_for(r"worker-\d+ step \d+", timeout=120)
        set_workers(3)
        job.wait_for(r"\[worker-2\].* step \d+ loss", timeout=90)  # it trains (not "starts at step 1")
        set_workers(2)
        job.wait_for(r"scaling to 2 worker\(s\): stopping 1", timeout=30)
        summary = job.summary(timeout=200)
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
    by_worker = {r["worker"]: r["data"] for r in summary["per_worker"]}
    assert set(by_worker) == {"worker-0", "worker-1", "worker-2"}, by_worker
    added = by_worker["worker-2"]
    assert added["examples"] > 0 and added["stopped"], f"the added worker: {added}"
    assert not by_worker["worker-0"]["stopped"] and not by_worker["worker-1"]["stopped"]
    # Tokens were checked on every shard: the workers on every node read theirs from the run directory.
    assert len(re.findall(r"\[shard\d\].*token\(s\) checked", job.log())) == 2, job.log()[-3000:]
    assert "no tokens are checked" not in job.log()
    data = summary["data"]
    assert data["finished"] and data["examples_done"] == data["job"]["total"] == GROWN_EPOCHS * TOTAL // 150, data


def test_a_node_that_goes_away_takes_only_its_worker_and_no_data_task_is_lost(ray_cluster, tmp_path):
    node = ray_cluster.nodes[3]  # machine D: a worker slot, no shard
    # A worker on every node: one of them on D.
    # Adam at a quarter of the task's 1e-2 (a worker flag): at 1e-2, four async workers now and
    # then kill every ReLU early and never learn (accuracy 0.096 in CI at 52ccb9b; about 1 run in
    # 25 in psbench.config.ElasticJob's runs). At 2.5e-3 the same job by hand ended at 0.915, 0.916.
    job = pscluster(ray_cluster, tmp_path, "--workers", "4", "--lr", "2.5e-3", "--shard-arg=--lease-timeout=3",
                    "--tls")
    try:
        runs_on = job.wait_for(rf"(worker-\d+) runs on {re.escape(node.address)} ", timeout=120)[1]
        job.wait_for(rf"\[{runs_on}\].* step \d+", timeout=60)
        assert ray_cluster.kill_node(node), "nothing ran in the node's namespace"
        job.wait_for(rf"{runs_on} lost: its actor died", timeout=60)
        summary = job.summary(timeout=200)
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
        ray_cluster.restart_node(node)
    assert_all_data(summary)
    # The lost worker's task went back to the queue and was trained by the others.
    assert summary["data"]["tasks_requeued"] >= 1, summary["data"]
    assert [r["process"] for r in summary["restarts"]] == [runs_on], summary["restarts"]
    # Three async workers after the loss, beside CI's load: a band below the two-worker jobs' 0.88.
    assert summary["test_accuracy"] >= 0.80, summary
    # Mutual TLS across the nodes: a certificate naming every node's address, from the run directory.
    assert "TLS is off" not in job.log()


def test_a_cuda_job_asks_ray_for_a_gpu_per_worker(ray_cluster, tmp_path):
    from psworker.cluster import _parse
    from psworker.ray import shard_bundles, worker_options

    args, _ = _parse(["--ray", "", "--device", "cuda", *RESOURCES])
    assert worker_options(args, args.device) == {"num_cpus": 1.0, "num_gpus": 1, "resources": {"ps_worker": 1.0},
                                                 "scheduling_strategy": "SPREAD", "max_restarts": 0}
    assert worker_options(args, "cpu")["num_gpus"] == worker_options(args, "auto")["num_gpus"] == 0
    assert shard_bundles(args) == [{"CPU": 1.0, "ps_shard": 1.0}] * 2
    # This cluster has no GPU: the job says so at once instead of waiting for a placement.
    job = pscluster(ray_cluster, tmp_path, "--device", "cuda")
    code = job.popen.wait(timeout=120)
    assert code == 1 and "the Ray cluster has no GPU" in job.log(), job.log()[-3000:]


def test_a_shard_whose_node_goes_away_moves_to_another_node_and_the_workers_follow(ray_cluster, tmp_path):
    job = pscluster(ray_cluster, tmp_path, "--checkpoint-every", "2s", "--shard-arg=--lease-timeout=3")
    node = None
    try:
        job.wait_for(r"\[shard\d\].*checkpoint \d+ written .*complete\)", timeout=120)
        job.wait_for(r"worker-\d+ step \d+", timeout=60)
        shards = job.shards()
        # The shard that is not on the head (the driver runs there); its node goes, all of it.
        index = next(i for i, (host, _) in shards.items() if host != ray_cluster.head.address)
        node = next(n for n in ray_cluster.nodes if n.address == shards[index][0])
        assert ray_cluster.kill_node(node)
        moved = job.wait_for(rf"shard{index} was restarted by Ray \(restart 1\): serving on ([\d.]+):\d+ .*"
                             r"restored checkpoint (\d+)", timeout=120)
        assert moved[1] not in (node.address, shards[1 - index][0]), "the shard did not move to the free node"
        job.wait_for(r"a shard moved to another node", timeout=30)
        summary = job.summary(timeout=200)
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
        if node is not None:
            ray_cluster.restart_node(node)
    assert_all_data(summary)
    assert summary["test_accuracy"] >= 0.88, summary


def test_a_job_whose_driver_died_goes_on_from_its_run_directory(ray_cluster, tmp_path):
    """The driver is not supervised by Ray: when it dies its actors go with it, and the same
    command started again restores the shards, with the data queue, from the run directory."""
    first = pscluster(ray_cluster, tmp_path, "--checkpoint-every", "2s", name="first")
    try:
        # Killed at the first complete checkpoint holding a few hundred updates (of the job's
        # ~6,000): one written at the job's start holds an untouched queue (CI, 2026-11-27), and
        # waiting for a worker's first step log (5 s in, ~80% of the data done) let the first
        # driver finish the queue before its next checkpoint (CI, 2026-11-29).
        early = first.wait_until(lambda log: early_complete_checkpoint(log, updates=300),
                                 "a complete checkpoint of >= 300 updates", timeout=120)
    finally:
        first.popen.kill()  # SIGKILL: no clean-up of its own
        first.popen.wait(timeout=30)
    again = start_job(ray_cluster, tmp_path, [*readme_line(".venv/bin/pscluster --ray A:6379 --task", ray_cluster,
                                                           tmp_path / "first-run")], "again")
    summary = again.summary(timeout=200)
    restored = re.findall(r"\[shard(\d)\].*restored checkpoint (\d+)", again.log())
    assert {i for i, _ in restored} == {"0", "1"} and len({n for _, n in restored}) == 1, restored
    assert int(restored[0][1]) >= early, (restored, early)
    assert_all_data(summary)
    # The second driver's workers trained only what the checkpoint had not: the rest was done before.
    assert 0 < sum(summary["data"]["worker_examples"]) < TOTAL, summary["data"]
    assert summary["test_accuracy"] >= 0.88, summary


def test_bulk_lanes_carry_a_large_models_bytes_between_nodes(ray_cluster, tmp_path):
    """psbench's 1.1M-parameter MLP: its 4 MiB layer is far above the 256 KiB that goes on a bulk
    lane, and with a worker on every node, most of its pushes cross from one node to another."""
    sd_file = tmp_path / "targets.json"
    job = pscluster(ray_cluster, tmp_path, "--task", "psbench.tasks:mlp1024", "--workers", "4", "--steps", "1000",
                    "--metrics-sd-file", str(sd_file))
    try:
        deadline, lane = time.monotonic() + 150, {}
        while True:
            groups = json.loads(sd_file.read_text()) if sd_file.exists() else []
            for target in next((g["targets"] for g in groups if g["labels"]["job"] == "psserver"), []):
                found = re.search(r'^psserver_push_bytes_total\{transport="lane"\} (\S+)$', scrape(ray_cluster, target),
                                  re.M)
                lane[target] = float(found[1]) if found else 0.0
            if any(v > 0 for v in lane.values()):
                break
            assert time.monotonic() < deadline and job.popen.poll() is None, \
                f"no bytes on a bulk lane: {lane}\n{job.log()[-3000:]}"
            time.sleep(0.5)
        hosts = set(job.workers().values())
        summary = job.summary(timeout=200)
    finally:
        if job.popen.poll() is None:
            job.popen.kill()
    big = max(lane, key=lane.get)
    assert len(hosts) == 4 and hosts - {big.rpartition(":")[0]}, f"no worker on another node than {big}: {hosts}"
    # The job trained (chance is 0.1): 0.61-0.66 in three local runs of the same job, but 0.475
    # in one CI run (2026-11-29), four async SGD workers now and then landing lower; what this
    # test is about is the lanes above.
    assert summary["data"]["finished"] and summary["test_accuracy"] > 0.3, summary
