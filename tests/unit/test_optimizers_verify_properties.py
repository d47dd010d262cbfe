"""verify, as hypothesis properties over every rule, setting and dtype: it refuses exactly the
updates that would leave a non-finite value (for values from ordinary to the largest finite, and
at the very threshold where apply first overflows), the bound it returns holds and, given back
as known, changes no verdict, and ordinary updates pass it, verify then apply being apply alone.

The examples, one situation each, are in ``test_optimizers_verify``; the helpers they share are
in ``optimizer_cases``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psserver import numerics
from psserver.optimizers import create_update_rule
from pswire.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, DType
from pswire.errors import InvalidArgumentError
from pswire.optim import OptimizerConfig
from tests.unit.optimizer_cases import (
    _ALL_FLOATS,
    _adam_configs,
    _bits,
    _data,
    _decay,
    _expected_message,
    _lr,
    _nonfinite_after_apply,
    _sgd_configs,
    _verify_refusal,
)

pytestmark = pytest.mark.timeout(60)


@st.composite
def _any_configs(draw):
    """Every rule and setting, with learning rates and eps from tiny to large."""
    lr = draw(st.floats(-4, 4).map(lambda e: 10.0**e))
    weight_decay = draw(st.sampled_from([0.0]) | st.floats(0.0, 10.0))
    name = draw(st.sampled_from(["sgd", "adam", "adagrad"]))
    eps = draw(st.floats(-12, 0).map(lambda e: 10.0**e))
    if name == "sgd":
        momentum = draw(st.sampled_from([0.0]) | st.floats(0.0, 1.5))
        nesterov = momentum > 0 and draw(st.booleans())
        dampening = 0.0 if nesterov else draw(st.floats(-1.0, 2.0))
        return OptimizerConfig(
            name=name, lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay
        )
    if name == "adam":
        return OptimizerConfig(
            name=name, lr=lr, beta1=draw(st.floats(0.0, 0.9999)), beta2=draw(st.floats(0.0, 0.9999)),
            eps=eps, weight_decay=weight_decay, amsgrad=draw(st.booleans()),
        )
    return OptimizerConfig(
        name=name, lr=lr, lr_decay=draw(st.floats(0.0, 1.0)), weight_decay=weight_decay, eps=eps,
        initial_accumulator_value=draw(st.floats(0.0, 10.0)),
    )


def _wide_values(rng, dtype: DType, n: int, top: float, *, nonnegative: bool) -> np.ndarray:
    """n values with magnitudes log-uniform over 40 octaves below 2**top (clipped to the
    largest finite), random signs, and a few zeros; sometimes a NaN or an infinity."""
    limit = {FLOAT16: 65504.0, BFLOAT16: 3.3895313892515355e38, FLOAT32: 3.4028234663852886e38,
             FLOAT64: 1.7976931348623157e308}[dtype]
    values = np.exp2(rng.uniform(top - 40, top, n)) * rng.choice([-1.0, 1.0], n)
    if nonnegative and rng.random() < 0.9:
        values = np.abs(values)
    values[rng.random(n) < 0.1] = 0.0
    if rng.random() < 0.05:
        values[rng.integers(n)] = rng.choice([np.nan, np.inf, -np.inf])
    return np.clip(values, -limit, limit).astype(dtype.numpy)


_TOP_EXPONENT = {FLOAT16: 16, BFLOAT16: 128, FLOAT32: 128, FLOAT64: 1024}
_SQUARES = ("exp_avg_sq", "max_exp_avg_sq", "sum")
"""State that the rules keep >= 0 (sums of squares), drawn so but for an occasional negative."""


@settings(max_examples=400, deadline=None, database=None)
@given(
    config=_any_configs(),
    dtype=st.sampled_from(_ALL_FLOATS),
    size=st.integers(1, 150),
    steps=st.integers(0, 4),
    below=st.sampled_from([0, 1, 2, 4, 8, 16, 32, 64]),
    lr_scale=st.sampled_from([1.0, 0.5, 0.01]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_verify_refuses_exactly_the_updates_that_leave_a_non_finite_value(
    config, dtype, size, steps, below, lr_scale, seed
):
    """Over values from ordinary to the largest finite, for every rule, setting and dtype:
    verify refuses if and only if apply would leave a non-finite value, names what and how
    many, changes nothing, and its screen never passes what the exact pass refuses."""
    rng = np.random.default_rng(seed)
    rule = create_update_rule(config, chunk_elements=64)
    top = _TOP_EXPONENT[dtype] - below

    def draw(nonnegative=False):
        return _wide_values(rng, dtype, size, top - float(rng.integers(0, 24)), nonnegative=nonnegative)

    param, grad = draw(), draw()
    state = rule.init_state(param)
    state["step"][...] = steps
    for key in state:
        if key != "step":
            state[key][...] = draw(nonnegative=key in _SQUARES)

    expected = _nonfinite_after_apply(rule, param, grad, state, lr_scale)
    refusal = _verify_refusal(rule, param, grad, state, lr_scale)
    assert refusal == (_expected_message(expected, rule) if expected else None)
    with pytest.MonkeyPatch.context() as patch:  # the exact pass alone agrees
        patch.setattr(rule, "_provably_finite", lambda *args: None)
        assert _verify_refusal(rule, param, grad, state, lr_scale) == refusal


@settings(max_examples=300, deadline=None, database=None)
@given(
    config=_any_configs(),
    dtype=st.sampled_from(_ALL_FLOATS),
    size=st.integers(1, 150),
    below=st.sampled_from([0, 1, 2, 4, 8, 16, 32, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_the_bound_verify_returns_holds_and_known_bounds_change_no_verdict(config, dtype, size, below, seed):
    """Step after step, as a shard runs it: the bound verify returns is at least every
    magnitude of the parameter apply leaves; verify given that bound and the gradient's
    magnitude (``known``, as the shard gives them) refuses exactly what verify reading every
    array refuses, with the same message; and ``magnitude`` is None exactly for a non-finite
    gradient."""
    rng = np.random.default_rng(seed)
    rule = create_update_rule(config, chunk_elements=64)
    top = _TOP_EXPONENT[dtype] - below
    param = _wide_values(rng, dtype, size, top - float(rng.integers(0, 24)), nonnegative=False)
    param[~np.isfinite(param)] = 0
    state = rule.init_state(param)
    largest = None
    for _ in range(4):
        grad = _wide_values(rng, dtype, size, top - float(rng.integers(0, 24)), nonnegative=False)
        grad_largest = numerics.magnitude(grad)
        assert (grad_largest is None) == (not np.isfinite(grad.astype(np.float64)).all())
        if grad_largest is None:
            continue  # a shard refuses it before verify
        known = {"grad": grad_largest, **({"param": largest} if largest is not None else {})}
        refusal = _verify_refusal(rule, param, grad, state)
        try:
            bound = rule.verify(param, grad, state, known=known)
            with_known = None
        except InvalidArgumentError as exc:
            with_known = str(exc)
        assert with_known == refusal
        if refusal is not None:
            continue
        rule.apply(param, grad, state)
        if bound is not None:
            assert float(np.abs(param.astype(np.float64)).max()) <= bound
        largest = bound


@st.composite
def _adagrad_configs(draw):
    return OptimizerConfig(
        name="adagrad",
        lr=draw(_lr),
        lr_decay=draw(st.floats(0.0, 0.1)),
        weight_decay=draw(_decay),
        initial_accumulator_value=draw(st.floats(0.0, 1.0)),
        eps=draw(st.floats(1e-10, 1e-3)),
    )


@settings(max_examples=150, deadline=None, database=None)
@given(
    config=_sgd_configs() | _adam_configs() | _adagrad_configs(),
    dtype=st.sampled_from(_ALL_FLOATS),
    steps=st.integers(1, 5),
    rows=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_ordinary_updates_pass_verify_and_verify_then_apply_is_apply(config, dtype, steps, rows, seed):
    if dtype in (FLOAT16, BFLOAT16):
        # eps must not round to 0 in the parameter's dtype, or a small gradient divides by 0.
        config = dataclasses.replace(config, eps=max(config.eps, 1e-3))
    rule = create_update_rule(config, chunk_elements=64)
    param0, grads = _data((rows, 7), dtype, steps, seed)
    verified, alone = param0.copy(), param0.copy()
    verified_state, alone_state = rule.init_state(verified), rule.init_state(alone)
    for grad in grads:
        rule.verify(verified, grad, verified_state)
        rule.apply(verified, grad, verified_state)
        rule.apply(alone, grad, alone_state)
        assert np.isfinite(verified).all()
    assert _bits(verified, grads[0], verified_state) == _bits(alone, grads[0], alone_state)


@settings(max_examples=200, deadline=None, database=None)
@given(
    config=_any_configs(),
    dtype=st.sampled_from(_ALL_FLOATS),
    size=st.integers(1, 3),
    steps=st.integers(0, 3),
    scaled=st.sampled_from(["grad", "param", "state"]),
    same_signs=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_verify_is_exact_at_the_overflow_threshold(config, dtype, size, steps, scaled, same_signs, seed):
    """Scale one operand up to the very point where apply first overflows (bisection down to
    adjacent representable values), where the screen's bounds are tightest: verify agrees with
    apply on both sides of it."""
    rng = np.random.default_rng(seed)
    rule = create_update_rule(config)

    def draw(nonnegative=False):
        values = np.exp2(rng.uniform(-4, 4, size))
        return values if nonnegative or same_signs else values * rng.choice([-1.0, 1.0], size)

    param, grad = draw(), draw()
    buffers = {key: draw(nonnegative=key in _SQUARES) for key in rule.state_names if key != "step"}
    names = list(buffers)
    target = rng.choice(names) if scaled == "state" and names else scaled
    limit = float(np.finfo(np.float64).max) if dtype == FLOAT64 else 3.4e38

    def arguments(log2_scale):
        def cast(key, values):
            with np.errstate(over="ignore"):  # out-of-range values become inf: no starting point
                if key == target:
                    values = np.clip(values * np.exp2(log2_scale), -limit, limit)
                return np.asarray(values).astype(dtype.numpy)

        state = {"step": np.array(steps, dtype=np.int64)}
        state.update((key, cast(key, values)) for key, values in buffers.items())
        return cast("param", param), cast("grad", grad), state

    def overflows(log2_scale):
        p, g, s = arguments(log2_scale)
        if not all(np.isfinite(a).all() for a in (p, g, *s.values())):
            return None  # not a finite starting point
        return bool(_nonfinite_after_apply(rule, p, g, s))

    low, high = -8.0, float(_TOP_EXPONENT[dtype]) + 8
    while high > low and overflows(high) is None:
        high -= 1.0  # the largest scale that still gives finite operands
    if overflows(low) is not False or not overflows(high):
        low = high = min(low, high)  # no threshold to find: check one point
    for _ in range(80):
        middle = (low + high) / 2
        if middle in (low, high):
            break
        if overflows(middle):
            high = middle
        else:
            low = middle
    for log2_scale in {low, high}:
        p, g, s = arguments(log2_scale)
        expected = _nonfinite_after_apply(rule, p, g, s)
        assert _verify_refusal(rule, p, g, s) == (_expected_message(expected, rule) if expected else None)
