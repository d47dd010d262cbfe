"""Validation helpers of psserver.job."""

import pytest
import torch

from pswire.codec import Part
from pswire.errors import InvalidArgumentError
from psserver.job import check_finite

PART = Part("v", (4,), torch.float32, 0, 4)


@pytest.mark.parametrize("values", [[1.0, 2.0, 3.0, 4.0], [3e38, 3e38, 3e38, -1.0], [-3e38, -3e38, 0.0, 0.0]])
def test_finite_values_pass_even_when_their_sum_overflows(values):
    check_finite(PART, torch.tensor(values), "gradient")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_any_nan_or_inf_is_refused_naming_the_variable(bad):
    with pytest.raises(InvalidArgumentError, match="gradient for 'v' contains NaN or Inf"):
        check_finite(PART, torch.tensor([1.0, bad, 3e38, 3e38]), "gradient")


def test_inf_and_minus_inf_together_are_refused():
    with pytest.raises(InvalidArgumentError):
        check_finite(PART, torch.tensor([float("inf"), float("-inf"), 0.0, 0.0]), "gradient")
