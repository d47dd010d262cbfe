"""``docker compose up`` on a real engine: the project's docker/Dockerfile and docker/compose.yaml,
driven with Compose v2 as users type it.

Each scenario starts a fresh cluster from a copy of the repository (tests/docker/engine.py) and
takes it down with its volumes at the end, whatever happens. The commands are the README's
("Run with Docker Compose"; :data:`README_COMMANDS`, checked against it), each with
tests/docker/compose.test.yaml added after ``-f docker/compose.yaml``: a Prometheus built from
Debian's package under the service's name, and no Grafana (neither image can be pulled here).
Settings a scenario changes (steps, lease, checkpoint period, mode) go through the environment,
as docker/.env.example documents them.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.docker.engine import BASE_IMAGE
from tests.observability.prom import (
    PrometheusAPI, PrometheusError, dashboard_query_list, loaded_alert_queries, without_data,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BASE = "docker compose -f docker/compose.yaml"
OVERRIDE = "-f tests/docker/compose.test.yaml"

UP = f"{BASE} up -d"
WATCH = f"{BASE} logs -f worker"
STATUS = f"{BASE} exec shard0 psctl status --ps shard0:7000,shard1:7000"
SCALE = f"{BASE} up -d --scale worker=3"
CRASH = f"{BASE} exec shard0 sh -c 'kill -9 -1'"
EXPORT = (f'{BASE} run --rm --no-deps --user "$(id -u):$(id -g)" -v "$PWD:/out" worker '
          "psctl export --ps shard0:7000,shard1:7000 --out /out/model.safetensors")
DOWN = f"{BASE} down -v"
README_COMMANDS = [UP, WATCH, STATUS, SCALE, CRASH, EXPORT, DOWN]

ACCURACY = 0.90
RESTORE_MARGIN = 0.04
"""How far below the up scenario's accuracy the crash scenario's may end (see its test)."""
_baseline: dict[str, float] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """One compose project in the copy ``directory``; ``run`` runs a README command."""

    def __init__(self, engine, directory: Path, *, files: tuple[str, ...] = (), **settings: str) -> None:
        self.engine = engine
        self.directory = directory
        # Compose files a scenario adds, as the README says to: right after compose.yaml.
        self.added = "".join(f" -f {f}" for f in (*files, OVERRIDE.removeprefix("-f ")))
        self.prometheus_port = _free_port()
        self.env = dict(engine.env, BASE_IMAGE=BASE_IMAGE, PROMETHEUS_PORT=str(self.prometheus_port),
                        GRAFANA_PORT=str(_free_port()), **settings)

    def run(self, command: str, *, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        assert command.startswith(BASE), command
        script = command.replace(BASE, BASE + self.added, 1)
        result = subprocess.run(["bash", "-c", script], cwd=self.directory, env=self.env, capture_output=True,
                                text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{command} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                                 f"{result.stderr[-3000:]}\n{self.logs()[-4000:]}")
        return result

    def compose(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(f"{BASE} {shlex.join(args)}", timeout=timeout, check=check)

    def containers(self, service: str | None = None) -> list[dict]:
        out = self.compose("ps", "-a", "--format", "json", *([service] if service else [])).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]
        return sorted(rows, key=lambda row: row["Name"])

    def logs(self, *services: str) -> str:
        result = self.compose("logs", "--no-color", *services, check=False, timeout=60)
        return result.stdout + result.stderr

    def results(self) -> list[dict]:
        """The workers' JSON result lines."""
        lines = self.compose("logs", "--no-color", "--no-log-prefix", "worker", timeout=60).stdout.splitlines()
        return [json.loads(line) for line in lines if line.startswith("{") and '"test_accuracy"' in line]

    def wait(self, condition, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n"
                                     f"{json.dumps(self.containers(), indent=1)[-2000:]}\n{self.logs()[-6000:]}")
            time.sleep(1)  # polls docker: there is no event to wait on across the CLI

    def workers_done(self, count: int, timeout: float = 240) -> list[dict]:
        """Wait until ``count`` worker containers have exited; fails if one exited non-zero."""
        def done():
            workers = self.containers("worker")
            failed = [w for w in workers if w["State"] == "exited" and w["ExitCode"] != 0]
            assert not failed, f"workers failed: {failed}\n{self.logs('worker')[-6000:]}"
            return len(workers) == count and all(w["State"] == "exited" for w in workers) and workers
        return self.wait(done, timeout, f"{count} workers to finish")

    def log_matches(self, service: str, pattern: str) -> list[str]:
        return re.findall(pattern, self.logs(service))

    def prometheus(self) -> PrometheusAPI:
        return PrometheusAPI(f"http://127.0.0.1:{self.prometheus_port}")

    def down(self) -> None:
        self.run(DOWN, check=False, timeout=180)


@pytest.fixture
def cluster(engine, built):
    clusters: list[Cluster] = []

    def make(*files: str, **settings: str) -> Cluster:
        clusters.append(Cluster(engine, built, files=files, **settings))
        return clusters[-1]

    yield make
    for c in clusters:
        c.down()
    leftover = engine.docker("ps", "-aq", check=False).stdout.split()
    assert not leftover, f"containers left after down: {leftover}"


def _accuracy(results: list[dict], count: int) -> float:
    assert len(results) == count, results
    accuracies = [r["test_accuracy"] for r in results]
    assert min(accuracies) >= ACCURACY, json.dumps(results, indent=1)
    return min(accuracies)


def _dynamic_split(results: list[dict]) -> None:
    """The workers trained the job's data between them, each example once (no failure)."""
    job = results[0]["data"]["job"]
    assert all(r["data"]["mode"] == "dynamic" and r["worker_index"] is None for r in results), results
    assert all(r["data"]["examples"] > 0 for r in results), [r["data"] for r in results]
    assert sum(r["data"]["examples"] for r in results) == job["total"], [r["data"] for r in results]


def test_the_readme_gives_the_commands_this_tier_runs():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Run with Docker Compose"):]
    section = section[:section.index("\n## ", 1)]
    lines = [line.strip() for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S)
             for line in block.splitlines() if line.strip().startswith("docker compose")]
    assert lines == README_COMMANDS


def test_up_trains_to_completion_and_the_model_comes_out(cluster, built):
    # Twice the task's 6,000 steps, as the other scenarios run: Prometheus finds the workers by a
    # DNS lookup every 10 s and scrapes every 5 s, and a job of a few seconds (the CNN's step is
    # one call to shard 0 since small models are packed) can end before its first scrape.
    c = cluster(PSWORKER_STEPS="12000")
    c.run(UP)
    watched = subprocess.Popen(["bash", "-c", WATCH.replace(BASE, BASE + c.added, 1)], cwd=built, env=c.env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        c.wait(lambda: c.log_matches("worker", r"step \d+ loss"), 120, "progress lines")
        status = c.run(STATUS)
        for row in ("0/2", "1/2"):
            assert re.search(rf"^{row}\s+\S+\s+ready\b", status.stdout, flags=re.M), status.stdout
        c.workers_done(2)
    finally:
        watched.terminate()
        streamed = watched.communicate(timeout=30)[0]
    assert re.search(r"worker-\d+\s+\| .*step \d+ loss", streamed), streamed[-2000:]
    results = c.results()
    _baseline["accuracy"] = _accuracy(results, 2)
    _dynamic_split(results)
    # The accuracy is in Prometheus too (the workers evaluate every 500 steps; Grafana's panel
    # is this metric).
    seen = c.prometheus().value("max_over_time(psworker_test_accuracy[10m])")
    assert seen is not None and seen >= 0.85, seen

    model = built / "model.safetensors"
    model.unlink(missing_ok=True)
    try:
        c.run(EXPORT)
        from psworker.tasks import evaluate, load_task
        from safetensors.torch import load_file

        task = load_task("mnist1d-cnn")
        task.model.load_state_dict(load_file(model), strict=True)
        scores = evaluate(task.model, task)
        assert scores["test_accuracy"] >= ACCURACY, scores
    finally:
        model.unlink(missing_ok=True)


def test_a_crashed_shard_restarts_restores_and_the_workers_finish(cluster):
    # Checkpoints every 2 s, and a job long enough to crash a shard in its middle: twice the up
    # scenario's, so that the updates the crash rolls back (those after the checkpoint restored,
    # up to a second of training) stay a small share of it.
    c = cluster(CHECKPOINT_EVERY="2s", PSWORKER_STEPS="24000")
    c.run(UP)
    c.wait(lambda: c.log_matches("shard0", r"checkpoint \d+ written .*\(version [1-9]\d*, complete\)"), 120,
           "a complete checkpoint with trained weights")
    c.run(CRASH)
    c.wait(lambda: c.log_matches("shard0", r"restored checkpoint \d+ from /checkpoints"), 120,
           "shard0 to restart and restore")
    (shard0,) = c.containers("shard0")
    restarts = c.engine.docker("inspect", "-f", "{{.RestartCount}}", shard0["Name"]).stdout.strip()
    assert int(restarts) == 1, restarts
    c.workers_done(2, timeout=300)
    accuracy = _accuracy(c.results(), 2)
    baseline = _baseline.get("accuracy")
    if baseline is not None:  # when the up scenario ran in this session
        # Two async runs end apart by chance: six up + crash pairs on 2 cores read 0.921-0.941 up
        # and 0.917-0.943 after a crash (means 0.931 and 0.931), differences -0.021 to +0.019
        # (standard deviation 0.014). The margin is three of those, so the test fails for a restore
        # that costs the model, not for a pair's luck (0.02 failed two CI runs).
        assert accuracy >= baseline - RESTORE_MARGIN, (accuracy, baseline)


def test_a_paused_worker_is_evicted_and_rejoins_when_unpaused(cluster):
    # The crash scenario's job, four times the task's: the first progress line comes 5 s into
    # training, and two workers at 50K samples/s each had done 500K of the task's 600K examples by
    # then; the other worker finished the job 6 s after the pause, before the 5 s lease evicted
    # the paused one (CI at 1956e07).
    c = cluster(LEASE_TIMEOUT="5", PSWORKER_STEPS="24000")
    c.run(UP)
    c.wait(lambda: c.log_matches("worker", r"step \d+ loss"), 120, "training to start")
    paused = c.containers("worker")[0]

    def frozen() -> bool:
        # runc's cgroup freezer can fail on a process caught mid-syscall ("unable to freeze", seen
        # once in CI); the container is thawed and keeps running then, and a second try freezes it.
        result = c.engine.docker("pause", paused["Name"], check=False)
        if result.returncode != 0 and "unable to freeze" not in result.stderr:
            raise RuntimeError(f"docker pause failed ({result.returncode}): {result.stderr}")
        return result.returncode == 0

    c.wait(frozen, 30, "the worker's container to freeze")
    try:
        # Worker names are HOSTNAME-PID, and a container's hostname is its short id.
        c.wait(lambda: c.log_matches("shard0", rf"evicted {paused['ID'][:12]}-\d+ \(generation"), 60,
               "the paused worker's eviction")
    finally:
        c.engine.docker("unpause", paused["Name"])
    c.wait(lambda: re.search(r"re-registered", c.logs("worker")), 60, "the worker to re-register")
    workers = c.workers_done(2, timeout=300)
    assert all(w["ExitCode"] == 0 for w in workers)
    results = c.results()
    assert any(r["rejoins"] >= 1 for r in results), results
    _accuracy(results, 2)


def test_three_identical_workers_split_the_data_with_tokens_on(cluster):
    c = cluster("docker/compose.tokens.yaml")
    c.run(SCALE)
    c.workers_done(3)
    results = c.results()
    _accuracy(results, 3)
    _dynamic_split(results)
    assert len({r["worker"] for r in results}) == 3, results
    # Compose's default schedule, over the task's 6,000 steps (docker/compose.yaml).
    assert len(c.log_matches("worker", r"adam lr 0\.01 \(cosine decay to 0 x lr at update 6000\)")) == 3

    # The shards checked the tokens compose.tokens.yaml made: psctl needs one, the reader's does.
    assert c.log_matches("shard0", r"3 token\(s\) checked") and c.log_matches("shard1", r"3 token\(s\) checked")
    refused = c.run(STATUS, check=False)
    assert refused.returncode == 1 and "token" in refused.stderr.lower(), refused.stdout + refused.stderr
    shown = c.run(f"{STATUS} --token-file /run/psgrpc/reader.token")
    assert re.search(r"^0/2\s+shard0:7000\s+ready\b", shown.stdout, flags=re.M), shown.stdout
    # Workers hold their own token and no other.
    held = c.compose("run", "--rm", "--no-deps", "--entrypoint", "ls", "worker", "-A", "/run/psgrpc")
    assert held.stdout.split() == ["worker.token"], held.stdout


def test_prometheus_scrapes_every_target_and_every_query_has_data(cluster):
    # ssp with evaluations, so that the waits, the worker waited on and the accuracy have data;
    # a job longer than the test, which ends it once every query has answered.
    c = cluster(PSWORKER_MODE="ssp", PSWORKER_STALENESS="1", PSWORKER_EVAL_EVERY="100", PSWORKER_STEPS="2000000",
                CHECKPOINT_EVERY="2s")
    c.run(UP)
    prom = c.prometheus()

    def all_up():
        try:
            targets = prom.targets()
        except (OSError, PrometheusError):
            return False
        up = sorted((t["labels"]["job"], t["health"]) for t in targets)
        return up == [("psserver", "up")] * 2 + [("psworker", "up")] * 2

    c.wait(all_up, 120, "Prometheus to scrape 2 shards and 2 workers")
    # An error series for the error panels: a checkpoint id far beyond the shards' clocks.
    refused = c.compose("exec", "shard0", "psctl", "checkpoint", "--ps", "shard0:7000,shard1:7000",
                        "--id", "999999999999", check=False)
    assert refused.returncode != 0, refused.stdout
    queries = dashboard_query_list(rate_interval="30s") + loaded_alert_queries(prom)
    assert len(queries) > 40
    missing: list[str] = []

    def all_have_data():
        missing[:] = without_data(prom, queries)
        return not missing

    try:
        c.wait(all_have_data, 180, "every dashboard and alert query to return data")
    except AssertionError as exc:
        raise AssertionError("\n".join(missing)) from exc
    assert all(w["State"] == "running" for w in c.containers("worker"))


def test_the_worker_image_carries_mnist1d_so_its_workers_never_generate_it(engine, built):
    # Generation disabled: load_task must read the image's data cache (docker/Dockerfile).
    out = engine.docker("run", "--rm", "--network", "none", "psgrpc-worker:latest", "python", "-c",
                        "from psworker import tasks; tasks._generate_mnist1d = None; "
                        "t = tasks.load_task('mnist1d-cnn'); print(tuple(t.train[0].shape), tasks.data_cache_dir())").stdout
    assert out.split() == ["(4000,", "40)", "/home/psgrpc/.cache/psgrpc"], out


def test_compose_config_publishes_only_prometheus_and_grafana_on_loopback(engine):
    for files in (["docker/compose.yaml"], ["docker/compose.yaml", "docker/compose.gpu.yaml"],
                  ["docker/compose.yaml", "docker/compose.tokens.yaml"]):
        args = [a for f in files for a in ("-f", f)]
        out = engine.docker("compose", *args, "config", "--format", "json", cwd=ROOT,
                            env={"BASE_IMAGE": BASE_IMAGE}).stdout
        config = json.loads(out)
        services = config["services"]
        tokens = "docker/compose.tokens.yaml" in files
        if tokens:  # the one-shot service that writes the tokens has no network at all
            assert services.pop("tokens")["network_mode"] == "none"
        assert set(services) == {"shard0", "shard1", "worker", "prometheus", "grafana"}
        published = {name: s.get("ports", []) for name, s in services.items() if s.get("ports")}
        assert set(published) == {"prometheus", "grafana"}, published
        for name, ports in published.items():
            assert all(p["host_ip"] == "127.0.0.1" for p in ports), (name, ports)
        assert all(s.get("init") is True for s in services.values()), {n: s.get("init") for n, s in services.items()}
        for name in ("shard0", "shard1", "worker"):
            assert list(services[name]["networks"]) == ["cluster"], (name, services[name]["networks"])
            assert "expose" not in services[name]
        assert config["networks"]["cluster"]["internal"] is True
        for name in ("shard0", "shard1"):
            env = services[name]["environment"]
            assert env["PSSERVER_HOST"] == "0.0.0.0" and env["PSSERVER_RESTORE"] == "auto", env
            assert services[name]["restart"] == "unless-stopped"
            assert services[name]["volumes"][0]["source"] == "checkpoints"
            if tokens:
                assert services[name]["environment"]["PSSERVER_AUTH_TOKEN_FILE"] == "/run/psgrpc/tokens"
        # Grafana starts provisioned: the data source is this Prometheus, the dashboards directory
        # the provider reads is where the dashboard is mounted, and it opens on that dashboard.
        grafana, prometheus = services["grafana"], services["prometheus"]
        mounts = {v["target"]: Path(v["source"]) for v in grafana["volumes"]}
        provisioning = mounts["/etc/grafana/provisioning"]
        provider = (provisioning / "dashboards" / "psgrpc.yml").read_text()
        dashboards = re.search(r"^\s*path:\s*(\S+)", provider, flags=re.M).group(1)
        assert (mounts[dashboards] / "psgrpc.json").is_file(), mounts
        home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
        assert home == f"{dashboards}/psgrpc.json"
        source = (provisioning / "datasources" / "prometheus.yml").read_text()
        assert re.search(r"^\s*url:\s*http://prometheus:9090\s*$", source, flags=re.M), source
        assert "--web.listen-address=:9090" in prometheus["command"]
        assert set(grafana["networks"]) & set(prometheus["networks"]), (grafana["networks"], prometheus["networks"])
        if "docker/compose.gpu.yaml" in files:
            devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
            assert devices and devices[0]["capabilities"] == ["gpu"], devices
            assert services["worker"]["environment"]["PSWORKER_DEVICE"] == "cuda"
