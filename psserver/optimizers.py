"""Shard-side update rules: SGD, Adam and Adagrad, applied in place to one array at a time.

Each rule follows the single-tensor (``foreach=False``) algorithm of ``torch.optim`` in torch
2.13 operation for operation, in numpy, so that a parameter updated on a shard agrees with one
updated locally up to the rounding of its dtype: torch's CPU kernels fuse ``a + alpha * b`` into
one rounding (a fused multiply-add) where numpy rounds twice, so float32 results may differ in
the last bit. A shard imports no torch, which keeps its resident size to its variables (torch
alone makes a process about 200 MiB resident).

16-bit parameters are computed in float32 and rounded to their own dtype after every operation,
as torch's kernels do. Every rule is elementwise, so a tensor split into row slices, each with
its own state, is updated exactly as the whole tensor would be.

Arrays are updated in slices of ``CHUNK_ELEMENTS``: the temporaries a rule needs (``lr * grad``,
Adam's denominator, a weight-decayed gradient) then cost one slice, not a second copy of the
variable, and each slice stays in cache across the rule's several passes.

Optimizer state is a flat ``dict[str, numpy.ndarray]`` with stable names (``step``,
``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``sum``) and contiguous
arrays only, so a shard can checkpoint it as safetensors without conversion.

This module imports no gRPC: the transport hands it arrays and takes its errors.
"""

from __future__ import annotations

import abc
import math
from typing import ClassVar

import numpy as np

from pswire.dtypes import dtype_of
from pswire.errors import InvalidArgumentError
from pswire.optim import OptimizerConfig

__all__ = ["CHUNK_ELEMENTS", "Adagrad", "Adam", "Sgd", "UpdateRule", "create_update_rule"]

CHUNK_ELEMENTS = 1 << 16
"""Elements per slice of an update (256 KiB of float32): its temporaries stay below glibc's
mmap threshold, so they are reused heap memory rather than fresh pages faulted in per slice."""

_FLOAT32 = np.dtype(np.float32)


def _is_float(dtype: np.dtype) -> bool:
    try:
        return dtype_of(dtype).is_floating_point
    except InvalidArgumentError:
        return False


class _Rounding:
    """Rounds results computed in a wider dtype to the storage dtype after each operation."""

    def __init__(self, storage: np.dtype) -> None:
        self.storage = storage
        self.needed = storage.itemsize < 4
        self._scalar = np.float64 if storage.itemsize == 8 else np.float32
        self._alpha = np.float32 if storage.itemsize == 4 else storage.type

    def s(self, value: float) -> float:
        """A scalar operand as torch hands it to a kernel: in float32 unless the storage is float64."""
        return float(self._scalar(value))

    def alpha(self, value: float) -> float:
        """The ``alpha`` of torch's ``add_``: rounded to the storage dtype (float64 stays)."""
        return float(self._alpha(value))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.needed:
            x[...] = x.astype(self.storage)
        return x


class UpdateRule(abc.ABC):
    """One optimizer's update of a single parameter (or row slice of one) and its state.

    A rule holds only its immutable config; all mutable state lives in the dict returned by
    :meth:`init_state`, so one rule object can serve every parameter of a shard concurrently
    as long as callers do not update the same parameter from two threads at once.
    """

    name: ClassVar[str]
    """The ``OptimizerConfig.name`` this rule implements."""
    state_names: tuple[str, ...]
    """The keys of the dict :meth:`init_state` returns for this config."""

    def __init__(self, config: OptimizerConfig, *, chunk_elements: int = CHUNK_ELEMENTS) -> None:
        if config.name != self.name:
            raise ValueError(f"{type(self).__name__} cannot run optimizer {config.name!r}")
        if chunk_elements < 1 or chunk_elements % 64:
            raise ValueError(f"chunk_elements must be a positive multiple of 64, got {chunk_elements}")
        self.config = config
        self.chunk_elements = chunk_elements

    def init_state(self, param: np.ndarray) -> dict[str, np.ndarray]:
        """Fresh state for ``param``: contiguous arrays of its shape and dtype, plus an int64 ``step``.

        Raises ``ValueError`` if ``param`` is not a floating-point array.
        """
        if not _is_float(param.dtype):
            raise ValueError(f"parameters must be floating point, got {param.dtype}")
        # int64 rather than torch's float32: exact past 2**24 steps.
        state = {"step": np.zeros((), dtype=np.int64)}
        state.update(self._init_buffers(param))
        return state

    def apply(
        self,
        param: np.ndarray,
        grad: np.ndarray,
        state: dict[str, np.ndarray],
        *,
        lr_scale: float = 1.0,
    ) -> None:
        """Apply one step to ``param`` and ``state`` in place, with learning rate ``lr * lr_scale``.

        ``grad`` is only read, never written, so it may be a view of a reused receive buffer.
        ``lr_scale=1.0`` is ``torch.optim``'s step.

        Raises ``ValueError`` if ``grad`` does not match ``param`` in shape or dtype, if
        ``param`` is not C-contiguous, if ``state`` lacks a buffer this rule needs or holds one
        of another shape or dtype, or if ``lr_scale`` is not finite and > 0; nothing has
        changed then.
        """
        if grad.shape != param.shape or grad.dtype != param.dtype:
            # Without this check a (1, n) gradient would silently broadcast over an (m, n) param.
            raise ValueError(
                f"gradient {grad.dtype}{list(grad.shape)} does not match parameter {param.dtype}{list(param.shape)}"
            )
        if not (param.flags.c_contiguous and param.flags.writeable):
            raise ValueError("parameter must be a writable C-contiguous array")
        missing = [key for key in self.state_names if key not in state]
        if missing:
            raise ValueError(f"{self.name} state lacks {', '.join(missing)}")
        names = [key for key in self.state_names if key != "step"]
        for key in names:
            # Broadcasting would let a larger or smaller buffer absorb the step.
            buf = state[key]
            if (buf.shape != param.shape or buf.dtype != param.dtype or not buf.flags.c_contiguous
                    or not buf.flags.writeable):
                raise ValueError(f"{self.name} state {key!r} is {buf.dtype}{list(buf.shape)}")
        if not (math.isfinite(lr_scale) and lr_scale > 0):
            raise ValueError(f"lr_scale must be finite and > 0, got {lr_scale}")
        # Multiplying by exactly 1.0 leaves lr unchanged.
        lr = self.config.lr * lr_scale
        state["step"][...] += 1
        step = int(state["step"])
        rounding = _Rounding(param.dtype)
        with np.errstate(all="ignore"):  # as in torch, an overflow gives Inf without a warning
            self._slices(param, grad, state, names, lr, step, rounding)

    def _slices(self, param, grad, state, names, lr, step, rounding) -> None:
        flat = [a.reshape(-1) for a in (param, grad, *(state[key] for key in names))]
        chunk = self.chunk_elements
        for start in range(0, param.size, chunk):
            p, g, *rest = (a[start:start + chunk] for a in flat)
            if rounding.needed:
                # Work on float32 copies of the slice; each result is rounded as it is made, so
                # writing them back is exact.
                work = [x.astype(_FLOAT32) for x in (p, *rest)]
                self._update(work[0], g.astype(_FLOAT32), dict(zip(names, work[1:])), lr, step, rounding)
                for dst, src in zip((p, *rest), work):
                    dst[...] = src
            else:
                self._update(p, g, dict(zip(names, rest)), lr, step, rounding)

    @abc.abstractmethod
    def _init_buffers(self, param: np.ndarray) -> dict[str, np.ndarray]:
        """The per-element buffers of a fresh state (everything but ``step``)."""

    @abc.abstractmethod
    def _update(
        self,
        param: np.ndarray,
        grad: np.ndarray,
        state: dict[str, np.ndarray],
        lr: float,
        step: int,
        r: _Rounding,
    ) -> None:
        """The step proper on one flat slice (``state`` holds the same slice of each buffer, and
        no ``step``); ``step`` counts from 1. ``r(x)`` rounds ``x`` in place to the parameter's
        dtype; the arrays are float32 or float64 and must not be replaced, only written."""

    def _with_weight_decay(self, param: np.ndarray, grad: np.ndarray, r: _Rounding) -> np.ndarray:
        # A fresh array rather than grad +=: the caller's gradient buffer stays untouched.
        if self.config.weight_decay != 0:
            return r(grad + r.alpha(self.config.weight_decay) * param)
        return grad


def _zeros(param: np.ndarray) -> np.ndarray:
    return np.zeros(param.shape, dtype=param.dtype)


class Sgd(UpdateRule):
    """``torch.optim.SGD``: momentum, dampening, Nesterov and L2 weight decay."""

    name = "sgd"

    def __init__(self, config: OptimizerConfig, *, chunk_elements: int = CHUNK_ELEMENTS) -> None:
        super().__init__(config, chunk_elements=chunk_elements)
        self.state_names = ("step", "momentum_buffer") if config.momentum != 0 else ("step",)

    def _init_buffers(self, param):
        return {"momentum_buffer": _zeros(param)} if self.config.momentum != 0 else {}

    def _update(self, param, grad, state, lr, step, r):
        cfg = self.config
        d_p = self._with_weight_decay(param, grad, r)
        if cfg.momentum != 0:
            buf = state["momentum_buffer"]
            if step == 1:
                # torch starts the buffer as a copy of the first gradient, without dampening.
                buf[...] = d_p
            else:
                buf *= r.s(cfg.momentum)
                r(buf)
                buf += r.alpha(1 - cfg.dampening) * d_p
                r(buf)
            d_p = r(d_p + r.alpha(cfg.momentum) * buf) if cfg.nesterov else buf
        param += r.alpha(-lr) * d_p
        r(param)


class Adam(UpdateRule):
    """``torch.optim.Adam``: bias correction, L2 weight decay added to the gradient, AMSGrad."""

    name = "adam"

    def __init__(self, config: OptimizerConfig, *, chunk_elements: int = CHUNK_ELEMENTS) -> None:
        super().__init__(config, chunk_elements=chunk_elements)
        self.state_names = ("step", "exp_avg", "exp_avg_sq") + (
            ("max_exp_avg_sq",) if config.amsgrad else ()
        )

    def _init_buffers(self, param):
        return {key: _zeros(param) for key in self.state_names if key != "step"}

    def _update(self, param, grad, state, lr, step, r):
        cfg = self.config
        beta1, beta2 = cfg.beta1, cfg.beta2
        grad = self._with_weight_decay(param, grad, r)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # exp_avg.lerp_(grad, 1 - beta1), with torch's two formulas for small and large weights.
        weight = 1 - beta1
        if abs(weight) < 0.5:
            exp_avg += r.s(weight) * (grad - exp_avg)
        else:
            exp_avg[...] = grad - (grad - exp_avg) * r.s(1 - weight)
        r(exp_avg)
        exp_avg_sq *= r.s(beta2)
        r(exp_avg_sq)
        exp_avg_sq += r.s(1 - beta2) * grad * grad
        r(exp_avg_sq)

        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5

        if cfg.amsgrad:
            max_exp_avg_sq = state["max_exp_avg_sq"]
            np.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            second_moment = max_exp_avg_sq
        else:
            second_moment = exp_avg_sq
        denom = r(np.sqrt(second_moment))
        denom /= r.s(bias_correction2_sqrt)
        r(denom)
        denom += r.s(cfg.eps)
        r(denom)
        param += r.s(-step_size) * exp_avg / denom
        r(param)


class Adagrad(UpdateRule):
    """``torch.optim.Adagrad``: learning-rate decay, L2 weight decay, initial accumulator.

    Note that ``OptimizerConfig.eps`` defaults to 1e-8 while ``torch.optim.Adagrad`` uses 1e-10;
    the config's value is used as given.
    """

    name = "adagrad"
    state_names = ("step", "sum")

    def _init_buffers(self, param):
        return {"sum": np.full(param.shape, self.config.initial_accumulator_value, dtype=param.dtype)}

    def _update(self, param, grad, state, lr, step, r):
        cfg = self.config
        grad = self._with_weight_decay(param, grad, r)
        clr = lr / (1 + (step - 1) * cfg.lr_decay)
        state_sum = state["sum"]
        state_sum += grad * grad
        r(state_sum)
        std = r(np.sqrt(state_sum))
        std += r.s(cfg.eps)
        r(std)
        param += r.s(-clr) * grad / std
        r(param)


_RULES: dict[str, type[UpdateRule]] = {rule.name: rule for rule in (Sgd, Adam, Adagrad)}


def create_update_rule(config: OptimizerConfig, *, chunk_elements: int = CHUNK_ELEMENTS) -> UpdateRule:
    """The update rule for ``config``, updating large arrays ``chunk_elements`` at a time.

    Raises ``ValueError`` if ``config.name`` names no implemented optimizer, or if
    ``chunk_elements`` is not a positive multiple of 64.
    """
    try:
        rule = _RULES[config.name]
    except KeyError:
        raise ValueError(
            f"no update rule for optimizer {config.name!r}; known: {', '.join(sorted(_RULES))}"
        ) from None
    return rule(config, chunk_elements=chunk_elements)
