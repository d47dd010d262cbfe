"""docker/'s files agree with the project: the images' requirement files name pyproject.toml's
dependencies with the same specifiers (the server's without torch), and the Dockerfile's targets
run as the unprivileged user. The images themselves are built and run by tests/docker."""

from __future__ import annotations

import re
import tomllib

from tests.conftest import ROOT

DOCKER = ROOT / "docker"


def _requirements(name: str) -> dict[str, str]:
    """``{package: specifier}`` of a requirements file, following its ``-r`` includes."""
    found: dict[str, str] = {}
    for line in (DOCKER / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            found.update(_requirements(line[3:].strip()))
            continue
        package, specifier = re.match(r"([A-Za-z0-9_.-]+)(.*)", line).groups()
        found[_normal(package)] = specifier.replace(" ", "")
    return found


def _normal(package: str) -> str:
    return re.sub(r"[-_.]+", "-", package).lower()


def _pyproject() -> dict[str, str]:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {_normal(m.group(1)): m.group(2).replace(" ", "")
            for m in (re.match(r"([A-Za-z0-9_.-]+)(.*)", d) for d in dependencies)}


def test_the_worker_image_installs_every_dependency_but_torch_with_pyprojects_specifiers():
    expected = {name: spec for name, spec in _pyproject().items() if name != "torch"}
    assert _requirements("requirements-worker.txt") == expected


def test_the_server_image_installs_no_torch_and_nothing_the_shards_do_not_import():
    server = _requirements("requirements-server.txt")
    assert "torch" not in server and "mnist1d" not in server and "tqdm" not in server
    pyproject = _pyproject()
    assert all(pyproject[name] == spec for name, spec in server.items()), (server, pyproject)


def test_every_final_target_runs_as_the_unprivileged_user():
    text = (DOCKER / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    targets = {stage.split()[2]: stage for stage in stages if " AS " in stage.splitlines()[0]}
    assert set(targets) == {"base", "wheel", "server", "worker"}
    for name in ("server", "worker"):
        users = re.findall(r"^USER (\S+)", targets[name], flags=re.M)
        assert users and users[-1] == "psgrpc", (name, users)
    assert text.startswith("#") and "ARG BASE_IMAGE=python:3.11-slim" in text


def test_the_build_context_keeps_out_what_images_do_not_need():
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    rules = [line for line in ignored if line and not line.startswith("#")]
    assert rules[0] == "*", rules  # an allowlist: a .venv or a checkpoint directory never enters a build
    allowed = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    assert {"pswire", "psserver", "psworker", "psbench", "pyproject.toml", "docker/wheels"} <= allowed
