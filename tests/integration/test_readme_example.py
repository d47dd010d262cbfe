"""The README's Python API example is the file it shows, and it runs against real shards."""

import re

import pytest

from tests.conftest import ROOT, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_readme_shows_the_example_verbatim():
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "examples" / "existing_loop.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert example in blocks


def test_example_trains_against_two_shards(shards):
    a, b = shards(2)
    proc = run_cli("examples.existing_loop", f"{a.address},{b.address}", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = float(re.search(r"final loss (\S+)", proc.stdout).group(1))
    assert final < 0.1, proc.stdout
