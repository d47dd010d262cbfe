"""What a result was measured on: software versions, CPU model, core count and load.

Host names, user names and paths are left out on purpose: the JSON is meant to be pasted into
issues and docs.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

__all__ = ["describe", "load_average", "source_state"]

_SOURCE_ROOT = Path(__file__).resolve().parent.parent
_PRODUCT_PATHS = ("psserver", "psworker", "pswire", "proto")

_DISTRIBUTIONS = {
    "torch": "torch",
    "grpcio": "grpcio",
    "protobuf": "protobuf",
    "numpy": "numpy",
    "psgrpc": "psgrpc",
}


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the platform has none. A load above
    the core count during a run means other processes took CPU time from the measurement."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=_SOURCE_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def source_state() -> dict:
    """The commit of the code measured and the product files that differ from it: figures move
    with every transport change, so a result names the code it came from. ``None`` values
    outside a git checkout."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--", *_PRODUCT_PATHS)
    return {
        "commit": commit.strip() if commit else None,
        "modified_files": sorted(line[3:] for line in status.splitlines()) if status is not None else None,
    }


def describe() -> dict:
    """Versions, CPU and cores of this machine (no host name)."""
    return {
        "python": platform.python_version(),
        **{name: _version(dist) for name, dist in _DISTRIBUTIONS.items()},
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count() or 1,
        "usable_cores": _usable_cores(),
        "source": source_state(),
    }
