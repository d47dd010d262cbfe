"""Validation helpers of psserver.job."""

import numpy as np
import pytest

from pswire.codec import Part
from pswire.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT64, DType
from pswire.errors import InvalidArgumentError
from psserver.job import check_finite

PART = Part("v", (4,), FLOAT32, 0, 4)

# Per floating dtype: the largest finite value, whose sum of four overflows in that dtype.
LARGEST = {FLOAT32: 3e38, FLOAT64: 1.7e308, FLOAT16: 65504.0, BFLOAT16: 3.3e38}


def _array(dtype: DType, values) -> np.ndarray:
    return np.array(values, dtype=np.float64).astype(dtype.numpy)


@pytest.mark.parametrize("values", [[1.0, 2.0, 3.0, 4.0], [3e38, 3e38, 3e38, -1.0], [-3e38, -3e38, 0.0, 0.0]])
def test_finite_values_pass_even_when_their_sum_overflows(values):
    check_finite(PART, np.array(values, dtype=np.float32), "gradient")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_any_nan_or_inf_is_refused_naming_the_variable(bad):
    with pytest.raises(InvalidArgumentError, match="gradient for 'v' contains NaN or Inf"):
        check_finite(PART, np.array([1.0, bad, 3e38, 3e38], dtype=np.float32), "gradient")


def test_inf_and_minus_inf_together_are_refused():
    with pytest.raises(InvalidArgumentError):
        check_finite(PART, np.array([float("inf"), float("-inf"), 0.0, 0.0], dtype=np.float32), "gradient")


@pytest.mark.parametrize("dtype", list(LARGEST), ids=str)
def test_every_floating_dtype_passes_finite_values_and_refuses_nan_or_inf(dtype):
    """float16/bfloat16 (checked through their bits) behave as float32 does: the largest finite
    values pass even where their sum overflows, and any NaN, Inf or -Inf is refused."""
    part = Part("v", (2, 3), dtype, 0, 2)
    big = LARGEST[dtype]
    good = _array(dtype, [[big, big, big], [-big, -big, 0.0]])
    assert np.isfinite(good.astype(np.float64)).all()
    check_finite(part, good, "gradient")
    check_finite(part, _array(dtype, [[-0.0, 1e-40, 1.0], [-1.0, 0.5, 2.0]]), "gradient")  # zeros, subnormals
    for bad in (float("nan"), -float("nan"), float("inf"), float("-inf")):
        value = good.copy()
        value[1, 2] = bad
        with pytest.raises(InvalidArgumentError, match="gradient for 'v' contains NaN or Inf"):
            check_finite(part, value, "gradient")


@pytest.mark.parametrize(
    ("dtype", "one", "bits"),
    [(FLOAT16, 0x3C00, b) for b in (0x7C01, 0xFE00, 0x7FFF)] + [(BFLOAT16, 0x3F80, b) for b in (0x7F81, 0xFFC0, 0x7FFF)],
    ids=lambda v: hex(v) if isinstance(v, int) else str(v),
)
def test_16_bit_nans_with_any_payload_are_refused(dtype, one, bits):
    part = Part("v", (3,), dtype, 0, 3)
    value = np.array([one, bits, 0x0000], dtype=np.uint16).view(dtype.numpy)
    with pytest.raises(InvalidArgumentError):
        check_finite(part, value, "value")


def test_integer_values_are_not_checked():
    check_finite(Part("v", (2,), INT64, 0, 2), np.array([np.iinfo(np.int64).max] * 2), "value")
