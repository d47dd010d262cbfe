"""The Ray tier's cluster: a head and two nodes, each in its own network namespace
(tests/ray/netcluster.py), started once for the tier."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

from tests.ray import netcluster

NODES = [
    (2, {"ps_shard": 1, "ps_worker": 1}),  # head
    (2, {"ps_shard": 1, "ps_worker": 1}),
    (1, {"ps_worker": 1}),  # a node with one worker and no shard: the one the tests take away
]
"""(CPUs, custom resources) of each node. The jobs ask for ps_shard per shard and ps_worker per
worker, so that where everything may land is known: a shard on each of the first two nodes, and
a worker slot on each node."""


def requirements() -> None:
    """Fail (CI) or skip (elsewhere) unless this machine can run the tier."""
    problem = None
    if importlib.util.find_spec("ray") is None:
        problem = "ray is not installed (scripts/setup.sh --test installs it)"
    elif os.geteuid() != 0:
        problem = "the Ray tier puts each Ray node in a network namespace, which needs root"
    elif shutil.which("ip") is None:
        problem = "no `ip` command: iproute2 is not installed"
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)


@pytest.fixture(scope="session")
def ray_cluster():
    requirements()
    cluster = netcluster.start(NODES)
    try:
        yield cluster
    finally:
        cluster.close()
