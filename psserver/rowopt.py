"""Row-wise update rules for embedding tables: SGD, Adagrad and lazy Adam on the rows a push touches.

A push to a table carries distinct row ids with their summed gradients; the store gathers those
rows' values and optimizer state, asks :meth:`RowRule.compute` for their new values and state, checks
every result is finite, and only then scatters them back, so a push applies whole or not at all.
``compute`` therefore returns new arrays and never writes its inputs.

Each rule follows ``torch.optim`` in torch 2.13 with a sparse gradient (``nn.Embedding(sparse=True)``)
operation for operation, in numpy, for float32 tables:

* ``sgd``: ``torch.optim.SGD`` without momentum, ``param.add_(grad, alpha=-lr)``;
* ``adagrad``: the sparse branch of ``torch.optim.Adagrad``'s single-tensor algorithm (learning-rate
  decay, ``initial_accumulator_value``, ``eps`` as given);
* ``adam``: ``torch.optim.SparseAdam`` (lazy Adam: the moments of rows without a gradient do not
  decay, and bias correction uses the table's step count).

Momentum, weight decay and AMSGrad are refused (``ValueError``): momentum on rows would need every
row's buffer decayed every step, and torch refuses the other two with sparse gradients.

Rounding: each torch operation on float32 is one float32 operation here, with the scalars it takes
rounded to float32 as torch's kernels round them. Where torch adds a sparse tensor with a
non-unit ``alpha`` into a dense one, its CPU kernel (``axpy``) computes ``x + alpha * y`` with a
fused multiply-add, rounded once; that is computed here in float64 (the product of two float32
values is exact there) and rounded to float32, which gives the same result except when the float64
sum lands exactly halfway between two float32 values (double rounding: about one element in 2**29).
Square roots are correctly rounded here, as numpy computes them; torch 2.13's CPU float32
``sqrt`` (the x86 wheel, with MKL) was off by one ulp for about one value in six when measured, so
Adagrad's and Adam's new values may differ from torch's by an ulp, while their state (which takes
no square root) agrees bit for bit.

A gradient torch holds uncoalesced (repeated row ids, as ``nn.Embedding`` produces) is summed
first by Adagrad and SparseAdam, as here; plain SGD instead adds each repeat into the row in turn,
so for a row with repeats in one batch SGD differs from this rule by the rounding of that sum.

This module imports numpy only (no torch, no gRPC).
"""

from __future__ import annotations

import abc
import math
import operator
from typing import ClassVar

import numpy as np

from pswire.optim import OptimizerConfig

__all__ = ["RowAdagrad", "RowAdam", "RowRule", "RowSgd", "create_row_rule"]

_FLOAT32 = np.dtype(np.float32)


def _f32(value: float) -> np.float32:
    """A Python scalar as torch's float32 kernels take it: rounded to float32."""
    return np.float32(value)


def _fused_add(x: np.ndarray, alpha: np.float32, y: np.ndarray) -> np.ndarray:
    """``x + alpha * y`` rounded once to float32, as torch's ``axpy`` (a fused multiply-add)
    computes ``dense.add_(sparse, alpha=alpha)``: in float64 the product is exact, and the sum is
    rounded to float64 and then to float32 (see the module's note on double rounding)."""
    # float64(alpha) * y, then + x, computed in float64 with one temporary (x and y widened as
    # they are read): the same roundings as widening both first.
    out = np.multiply(y, np.float64(alpha), dtype=np.float64)
    np.add(out, x, out=out)
    return out.astype(_FLOAT32)


def _describe(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype}{list(a.shape)}"
    return type(a).__name__


class RowRule(abc.ABC):
    """One optimizer's update of a table's rows, given the rows a push touches.

    A rule holds only its immutable config; the per-row state lives in arrays the caller keeps
    (``fresh_state`` makes it for new rows), so one rule serves every table sharing the config.
    """

    name: ClassVar[str]
    """The ``OptimizerConfig.name`` this rule implements."""
    state_names: tuple[str, ...]
    """The per-row buffers: one ``(rows, dim)`` float32 array each, in this order."""

    def __init__(self, config: OptimizerConfig) -> None:
        """Raises ``ValueError`` if ``config`` is for another optimizer or asks for a setting rows
        do not support (momentum, weight decay, AMSGrad), naming it."""
        if config.name != self.name:
            raise ValueError(f"{type(self).__name__} cannot run optimizer {config.name!r}")
        if config.weight_decay != 0:
            raise ValueError(
                f"weight_decay={config.weight_decay} is not applied to table rows (torch refuses weight decay "
                "with sparse gradients too); use weight_decay=0"
            )
        self.config = config

    def _initial_value(self, name: str) -> float:
        return 0.0

    def fresh_state(self, rows: int, dim: int) -> dict[str, np.ndarray]:
        """The initial state of ``rows`` rows: a C-contiguous float32 ``(rows, dim)`` array per
        name of ``state_names`` (zeros, or Adagrad's ``initial_accumulator_value``)."""
        rows, dim = operator.index(rows), operator.index(dim)
        if rows < 0 or dim < 0:
            raise ValueError(f"rows and dim must be >= 0, got {rows} and {dim}")
        return {key: np.full((rows, dim), self._initial_value(key), dtype=_FLOAT32) for key in self.state_names}

    def compute(
        self,
        values: np.ndarray,
        grads: np.ndarray,
        state: dict[str, np.ndarray],
        step: int,
        lr_scale: float = 1.0,
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The new values and state of ``n`` distinct rows after one step.

        ``values`` and ``grads``: float32 ``(n, dim)``, the rows' values and summed gradients;
        ``state``: the same rows' buffers, one float32 ``(n, dim)`` array per name of
        ``state_names``; ``step``: the table's step count for this update, from 1 (torch's
        per-parameter ``state["step"]`` after its increment); the learning rate is
        ``config.lr * lr_scale``. ``n == 0`` is valid and gives empty arrays.

        Returns new C-contiguous float32 arrays (the values and a dict of the state buffers);
        the inputs are only read, never written. Values may overflow to infinities, as in torch:
        the caller checks the results before writing them back.

        Raises ``ValueError`` if an array is not float32 ``(n, dim)`` matching ``values``, if
        ``state`` lacks a buffer or holds an unknown one, if ``step`` is not an integer >= 1, or if
        ``lr_scale`` is not finite and > 0 (or ``config.lr * lr_scale`` overflows).
        """
        step, lr = self._check(values, grads, state, step, lr_scale)
        with np.errstate(all="ignore"):  # as in torch, an overflow gives Inf without a warning
            new_values, new_state = self._compute(values, grads, state, step, lr)
        return (np.ascontiguousarray(new_values),
                {key: np.ascontiguousarray(new_state[key]) for key in self.state_names})

    def _check(self, values, grads, state, step, lr_scale) -> tuple[int, float]:
        """The step as an int and the learning rate, once the arguments are valid."""
        if not (isinstance(values, np.ndarray) and values.dtype == _FLOAT32 and values.ndim == 2):
            raise ValueError(f"row values must be a float32 (n, dim) array, got {_describe(values)}")
        if not (isinstance(grads, np.ndarray) and grads.dtype == _FLOAT32 and grads.shape == values.shape):
            # Without this check a (1, dim) gradient would broadcast over every row.
            raise ValueError(f"row gradients {_describe(grads)} do not match row values {_describe(values)}")
        if not isinstance(state, dict):
            raise ValueError(f"{self.name} state must be a dict of arrays, got {type(state).__name__}")
        missing = [key for key in self.state_names if key not in state]
        if missing:
            raise ValueError(f"{self.name} state lacks {', '.join(map(repr, missing))}")
        unknown = sorted(map(str, set(state) - set(self.state_names)))
        if unknown:
            raise ValueError(f"{self.name} state has unknown buffers {', '.join(map(repr, unknown))}")
        for key in self.state_names:
            buf = state[key]
            if not (isinstance(buf, np.ndarray) and buf.dtype == _FLOAT32 and buf.shape == values.shape):
                raise ValueError(
                    f"{self.name} state {key!r} is {_describe(buf)}, the row values are {_describe(values)}"
                )
        if isinstance(step, bool):
            raise ValueError(f"step must be an integer >= 1, got {step!r}")
        try:
            step = operator.index(step)
        except TypeError:
            raise ValueError(f"step must be an integer >= 1, got {step!r}") from None
        if step < 1:
            raise ValueError(f"step must be an integer >= 1, got {step}")
        if not (isinstance(lr_scale, (int, float, np.floating, np.integer)) and not isinstance(lr_scale, bool)
                and math.isfinite(lr_scale) and lr_scale > 0):
            raise ValueError(f"lr_scale must be finite and > 0, got {lr_scale!r}")
        # A Python float: a numpy float32 lr_scale would make the learning rate float32 too.
        # Times exactly 1.0 leaves lr unchanged.
        lr = self.config.lr * float(lr_scale)
        if not math.isfinite(lr):
            raise ValueError(f"the learning rate {self.config.lr} * lr_scale {lr_scale} overflows")
        return step, lr

    @abc.abstractmethod
    def _compute(
        self, values: np.ndarray, grads: np.ndarray, state: dict[str, np.ndarray], step: int, lr: float
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The step proper on valid arguments: new arrays only, inputs never written."""


class RowSgd(RowRule):
    """``torch.optim.SGD`` without momentum: ``param.add_(grad, alpha=-lr)``."""

    name = "sgd"
    state_names = ()

    def __init__(self, config: OptimizerConfig) -> None:
        super().__init__(config)
        if config.momentum != 0:
            raise ValueError(
                f"momentum={config.momentum} is not applied to table rows (every row's buffer would decay every "
                "step); use momentum=0, or adagrad or adam (lazy Adam, as torch.optim.SparseAdam)"
            )

    def _compute(self, values, grads, state, step, lr):
        return _fused_add(values, _f32(-lr), grads), {}


class RowAdagrad(RowRule):
    """``torch.optim.Adagrad`` with a sparse gradient: the sum of squares, its square root plus
    ``eps``, and the learning rate decayed by the step count.

    ``OptimizerConfig.eps`` defaults to 1e-8 while ``torch.optim.Adagrad`` uses 1e-10; the
    config's value is used as given.
    """

    name = "adagrad"
    state_names = ("sum",)

    def _initial_value(self, name):
        # torch.full_like(p, initial_accumulator_value): the value rounded to float32.
        return self.config.initial_accumulator_value

    def _compute(self, values, grads, state, step, lr):
        cfg = self.config
        clr = lr / (1 + (step - 1) * cfg.lr_decay)
        # state_sum.add_(grad_values.pow(2)) at the rows: alpha 1, so the add is rounded once anyway.
        new_sum = state["sum"] + grads * grads
        # std_values = state_sum.sparse_mask(grad)._values().sqrt_().add_(eps)
        std = np.sqrt(new_sum)
        std += _f32(cfg.eps)
        # param.add_(grad_values / std_values, alpha=-clr)
        return _fused_add(values, _f32(-clr), grads / std), {"sum": new_sum}


class RowAdam(RowRule):
    """``torch.optim.SparseAdam``: lazy Adam on the rows with a gradient."""

    name = "adam"
    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, config: OptimizerConfig) -> None:
        super().__init__(config)
        if config.amsgrad:
            raise ValueError("amsgrad=True is not available for table rows (as in torch.optim.SparseAdam); "
                             "use amsgrad=False")

    def _compute(self, values, grads, state, step, lr):
        cfg = self.config
        beta1, beta2 = cfg.beta1, cfg.beta2
        old_exp_avg, old_exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # exp_avg_update_values = grad_values.sub(old_exp_avg_values).mul_(1 - beta1)
        exp_avg_update = grads - old_exp_avg
        exp_avg_update *= _f32(1 - beta1)
        # exp_avg.add_(make_sparse(exp_avg_update_values)); numer is the same sum.
        exp_avg = old_exp_avg + exp_avg_update
        # exp_avg_sq_update_values = grad_values.pow(2).sub_(old_exp_avg_sq_values).mul_(1 - beta2)
        exp_avg_sq_update = grads * grads
        exp_avg_sq_update -= old_exp_avg_sq
        exp_avg_sq_update *= _f32(1 - beta2)
        exp_avg_sq = old_exp_avg_sq + exp_avg_sq_update
        # denom = exp_avg_sq_update_values.add_(old).sqrt_().add_(eps)
        denom = np.sqrt(exp_avg_sq)
        denom += _f32(cfg.eps)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr * math.sqrt(bias_correction2) / bias_correction1
        # param.add_(make_sparse(-step_size * numer.div_(denom))): alpha 1.
        update = exp_avg / denom
        update *= _f32(-step_size)
        return values + update, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


_RULES: dict[str, type[RowRule]] = {rule.name: rule for rule in (RowSgd, RowAdagrad, RowAdam)}


def create_row_rule(config: OptimizerConfig) -> RowRule:
    """The row rule for ``config``.

    Raises ``ValueError`` if ``config.name`` names no row rule, or for settings rows do not
    support (SGD momentum, weight decay, AMSGrad), naming the setting.
    """
    try:
        rule = _RULES[config.name]
    except KeyError:
        raise ValueError(f"no row rule for optimizer {config.name!r}; known: {', '.join(sorted(_RULES))}") from None
    return rule(config)
