"""The Ray tier's cluster: the README's four Ray nodes (a head and three more), each in its own
network namespace (tests/ray/netcluster.py), started once for the tier."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil

import pytest

from tests.conftest import ROOT
from tests.ray import netcluster

CPUS = 2
"""Logical CPUs of each test node (a shard or worker asks for 1; the machine's cores are shared)."""


def readme_block() -> str:
    """The README's Ray block: its ``ray start`` and ``pscluster --ray`` lines are what the tier runs."""
    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    found = [b for b in blocks if "pscluster --ray" in b]
    assert len(found) == 1, "the README has no (or more than one) block with pscluster --ray"
    return found[0]


def readme_nodes() -> list[dict[str, float]]:
    """The custom resources of each node the README starts, the head first; a line under a
    comment naming several machines ("machines B and C") starts one node per machine."""
    nodes: list[dict[str, float]] = []
    machines = 1
    for line in readme_block().splitlines():
        if line.startswith("#"):
            named = re.search(r"machines? ([A-Z](?:, [A-Z])*(?: and [A-Z])?)", line)
            machines = len(re.findall(r"\b[A-Z]\b", named[1])) if named else 1
        elif " ray start " in f" {line} " or line.startswith(".venv/bin/ray start"):
            argv = shlex.split(line)
            resources = json.loads(argv[argv.index("--resources") + 1])
            nodes += [resources] * machines
    return nodes


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
    nodes = readme_nodes()
    assert len(nodes) == 4, f"the README's Ray block starts {len(nodes)} nodes; the tier expects 4: {nodes}"
    cluster = netcluster.start([(CPUS, resources) for resources in nodes])
    try:
        yield cluster
    finally:
        cluster.close()
