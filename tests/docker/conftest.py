"""The docker tier's engine and images, set up once for the tier (tests/docker/engine.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.docker.engine import BASE_IMAGE, Engine, project, requirements


@pytest.fixture(scope="session")
def engine():
    requirements()
    directory = Path(tempfile.mkdtemp(prefix="psgrpc-docker-"))
    started = Engine.start(directory)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="session")
def built(engine):
    """A project copy whose images (server, worker and the test's Prometheus) are built."""
    workdir = Path(tempfile.mkdtemp(prefix="psgrpc-project-", dir=engine.directory))
    try:
        copy = project(workdir)
        engine.build_prometheus_image()
        engine.docker("compose", "-f", "docker/compose.yaml", "build", cwd=copy, timeout=900,
                      env={"BASE_IMAGE": BASE_IMAGE})
        yield copy
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    # The tier is long (an engine, images, six clusters): it runs in .ci/run and on request,
    # after every other test, so that a failure elsewhere is reported first.
    tier = [item for item in items if "tests/docker/" in str(item.fspath).replace(os.sep, "/")]
    rest = [item for item in items if item not in tier]
    items[:] = rest + tier
