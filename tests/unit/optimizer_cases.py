"""Shared by the update rules' tests (``test_optimizers_rules``, ``test_optimizers_verify`` and
``test_optimizers_verify_properties``): the optimizer configurations they run, data drawn alike
for a rule and for ``torch.optim``, malformed ``apply`` arguments, hypothesis strategies of SGD
and Adam configurations, and the helpers that run ``apply`` and ``verify`` on copies and compare
what they leave bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import strategies as st

from pswire.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, DType
from pswire.errors import InvalidArgumentError
from pswire.optim import OptimizerConfig

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


def _data(shape, dtype: DType, steps, seed):
    gen = torch.Generator().manual_seed(seed)

    def draw() -> np.ndarray:
        return torch.randn(shape, generator=gen, dtype=torch.float64).numpy().astype(dtype.numpy)

    param = draw()
    return param, [draw() for _ in range(steps)]


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
