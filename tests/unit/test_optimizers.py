"""Shard update rules against ``torch.optim``'s single-tensor algorithms, step for step."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psserver import optimizers
from psserver.optimizers import Adagrad, Adam, Sgd, UpdateRule, create_update_rule
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

TIGHT = {torch.float32: {"rtol": 1e-6, "atol": 1e-7}, torch.float64: {"rtol": 1e-13, "atol": 1e-15}}


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # Half types fall back to assert_close's per-dtype defaults.
    return TIGHT.get(dtype, {})


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


def _data(shape, dtype, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(steps)]
    return param, grads


def _compare_with_torch(config, dtype=torch.float32, steps=STEPS, shape=SHAPE, seed=0):
    param0, grads = _data(shape, dtype, steps, seed)
    grads_before = [g.clone() for g in grads]

    reference = param0.clone().requires_grad_(True)
    opt = _torch_optimizer(config, [reference])
    rule = create_update_rule(config)
    param = param0.clone()
    state = rule.init_state(param)
    for grad in grads:
        reference.grad = grad.clone()
        opt.step()
        rule.apply(param, grad, state)

    tol = _tolerance(dtype)
    torch.testing.assert_close(param, reference.detach(), **tol)
    torch_state = opt.state[reference]
    shared = set(torch_state) & set(state)
    assert shared >= set(state) - {"step"}, f"state names {sorted(state)} vs {sorted(torch_state)}"
    for key in shared - {"step"}:
        torch.testing.assert_close(state[key], torch_state[key], **tol, msg=key)
    assert int(state["step"]) == steps
    for before, after in zip(grads_before, grads, strict=True):
        assert torch.equal(before, after), "apply must not write into the gradient"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_matches_torch_optim(case, dtype):
    _compare_with_torch(CASES[case], dtype)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_matches_torch_optim_half_precision(case, dtype):
    _compare_with_torch(CASES[case], dtype, steps=5)


@pytest.mark.parametrize("case", CASES)
def test_row_split_equals_whole(case):
    config = CASES[case]
    rule = create_update_rule(config)
    whole0, grads = _data((7, 3), torch.float32, 8, seed=1)
    whole = whole0.clone()
    whole_state = rule.init_state(whole)
    storage = whole0.clone()
    bounds = [(0, 2), (2, 6), (6, 7)]
    slices = [(storage[a:b], rule.init_state(storage[a:b]), a, b) for a, b in bounds]
    for grad in grads:
        rule.apply(whole, grad, whole_state)
        for view, state, a, b in slices:
            rule.apply(view, grad[a:b], state)
    torch.testing.assert_close(storage, whole, **TIGHT[torch.float32])
    for key in whole_state:
        if key != "step":
            merged = torch.cat([state[key] for _, state, _, _ in slices])
            torch.testing.assert_close(merged, whole_state[key], **TIGHT[torch.float32])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sliced_update_equals_whole_bit_for_bit(case, dtype):
    # 37 x 29 = 1073 elements: 16 slices of 64 and a ragged last one.
    param0, grads = _data((37, 29), dtype, 6, seed=2)
    results = []
    for chunk in (64, 1 << 30):
        rule = create_update_rule(CASES[case], chunk_elements=chunk)
        param = param0.clone()
        state = rule.init_state(param)
        for grad in grads:
            rule.apply(param, grad, state)
        results.append((param, state))
    (sliced, sliced_state), (whole, whole_state) = results
    assert torch.equal(sliced, whole)
    assert sliced_state.keys() == whole_state.keys()
    for key in whole_state:
        assert torch.equal(sliced_state[key], whole_state[key]), key


@pytest.mark.parametrize("chunk", [0, -64, 100])
def test_chunk_elements_must_be_a_positive_multiple_of_64(chunk):
    with pytest.raises(ValueError, match="multiple of 64"):
        create_update_rule(CASES["adam-default"], chunk_elements=chunk)


@pytest.mark.parametrize("case", CASES)
def test_state_is_named_contiguous_tensors_and_round_trips(case):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    config = CASES[case]
    rule = create_update_rule(config)
    # A transposed view: state must still come out contiguous for safetensors.
    param = torch.randn(5, 4).t()
    state = rule.init_state(param)
    assert tuple(state) == rule.state_names
    assert state["step"].dim() == 0 and state["step"].dtype == torch.int64
    for key, value in state.items():
        assert isinstance(value, torch.Tensor) and value.is_contiguous(), key
        if key != "step":
            assert value.shape == param.shape and value.dtype == param.dtype, key

    _, grads = _data(param.shape, torch.float32, 10, seed=2)
    for grad in grads[:5]:
        rule.apply(param, grad, state)
    restored = safetensors_torch.load(safetensors_torch.save(state))
    assert set(restored) == set(state)
    restored_param = param.clone()
    for grad in grads[5:]:
        rule.apply(param, grad, state)
        rule.apply(restored_param, grad, restored)
    assert torch.equal(param, restored_param)
    for key in state:
        assert torch.equal(state[key], restored[key]), key


@pytest.mark.parametrize("case", ["sgd-plain", "sgd-momentum", "sgd-all", "adam-all", "adagrad-lr-decay"])
def test_lr_scale_half_equals_half_learning_rate(case):
    config = CASES[case]
    halved = dataclasses.replace(config, lr=config.lr / 2)
    param0, grads = _data(SHAPE, torch.float32, 6, seed=3)
    scaled_param, halved_param = param0.clone(), param0.clone()
    scaled_rule, halved_rule = create_update_rule(config), create_update_rule(halved)
    scaled_state, halved_state = scaled_rule.init_state(scaled_param), halved_rule.init_state(halved_param)
    for grad in grads:
        scaled_rule.apply(scaled_param, grad, scaled_state, lr_scale=0.5)
        halved_rule.apply(halved_param, grad, halved_state)
    # Scaling by 0.5 is exact in binary floating point, so the two runs agree bit for bit.
    assert torch.equal(scaled_param, halved_param)


def test_apply_works_on_a_leaf_that_requires_grad():
    rule = create_update_rule(CASES["adam-default"])
    param = torch.zeros(3, requires_grad=True)
    rule.apply(param, torch.ones(3), rule.init_state(param))
    assert torch.all(param < 0) and param.grad is None


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
        create_update_rule(OptimizerConfig(name="sgd")).init_state(torch.zeros(3, dtype=torch.int64))


def _bad_apply_cases():
    yield "shape", lambda p, s: (torch.zeros(1, 4), s, 1.0)
    yield "dtype", lambda p, s: (torch.zeros(3, 4, dtype=torch.float64), s, 1.0)
    yield "missing-state", lambda p, s: (torch.zeros(3, 4), {"step": s["step"]}, 1.0)
    yield "state-shape", lambda p, s: (
        torch.zeros(3, 4),
        {k: (v if k == "step" else torch.zeros(6, 3, 4)) for k, v in s.items()},
        1.0,
    )
    for scale in (0.0, -1.0, math.nan, math.inf):
        yield f"lr-scale-{scale}", lambda p, s, scale=scale: (torch.zeros(3, 4), s, scale)


@pytest.mark.parametrize("name,make", list(_bad_apply_cases()), ids=[n for n, _ in _bad_apply_cases()])
def test_apply_rejects_bad_input_without_changing_anything(name, make):
    rule = create_update_rule(CASES["adam-all"])
    param = torch.randn(3, 4)
    state = rule.init_state(param)
    param_before = param.clone()
    grad, bad_state, scale = make(param, state)
    with pytest.raises(ValueError):
        rule.apply(param, grad, bad_state, lr_scale=scale)
    assert torch.equal(param, param_before)
    assert int(state["step"]) == 0


def test_module_imports_no_grpc_and_exports_what_it_lists():
    tree = ast.parse(inspect.getsource(optimizers))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert not any(name.split(".")[0] == "grpc" for name in imported), imported
    for name in optimizers.__all__:
        assert hasattr(optimizers, name), name
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
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_property_sgd_and_adam_match_torch(config, steps, rows, seed, dtype):
    _compare_with_torch(config, dtype, steps=steps, shape=(rows, 3), seed=seed)
