"""The generated code matches proto/, and the public surfaces are what they claim."""

import subprocess
import sys
from pathlib import Path

import pytest

import psworker
from pswire import gen
from psworker import client, shard

pytestmark = pytest.mark.timeout(120)


def test_generated_code_matches_proto():
    assert gen.check() == [], "run python -m pswire.gen and commit the result"


def test_psworker_public_surface():
    for name in psworker.__all__:
        assert hasattr(psworker, name), name
    assert set(psworker.__all__) >= {"connect", "Session", "DistributedOptimizer", "Task", "load_task"}


def test_client_and_shard_public_surface():
    for module in (client, shard):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"
    assert set(client.__all__) == {"ClientOptions", "PSClient", "ShardClient", "parse_addresses"}
    assert set(shard.__all__) >= {"ClientOptions", "ShardClient", "parse_addresses"}
    for name in set(client.__all__) & set(shard.__all__):  # re-exported, not copies
        assert getattr(client, name) is getattr(shard, name), name


def test_the_shard_and_the_wire_package_never_import_torch():
    """A shard holds numpy arrays: importing everything psserver and pswire have must not load
    torch (it alone makes a process about 200 MiB resident; see docs/benchmarks.md, check 5)."""
    modules = sorted(
        f"{package}.{path.stem}"
        for package in ("psserver", "pswire")
        for path in (Path(__file__).parents[2] / package).glob("*.py")
        if path.stem != "__main__"
    )
    assert "psserver.main" in modules and "pswire.codec" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"torch was imported: {done.stdout.strip()[:300]}"
