"""verify: refusing, before anything changes, an update that would leave a non-finite value.

Examples, one situation each: gradients that overflow each rule (or only its state, or only an
intermediate), values that are already non-finite, tensors of many slices, read-only and
non-contiguous parameters, malformed input, integer and empty parameters, the cheap screen
settling ordinary updates, and verify's memory. The property tests over all values are in
``test_optimizers_verify_properties``; the helpers they share are in ``optimizer_cases``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from psserver import optimizers
from psserver.optimizers import create_update_rule
from pswire.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT64
from pswire.errors import InvalidArgumentError
from pswire.optim import OptimizerConfig
from tests.unit.optimizer_cases import (
    CASES,
    _ALL_FLOATS,
    _bad_apply_cases,
    _bits,
    _copy_state,
    _data,
    _expected_message,
    _nonfinite_after_apply,
    _verify_refusal,
)

pytestmark = pytest.mark.timeout(60)

_HUGE = {FLOAT32: 3e38, BFLOAT16: 3e38, FLOAT64: 1e308, FLOAT16: 6e4}
"""A finite gradient element that overflows every rule below (float16's largest is 65504)."""

# (config, pushes of the huge gradient applied before verify, what verify must name): each
# gradient below has 3 huge elements among ordinary ones.
OVERFLOWS = {
    # lr * g overflows the parameter itself.
    "sgd-plain": (OptimizerConfig(name="sgd", lr=10.0), 0, {"param": 3}),
    # The first push fits (buf = g); the second accumulates 0.9 g + g past the largest finite.
    "sgd-momentum": (CASES["sgd-momentum"], 1, {"param": 3, "momentum_buffer": 3}),
    # Only an intermediate overflows: buf = g fits, the step g + 0.9 buf does not.
    "sgd-nesterov": (CASES["sgd-nesterov"], 0, {"param": 3}),
    # Only the state overflows: (1 - beta2) * g * g is infinite, and exp_avg / inf moves the
    # parameter by 0. (The product is (0.001 * g) * g: g = 1e20 would still fit float32.)
    "adam-default": (CASES["adam-default"], 0, {"exp_avg_sq": 3}),
    "adam-amsgrad": (CASES["adam-amsgrad"], 0, {"exp_avg_sq": 3, "max_exp_avg_sq": 3}),
    "adagrad-default": (CASES["adagrad-default"], 0, {"sum": 3}),
}


@pytest.mark.parametrize("case", OVERFLOWS)
@pytest.mark.parametrize("dtype", _ALL_FLOATS, ids=str)
def test_verify_refuses_an_overflowing_update_and_changes_nothing(case, dtype):
    config, pushes, expected = OVERFLOWS[case]
    rule = create_update_rule(config)
    param = np.linspace(-2, 2, 12).astype(dtype.numpy)
    grad = np.full(12, 0.5, dtype=dtype.numpy)
    grad[[1, 5, 11]] = [_HUGE[dtype], -_HUGE[dtype], _HUGE[dtype]]
    assert np.isfinite(grad).all()
    state = rule.init_state(param)
    for _ in range(pushes):
        rule.verify(param, grad, state)
        rule.apply(param, grad, state)
    assert _nonfinite_after_apply(rule, param, grad, state) == expected  # the case is what it claims

    message = _verify_refusal(rule, param, grad, state)
    assert message == _expected_message(expected, rule)
    assert int(state["step"]) == pushes


@pytest.mark.parametrize("dtype", _ALL_FLOATS, ids=str)
@pytest.mark.parametrize("what", ["nan-gradient", "inf-gradient", "inf-parameter", "nan-state"])
def test_verify_refuses_what_is_already_non_finite(dtype, what):
    rule = create_update_rule(CASES["adam-default"])
    param, grads = _data((4, 4), dtype, 1, seed=5)
    grad, state = grads[0], rule.init_state(param)
    if what == "nan-gradient":
        grad[1, 2] = np.nan
    elif what == "inf-gradient":
        grad[3, 3] = -np.inf
    elif what == "inf-parameter":
        param[0, 0] = np.inf
    else:
        state["exp_avg"][2, 1] = np.nan
    assert _verify_refusal(rule, param, grad, state) is not None
    assert _nonfinite_after_apply(rule, param, grad, state)


@pytest.mark.parametrize("chunk,size,overflowing", [
    (64, 10_000, [0, 63, 64, 5_000, 9_999]),  # 157 slices, the last one ragged
    (optimizers.CHUNK_ELEMENTS, 3 * optimizers.CHUNK_ELEMENTS + 17, [3 * optimizers.CHUNK_ELEMENTS + 16]),
])
@pytest.mark.parametrize("case", ["sgd-all", "adam-all", "adagrad-weight-decay"])
def test_verify_over_a_tensor_of_many_slices(case, chunk, size, overflowing):
    rule = create_update_rule(CASES[case], chunk_elements=chunk)
    param, grads = _data((size,), FLOAT32, 2, seed=6)
    state = rule.init_state(param)
    rule.apply(param, grads[0], state)

    reference_param, reference_state = param.copy(), _copy_state(state)
    rule.apply(reference_param, grads[1], reference_state)
    rule.verify(param, grads[1], state)  # passes, and verify then apply is apply alone
    rule.apply(param, grads[1], state)
    assert param.tobytes() == reference_param.tobytes()
    assert _bits(param, grads[1], state) == _bits(reference_param, grads[1], reference_state)

    grad = grads[0].copy()
    grad[overflowing] = 3e38
    expected = _nonfinite_after_apply(rule, param, grad, state)
    assert expected and all(n == len(overflowing) for n in expected.values())
    assert _verify_refusal(rule, param, grad, state) == _expected_message(expected, rule)


@pytest.mark.parametrize("layout", ["read-only", "transposed", "strided"])
@pytest.mark.parametrize("huge", [False, True])
@pytest.mark.parametrize("dtype", _ALL_FLOATS, ids=str)
def test_verify_reads_a_read_only_or_non_contiguous_parameter(layout, huge, dtype):
    """The store verifies the value pulls may still hold, and applies to a writable copy."""
    rule = create_update_rule(OptimizerConfig(name="sgd", lr=10.0, momentum=0.5, weight_decay=0.1))
    base = np.random.default_rng(0).standard_normal((6, 8)).astype(dtype.numpy)
    param = {"read-only": base.copy(), "transposed": base.T, "strided": base[:, ::2]}[layout]
    param.flags.writeable = layout != "read-only"
    grad = np.asfortranarray(np.ones(param.shape, dtype=dtype.numpy))  # a non-contiguous gradient too
    if huge:
        grad[0, 1] = _HUGE[dtype]
    state = rule.init_state(param)
    expected = _nonfinite_after_apply(rule, param, grad, state)
    assert bool(expected) == huge
    refusal = _verify_refusal(rule, param, grad, state)
    assert refusal == (_expected_message(expected, rule) if huge else None)


@pytest.mark.parametrize("name,make", list(_bad_apply_cases()), ids=[n for n, _ in _bad_apply_cases()])
def test_verify_rejects_bad_input_as_apply_does(name, make):
    rule = create_update_rule(CASES["adam-all"])
    param = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    state = rule.init_state(param)
    grad, bad_state, scale = make(param, state)
    before = _bits(param, grad, bad_state)
    with pytest.raises(ValueError):
        rule.verify(param, grad, bad_state, lr_scale=scale)
    assert _bits(param, grad, bad_state) == before


def test_verify_checks_nothing_for_an_integer_parameter():
    rule = create_update_rule(OptimizerConfig(name="sgd", lr=1e30))
    param = np.array([2**62, -(2**62)], dtype=INT64.numpy)
    state = {"step": np.zeros((), dtype=np.int64)}
    assert _verify_refusal(rule, param, param.copy(), state) is None


def test_verify_of_an_empty_parameter_passes():
    rule = create_update_rule(CASES["adam-all"])
    param = np.zeros((0, 4), dtype=np.float32)
    assert _verify_refusal(rule, param, param.copy(), rule.init_state(param)) is None


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", _ALL_FLOATS, ids=str)
def test_verify_proves_ordinary_updates_without_the_exact_pass(case, dtype, monkeypatch):
    """The cheap screen (a few reductions) settles ordinary updates; the slice-by-slice pass on
    copies is left for values near the largest finite."""
    config = CASES[case]
    if dtype == FLOAT16 and config.name != "sgd":
        # An eps of 1e-8 or 1e-10 is 0 in float16: the screen has no denominator to bound by.
        config = dataclasses.replace(config, eps=1e-3)
    rule = create_update_rule(config)
    param, grads = _data((37, 29), dtype, 3, seed=7)
    state = rule.init_state(param)
    rule.apply(param, grads[0], state)

    def no_exact_pass(*args, **kwargs):
        raise AssertionError("the screen did not settle an ordinary update")

    monkeypatch.setattr(rule, "_slices", no_exact_pass)
    rule.verify(param, grads[1], state, lr_scale=0.5)


def test_verify_memory_does_not_grow_with_the_tensor():
    """Both the screen and the exact pass hold one slice of scratch, never a copy of the tensor."""
    tracemalloc = pytest.importorskip("tracemalloc")
    rule = create_update_rule(CASES["adam-all"], chunk_elements=4096)
    param = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)  # 4 MiB
    state = rule.init_state(param)
    for grad_value, refused in ((0.5, False), (3e38, True)):  # the screen settles the first only
        grad = np.full(param.shape, grad_value, dtype=np.float32)
        before = _bits(param, grad, state)
        tracemalloc.start()
        try:
            try:
                rule.verify(param, grad, state)
            except InvalidArgumentError:
                assert refused
            else:
                assert not refused
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert _bits(param, grad, state) == before
        assert peak < param.nbytes / 8, f"verify peaked at {peak} bytes for a {param.nbytes}-byte tensor"
