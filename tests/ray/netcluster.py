"""A real multi-node Ray cluster on one machine, each node in a network namespace of its own.

Ray registers its nodes under the machine's outward address even when told 127.0.0.1, so the
test cluster gets addresses of its own: a hub namespace holds a bridge, and every Ray node's
namespace is joined to it by a veth pair, with a private address (10.215.X.N). Nothing leaves
the namespaces this module creates: they have no route beyond the bridge, and the hub has no
link to the host. A node is removed by killing every process in its namespace, as a machine
that goes away takes everything on it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

IP = shutil.which("ip") or "/usr/sbin/ip"
RAY = str(Path(sys.executable).with_name("ray"))
GCS_PORT = 6379


def ip(*args: str) -> None:
    proc = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")


@dataclass
class Node:
    index: int
    netns: str
    address: str
    resources: dict[str, float]
    cpus: int

    def pids(self) -> list[int]:
        out = subprocess.run([IP, "netns", "pids", self.netns], capture_output=True, text=True, timeout=30)
        return [int(p) for p in out.stdout.split()]


@dataclass
class NetCluster:
    """Namespaces, bridge and Ray nodes; ``close`` removes all of it, whatever state it is in."""

    tag: str
    nodes: list[Node] = field(default_factory=list)
    temp_dir: Path | None = None
    _made: list[tuple[str, ...]] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return f"psrhub-{self.tag}"

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def gcs(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    def env(self) -> dict[str, str]:
        # A node whose processes are killed is declared dead after about 3 s of missed health
        # checks (Ray's default is about 30 s).
        return dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                    RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3",
                    RAY_health_check_timeout_ms="1000")

    def exec_argv(self, node: Node, argv: list[str]) -> list[str]:
        """``argv`` run in ``node``'s namespace."""
        return [IP, "netns", "exec", node.netns, *argv]

    def run(self, node: Node, argv: list[str], timeout: float = 120, check: bool = True,
            **kwargs) -> subprocess.CompletedProcess:
        proc = subprocess.run(self.exec_argv(node, argv), capture_output=True, text=True, timeout=timeout,
                              env=kwargs.pop("env", self.env()), **kwargs)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {node.netns} failed ({proc.returncode}):\n"
                               f"{proc.stdout}\n{proc.stderr}")
        return proc

    def make_network(self, count: int, subnet: int) -> None:
        ip("netns", "add", self.hub)
        self._made.append(("netns", "del", self.hub))
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "up")
        ip("-n", self.hub, "link", "set", "lo", "up")
        for i in range(count):
            netns = f"psray-{self.tag}-{i}"
            ip("netns", "add", netns)
            self._made.append(("netns", "del", netns))
            ip("-n", netns, "link", "add", "eth0", "type", "veth", "peer", "name", f"n{i}", "netns", self.hub)
            ip("-n", self.hub, "link", "set", f"n{i}", "master", "br0")
            ip("-n", self.hub, "link", "set", f"n{i}", "up")
            address = f"10.215.{subnet}.{i + 1}"
            ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", netns, "link", "set", "eth0", "up")
            ip("-n", netns, "link", "set", "lo", "up")
            self.nodes.append(Node(i, netns, address, {}, 0))

    def start_ray(self, node: Node, cpus: int, resources: dict[str, float], object_store_mb: int = 128) -> None:
        node.cpus, node.resources = cpus, dict(resources)
        common = ["--node-ip-address", node.address, "--num-cpus", str(cpus), "--num-gpus", "0",
                  "--resources", json.dumps(resources), "--object-store-memory", str(object_store_mb << 20),
                  "--disable-usage-stats", "--temp-dir", str(self.temp_dir / f"n{node.index}")]
        # A temp (session) directory per node, as on separate machines: each node's log monitor
        # streams the logs of its own node's processes only.
        if node.index == 0:
            argv = [RAY, "start", "--head", "--port", str(GCS_PORT), "--include-dashboard", "false", *common]
        else:
            argv = [RAY, "start", "--address", self.gcs, *common]
        self.run(node, argv, timeout=180)

    def restart_node(self, node: Node) -> None:
        """A node killed by ``kill_node`` joins again (a new Ray node on the same address)."""
        self.kill_node(node)
        deadline = time.monotonic() + 30
        while node.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.start_ray(node, node.cpus, node.resources)

    def kill_node(self, node: Node) -> list[int]:
        """Everything in the node's namespace, SIGKILLed: the machine is gone."""
        pids = node.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def close(self) -> None:
        for node in self.nodes:
            self.kill_node(node)
        deadline = time.monotonic() + 30
        while any(n.pids() for n in self.nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        for args in reversed(self._made):
            subprocess.run([IP, *args], capture_output=True, timeout=30)
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def start(nodes: list[tuple[int, dict[str, float]]], subnet: int | None = None) -> NetCluster:
    """A head and further nodes, given as (CPUs, custom resources) each, the head first."""
    pid = os.getpid()
    cluster = NetCluster(tag=f"{pid % 100000}")
    cluster.temp_dir = Path(tempfile.mkdtemp(prefix="psray", dir="/tmp"))
    try:
        cluster.make_network(len(nodes), pid % 250 if subnet is None else subnet)
        for node, (cpus, resources) in zip(cluster.nodes, nodes):
            cluster.start_ray(node, cpus, resources)
    except BaseException:
        cluster.close()
        raise
    return cluster
