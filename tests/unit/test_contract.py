"""The generated code matches proto/, and the public surfaces are what they claim."""

import subprocess
import sys
from pathlib import Path

import pytest

import psworker
from pswire import gen
from psworker import admin, channel, client, exchange, options, shard

pytestmark = pytest.mark.timeout(120)


def test_generated_code_matches_proto():
    assert gen.check() == [], "run python -m pswire.gen and commit the result"


def test_psworker_public_surface():
    for name in psworker.__all__:
        assert hasattr(psworker, name), name
    assert set(psworker.__all__) >= {"connect", "Session", "DistributedOptimizer", "Task", "load_task"}
    assert set(psworker.__all__) <= set(dir(psworker))
    from psworker.api import connect

    assert psworker.connect is connect  # imported on first use, the very function
    with pytest.raises(AttributeError, match="has no attribute 'nonesuch'"):
        psworker.nonesuch


def test_client_and_shard_public_surface():
    for module in (client, shard):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"
    assert set(client.__all__) == {"ClientOptions", "DataRider", "PSClient", "ROWS_PER_CALL", "ShardClient",
                                   "parse_addresses"}
    assert set(shard.__all__) >= {"ClientOptions", "ShardClient", "parse_addresses"}
    for name in set(client.__all__) & set(shard.__all__):  # re-exported, not copies
        assert getattr(client, name) is getattr(shard, name), name
    for module in (admin, channel, exchange, options):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"
    # The worker's clients are the operator's ones that also move tensors.
    assert issubclass(shard.ShardClient, channel.ShardChannel) and issubclass(client.PSClient, admin.AdminClient)
    assert shard.ClientOptions is options.ClientOptions is psworker.ClientOptions


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


def test_psctl_and_the_operator_client_never_import_torch():
    """psctl runs in the server image, which has no torch: importing it, the admin client and the
    torch-free names of ``psworker`` must not load torch, while a name that needs torch still
    loads it on first use."""
    code = (
        "import sys\n"
        "import psworker, psworker.ctl, psworker.admin, psworker.channel, psworker.options, psworker.retry\n"
        "psworker.ClientOptions(security=psworker.ClientSecurity(token='t' * 16)); psworker.PSError\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
        "psworker.connect\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "True"], f"torch was imported: {done.stdout.strip()[:300]}"
