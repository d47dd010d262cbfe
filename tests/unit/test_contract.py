"""The generated code matches proto/, and the public surfaces are what they claim."""

import pytest

import psworker
from pswire import gen

pytestmark = pytest.mark.timeout(120)


def test_generated_code_matches_proto():
    assert gen.check() == [], "run python -m pswire.gen and commit the result"


def test_psworker_public_surface():
    for name in psworker.__all__:
        assert hasattr(psworker, name), name
    assert set(psworker.__all__) >= {"connect", "Session", "DistributedOptimizer", "Task", "load_task"}
