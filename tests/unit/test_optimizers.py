"""Shard update rules against ``torch.optim``'s single-tensor algorithms, step for step.

The rules run in numpy; each test builds the same data as a numpy array for the rule and as a
torch tensor for ``torch.optim`` (the values are identical: both are converted exactly from the
same float64 draws).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psserver import numerics, optimizers
from psserver.optimizers import Adagrad, Adam, Sgd, UpdateRule, create_update_rule
from pswire.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT64, DType, dtype_of
from pswire.errors import InvalidArgumentError
from pswire.optim import OptimizerConfig

pytestmark = pytest.mark.timeout(60)

STEPS = 20
SHAPE = (6, 5)

CASES = {
    "sgd-plain": OptimizerConfig(name="sgd", lr=0.1),
    "sgd-momentum": OptimizerConfig(name="sgd", lr=0.05, momentum=0.9),
    "sgd-nesterov": OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, nesterov=True),
    "sgd-dampening": OptimizerConfig(name="sgd", lr=0.05, momentum=0.8, dampening=0.3),
    "sgd-weight-decay": OptimizerConfig(name="sgd", lr=0.1, weight_decay=0.01),
    "sgd-all": OptimizerConfig(
        name="sgd", lr=0.03, momentum=0.7, nesterov=True, weight_decay=0.02
    ),
    "adam-default": OptimizerConfig(name="adam", lr=1e-3),
    "adam-weight-decay": OptimizerConfig(name="adam", lr=1e-2, weight_decay=0.05),
    "adam-amsgrad": OptimizerConfig(name="adam", lr=1e-2, amsgrad=True),
    "adam-betas": OptimizerConfig(name="adam", lr=3e-3, beta1=0.5, beta2=0.9, eps=1e-6),
    "adam-all": OptimizerConfig(
        name="adam", lr=1e-2, beta1=0.8, beta2=0.95, weight_decay=0.1, amsgrad=True
    ),
    "adagrad-default": OptimizerConfig(name="adagrad", lr=0.01, eps=1e-10),
    "adagrad-lr-decay": OptimizerConfig(name="adagrad", lr=0.05, lr_decay=0.1),
    "adagrad-initial-accumulator": OptimizerConfig(
        name="adagrad", lr=0.05, initial_accumulator_value=0.5
    ),
    "adagrad-weight-decay": OptimizerConfig(name="adagrad", lr=0.05, weight_decay=0.01),
}

_TORCH_DTYPES = {FLOAT32: torch.float32, FLOAT64: torch.float64, FLOAT16: torch.float16, BFLOAT16: torch.bfloat16}

# numpy rounds ``a + alpha * b`` twice where torch's CPU kernels fuse it into one rounding, so a
# float32 or float64 result may differ from torch.optim's in the last bit, and a difference
# carries on into later steps. An atol is needed besides the rtol because an element near zero
# inherits the absolute error of the larger values it was computed from (rtol alone needed
# 1.7e-4 for float32 and 1.6e-12 for float64). The float32 and float64 tolerances are about 8
# units in the last place of a unit-sized value: the worst error measured (CASES at 20 steps
# with 50 seeds, and 3000 examples of the property test) used under 40% of them, while a wrong
# formula is off by percents.
# 16-bit parameters are computed in float32 and rounded after every operation as torch's kernels
# do, so they agree with torch.optim up to an ulp of the 16-bit type: torch.testing.assert_close's
# defaults for those dtypes.
TOLERANCE = {
    FLOAT32: {"rtol": 1e-6, "atol": 1e-6},
    FLOAT64: {"rtol": 2e-15, "atol": 2e-15},
    FLOAT16: {"rtol": 1e-3, "atol": 1e-5},
    BFLOAT16: {"rtol": 1.6e-2, "atol": 1e-5},
}


def _to_torch(array: np.ndarray) -> torch.Tensor:
    """The same values as a torch tensor of the same dtype (exact: every value fits float64)."""
    return torch.from_numpy(array.astype(np.float64)).to(_TORCH_DTYPES[dtype_of(array.dtype)])


def _assert_matches(actual: np.ndarray, expected: torch.Tensor, dtype: DType, what: str) -> None:
    assert actual.dtype == dtype.numpy and actual.shape == tuple(expected.shape), what
    np.testing.assert_allclose(
        actual.astype(np.float64), expected.detach().double().numpy(), **TOLERANCE[dtype], err_msg=what
    )


def _torch_optimizer(config: OptimizerConfig, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if config.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=config.lr,
            momentum=config.momentum,
            dampening=config.dampening,
            nesterov=config.nesterov,
            weight_decay=config.weight_decay,
            foreach=False,
        )
    if config.name == "adam":
        return torch.optim.Adam(
            params,
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
            weight_decay=config.weight_decay,
            amsgrad=config.amsgrad,
            foreach=False,
        )
    return torch.optim.Adagrad(
        params,
        lr=config.lr,
        lr_decay=config.lr_decay,
        weight_decay=config.weight_decay,
        initial_accumulator_value=config.initial_accumulator_value,
        eps=config.eps,
        foreach=False,
    )


def _data(shape, dtype: DType, steps, seed):
    gen = torch.Generator().manual_seed(seed)

    def draw() -> np.ndarray:
        return torch.randn(shape, generator=gen, dtype=torch.float64).numpy().astype(dtype.numpy)

    param = draw()
    return param, [draw() for _ in range(steps)]


def _compare_with_torch(config, dtype=FLOAT32, steps=STEPS, shape=SHAPE, seed=0):
    param0, grads = _data(shape, dtype, steps, seed)
    grads_before = [g.copy() for g in grads]

    reference = _to_torch(param0).requires_grad_(True)
    opt = _torch_optimizer(config, [reference])
    rule = create_update_rule(config)
    param = param0.copy()
    state = rule.init_state(param)
    for grad in grads:
        reference.grad = _to_torch(grad)
        opt.step()
        rule.apply(param, grad, state)

    _assert_matches(param, reference, dtype, "param")
    torch_state = opt.state[reference]
    shared = set(torch_state) & set(state)
    assert shared >= set(state) - {"step"}, f"state names {sorted(state)} vs {sorted(torch_state)}"
    for key in shared - {"step"}:
        _assert_matches(state[key], torch_state[key], dtype, key)
    assert int(state["step"]) == steps
    for before, after in zip(grads_before, grads, strict=True):
        assert np.array_equal(before, after), "apply must not write into the gradient"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT64], ids=str)
def test_matches_torch_optim(case, dtype):
    _compare_with_torch(CASES[case], dtype)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=str)
def test_matches_torch_optim_half_precision(case, dtype):
    # 64 elements, a multiple of the vector width (AVX2 and AVX-512): on a tail shorter than one
    # vector torch's add_ keeps alpha in float32 instead of rounding it to the 16-bit type as its
    # vectorized loop does (and as the rules do), so a small tensor's elements disagree with each
    # other by an ulp.
    _compare_with_torch(CASES[case], dtype, steps=5, shape=(8, 8))


@pytest.mark.parametrize("case", CASES)
def test_row_split_equals_whole(case):
    """Row slices of one array, each with its own state, are updated exactly as the whole array:
    every rule is elementwise and numpy rounds each element alike wherever it lies."""
    config = CASES[case]
    rule = create_update_rule(config)
    whole0, grads = _data((7, 3), FLOAT32, 8, seed=1)
    whole = whole0.copy()
    whole_state = rule.init_state(whole)
    storage = whole0.copy()
    bounds = [(0, 2), (2, 6), (6, 7)]
    slices = [(storage[a:b], rule.init_state(storage[a:b]), a, b) for a, b in bounds]
    for grad in grads:
        rule.apply(whole, grad, whole_state)
        for view, state, a, b in slices:
            rule.apply(view, grad[a:b], state)
    np.testing.assert_array_equal(storage, whole)
    for key in whole_state:
        if key != "step":
            merged = np.concatenate([state[key] for _, state, _, _ in slices])
            np.testing.assert_array_equal(merged, whole_state[key], err_msg=key)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16], ids=str)
def test_sliced_update_equals_whole_bit_for_bit(case, dtype):
    # 37 x 29 = 1073 elements: 16 slices of 64 and a ragged last one.
    param0, grads = _data((37, 29), dtype, 6, seed=2)
    results = []
    for chunk in (64, 1 << 30):
        rule = create_update_rule(CASES[case], chunk_elements=chunk)
        param = param0.copy()
        state = rule.init_state(param)
        for grad in grads:
            rule.apply(param, grad, state)
        results.append((param, state))
    (sliced, sliced_state), (whole, whole_state) = results
    assert sliced.dtype == whole.dtype == dtype.numpy
    assert np.array_equal(sliced, whole)
    assert sliced_state.keys() == whole_state.keys()
    for key in whole_state:
        assert sliced_state[key].dtype == whole_state[key].dtype, key
        assert np.array_equal(sliced_state[key], whole_state[key]), key


@pytest.mark.parametrize("chunk", [0, -64, 100])
def test_chunk_elements_must_be_a_positive_multiple_of_64(chunk):
    with pytest.raises(ValueError, match="multiple of 64"):
        create_update_rule(CASES["adam-default"], chunk_elements=chunk)


@pytest.mark.parametrize("case", CASES)
def test_state_is_named_contiguous_arrays_and_round_trips(case):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    config = CASES[case]
    rule = create_update_rule(config)
    # A transposed view: state must still come out contiguous for safetensors.
    view = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32).T
    state = rule.init_state(view)
    assert tuple(state) == rule.state_names
    assert state["step"].ndim == 0 and state["step"].dtype == np.int64
    for key, value in state.items():
        assert isinstance(value, np.ndarray) and value.flags.c_contiguous, key
        if key != "step":
            assert value.shape == view.shape and value.dtype == view.dtype, key

    # apply itself takes only a C-contiguous parameter (see the test below).
    param = np.ascontiguousarray(view)
    _, grads = _data(param.shape, FLOAT32, 10, seed=2)
    for grad in grads[:5]:
        rule.apply(param, grad, state)
    restored = safetensors_numpy.load(safetensors_numpy.save(state))
    assert set(restored) == set(state)
    restored_param = param.copy()
    for grad in grads[5:]:
        rule.apply(param, grad, state)
        rule.apply(restored_param, grad, restored)
    assert np.array_equal(param, restored_param)
    for key in state:
        assert np.array_equal(state[key], restored[key]), key


@pytest.mark.parametrize("case", ["sgd-plain", "sgd-momentum", "sgd-all", "adam-all", "adagrad-lr-decay"])
def test_lr_scale_half_equals_half_learning_rate(case):
    config = CASES[case]
    halved = dataclasses.replace(config, lr=config.lr / 2)
    param0, grads = _data(SHAPE, FLOAT32, 6, seed=3)
    scaled_param, halved_param = param0.copy(), param0.copy()
    scaled_rule, halved_rule = create_update_rule(config), create_update_rule(halved)
    scaled_state, halved_state = scaled_rule.init_state(scaled_param), halved_rule.init_state(halved_param)
    for grad in grads:
        scaled_rule.apply(scaled_param, grad, scaled_state, lr_scale=0.5)
        halved_rule.apply(halved_param, grad, halved_state)
    # Scaling by 0.5 is exact in binary floating point, so the two runs agree bit for bit.
    assert np.array_equal(scaled_param, halved_param)


@pytest.mark.parametrize("layout", ["read-only", "transposed", "strided"])
def test_apply_refuses_a_read_only_or_non_contiguous_parameter(layout):
    """apply updates in place, so it refuses a parameter it cannot write through as one block,
    and changes nothing: not the parameter, the array it views, nor the state."""
    rule = create_update_rule(CASES["adam-all"])
    base = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    if layout == "read-only":
        param = base.copy()
        param.flags.writeable = False
    elif layout == "transposed":
        param = base.T
    else:
        param = base[:, ::2]
    base_before, param_before = base.copy(), param.copy()
    state = rule.init_state(param)
    state_before = {key: value.copy() for key, value in state.items()}
    with pytest.raises(ValueError, match="writable C-contiguous"):
        rule.apply(param, np.ones(param.shape, dtype=np.float32), state)
    assert np.array_equal(param, param_before)
    assert np.array_equal(base, base_before)
    for key in state:
        assert np.array_equal(state[key], state_before[key]), key


def test_create_update_rule_types():
    assert type(create_update_rule(OptimizerConfig(name="sgd"))) is Sgd
    assert type(create_update_rule(OptimizerConfig(name="adam"))) is Adam
    assert type(create_update_rule(OptimizerConfig(name="adagrad"))) is Adagrad


def test_unknown_optimizer_raises_value_error():
    config = OptimizerConfig(name="sgd")
    # The config validates its name, so forge an invalid one past the frozen dataclass.
    object.__setattr__(config, "name", "rmsprop")
    with pytest.raises(ValueError, match="rmsprop"):
        create_update_rule(config)


def test_rule_refuses_a_config_for_another_optimizer():
    with pytest.raises(ValueError, match="adam"):
        Sgd(OptimizerConfig(name="adam"))


def test_init_state_rejects_integer_parameters():
    with pytest.raises(ValueError, match="floating point"):
        create_update_rule(OptimizerConfig(name="sgd")).init_state(np.zeros(3, dtype=INT64.numpy))


def _bad_apply_cases():
    yield "shape", lambda p, s: (np.zeros((1, 4), dtype=np.float32), s, 1.0)
    yield "dtype", lambda p, s: (np.zeros((3, 4), dtype=np.float64), s, 1.0)
    yield "missing-state", lambda p, s: (np.zeros((3, 4), dtype=np.float32), {"step": s["step"]}, 1.0)
    yield "state-shape", lambda p, s: (
        np.zeros((3, 4), dtype=np.float32),
        {k: (v if k == "step" else np.zeros((6, 3, 4), dtype=np.float32)) for k, v in s.items()},
        1.0,
    )
    for scale in (0.0, -1.0, math.nan, math.inf):
        yield f"lr-scale-{scale}", lambda p, s, scale=scale: (np.zeros((3, 4), dtype=np.float32), s, scale)


@pytest.mark.parametrize("name,make", list(_bad_apply_cases()), ids=[n for n, _ in _bad_apply_cases()])
def test_apply_rejects_bad_input_without_changing_anything(name, make):
    rule = create_update_rule(CASES["adam-all"])
    param = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    state = rule.init_state(param)
    param_before = param.copy()
    grad, bad_state, scale = make(param, state)
    with pytest.raises(ValueError):
        rule.apply(param, grad, bad_state, lr_scale=scale)
    assert np.array_equal(param, param_before)
    assert int(state["step"]) == 0


@pytest.mark.parametrize("module", [optimizers, numerics], ids=lambda m: m.__name__)
def test_module_imports_no_grpc_or_torch_and_exports_what_it_lists(module):
    """The transport hands the rules arrays (no gRPC here), and a shard never imports torch."""
    tree = ast.parse(inspect.getsource(module))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert not any(name.split(".")[0] in ("grpc", "torch") for name in imported), imported
    for name in module.__all__:
        assert hasattr(module, name), name
    assert issubclass(Sgd, UpdateRule)


_lr = st.floats(1e-4, 1.0)
_decay = st.sampled_from([0.0]) | st.floats(0.0, 0.1)


@st.composite
def _sgd_configs(draw):
    momentum = draw(st.sampled_from([0.0]) | st.floats(0.0, 0.99))
    nesterov = momentum > 0 and draw(st.booleans())
    dampening = 0.0 if nesterov else draw(st.floats(0.0, 0.9))
    return OptimizerConfig(
        name="sgd",
        lr=draw(_lr),
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=draw(_decay),
    )


@st.composite
def _adam_configs(draw):
    return OptimizerConfig(
        name="adam",
        lr=draw(_lr),
        beta1=draw(st.floats(0.0, 0.999)),
        beta2=draw(st.floats(0.0, 0.9999)),
        eps=draw(st.floats(1e-10, 1e-3)),
        weight_decay=draw(_decay),
        amsgrad=draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None, database=None)
@given(
    config=_sgd_configs() | _adam_configs(),
    steps=st.integers(1, 6),
    rows=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([FLOAT32, FLOAT64]),
)
def test_property_sgd_and_adam_match_torch(config, steps, rows, seed, dtype):
    _compare_with_torch(config, dtype, steps=steps, shape=(rows, 3), seed=seed)


# -- verify: refusing, before anything changes, an update that would leave a non-finite value --

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

_ALL_FLOATS = [FLOAT32, FLOAT64, FLOAT16, BFLOAT16]


def _copy_state(state):
    return {key: value.copy() for key, value in state.items()}


def _bits(param, grad, state):
    """Everything verify may not change, bit for bit (NaN payloads and -0.0 included)."""
    return [(a.dtype, a.shape, a.tobytes()) for a in (param, grad, *state.values())]


def _nonfinite_after_apply(rule, param, grad, state, lr_scale=1.0):
    """What apply makes non-finite, run on copies: {"param" or state name: element count}."""
    param, state = np.ascontiguousarray(param).copy(), _copy_state(state)
    rule.apply(param, grad, state, lr_scale=lr_scale)
    counts = {"param": int(np.count_nonzero(~np.isfinite(param)))}
    counts.update((key, int(np.count_nonzero(~np.isfinite(value)))) for key, value in state.items() if key != "step")
    return {key: n for key, n in counts.items() if n}


def _verify_refusal(rule, param, grad, state, lr_scale=1.0):
    """None if verify passes, else its message; asserting that it changed nothing."""
    before = _bits(param, grad, state)
    try:
        rule.verify(param, grad, state, lr_scale=lr_scale)
        message = None
    except InvalidArgumentError as exc:
        message = str(exc)
    assert _bits(param, grad, state) == before, "verify changed its arguments"
    return message


def _expected_message(expected, rule):
    what = {"param": "the parameter", **{key: f"state {key!r}" for key in rule.state_names}}
    order = ["param", *rule.state_names]
    return "the update would make " + ", ".join(
        f"{what[key]} non-finite ({expected[key]} element{'s' * (expected[key] > 1)})"
        for key in order
        if key in expected
    )


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


@pytest.mark.parametrize("dtype", _ALL_FLOATS)
@pytest.mark.parametrize("config", [
    OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
    OptimizerConfig(name="adam", lr=0.01, amsgrad=True),
    OptimizerConfig(name="adagrad", lr=0.1),
])
def test_a_large_array_is_updated_and_read_on_several_threads_exactly_as_on_one(monkeypatch, config, dtype):
    """Above PARALLEL_ELEMENTS per thread an update and a magnitude run in ranges on the pool:
    bit for bit what one thread gives, for ranges of unequal lengths, whatever the machine's
    cores."""
    rng = np.random.default_rng(7)
    size = 64 * 37 + 5  # ranges of whole 64-element slices, and a shorter last one
    param = (rng.standard_normal(size) * 3).astype(dtype.numpy)
    grads = [(rng.standard_normal(size) * 2).astype(dtype.numpy) for _ in range(3)]
    results = []
    for threads, parallel in ((1, 1 << 21), (3, 64 * 5)):
        monkeypatch.setattr(numerics, "_THREADS", threads)
        monkeypatch.setattr(numerics, "PARALLEL_ELEMENTS", parallel)
        monkeypatch.setattr(numerics, "CHUNK_ELEMENTS", 64)  # magnitude's slices
        assert len(numerics._ranges(size, 64)) == threads
        rule = create_update_rule(config, chunk_elements=64)
        p, state = param.copy(), rule.init_state(param)
        for grad in grads:
            rule.apply(p, grad, state)
        bad = grads[0].copy()
        bad[832 * 2 - 1] = np.inf  # the last element of the middle range
        results.append((_bits(p, grads[0], state), numerics.magnitude(p), numerics.magnitude(bad)))
    assert results[0] == results[1]
    assert results[1][2] is None


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
