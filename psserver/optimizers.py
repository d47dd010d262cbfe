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

Arrays are updated a slice at a time, on several threads when large; that machinery, the
magnitudes :meth:`UpdateRule.verify` reads, and the bounds and rounding it and the rules use
live in ``psserver.numerics``, which depends on no optimizer.

Optimizer state is a flat ``dict[str, numpy.ndarray]`` with stable names (``step``,
``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``sum``) and contiguous
arrays only, so a shard can checkpoint it as safetensors without conversion.

:meth:`UpdateRule.verify` tells, changing nothing, whether :meth:`UpdateRule.apply` with the
same arguments would leave the parameter and its state finite, so that a shard can refuse a push
of several parts whole before applying any of them.

This module imports no gRPC: the transport hands it arrays and takes its errors.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator, Mapping
from typing import ClassVar

import numpy as np

from pswire.errors import InvalidArgumentError
from pswire.optim import OptimizerConfig
from psserver.numerics import (
    CHUNK_ELEMENTS, _Bounds, _Rounding, _each, _flat_slicer, _is_float, _largest_magnitude, _ranges,
)

__all__ = ["CHUNK_ELEMENTS", "Adagrad", "Adam", "Sgd", "UpdateRule", "create_update_rule"]

_FLOAT32 = np.dtype(np.float32)


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
        ``lr_scale=1.0`` is ``torch.optim``'s step. Values may overflow to infinities, as in
        torch; :meth:`verify` first to refuse such an update.

        Raises ``ValueError`` if ``grad`` does not match ``param`` in shape or dtype, if
        ``param`` is not C-contiguous, if ``state`` lacks a buffer this rule needs or holds one
        of another shape or dtype, or if ``lr_scale`` is not finite and > 0; nothing has
        changed then.
        """
        names, lr = self._check_arguments(param, grad, state, lr_scale, writing=True)
        state["step"][...] += 1
        step = int(state["step"])
        rounding = _Rounding(param.dtype)

        def update(start: int, stop: int) -> None:
            with np.errstate(all="ignore"):  # as in torch, an overflow gives Inf without a warning
                for _ in self._slices(param, grad, state, names, lr, step, rounding, in_place=True, span=(start, stop)):
                    pass

        _each(update, _ranges(param.size, self.chunk_elements))

    def verify(
        self,
        param: np.ndarray,
        grad: np.ndarray,
        state: dict[str, np.ndarray],
        *,
        lr_scale: float = 1.0,
        known: Mapping[str, float] | None = None,
    ) -> float | None:
        """Check, changing nothing, that :meth:`apply` with the same arguments would leave
        ``param`` and every state buffer finite (no NaN, no infinity).

        Exact: it passes if and only if that ``apply`` would give finite values only, for it
        either proves overflow impossible from the largest magnitudes of the operands (no copy,
        a few integer reductions) or, when it cannot, runs the rule's own arithmetic on copies of
        one slice at a time (one slice of scratch per buffer). A parameter or state already
        non-finite fails, as ``apply`` would leave it so. ``param`` is only read, so it may be
        read-only or non-contiguous. Parameters that are not floating point are not checked.

        ``known`` spares reading an operand: upper bounds on the magnitudes of ``"param"``'s
        and ``"grad"``'s elements, each known finite (a shard keeps the bound this method
        returned for a variable, and reads a gradient's once, as it checks it for NaN). A bound
        too loose to prove the update finite is not trusted to refuse it: the arrays are read.

        Returns an upper bound on the magnitudes of ``param``'s elements after that ``apply``
        when the proof from magnitudes settled it, else None (and None for a parameter that is
        empty or not floating point).

        Raises ``InvalidArgumentError`` naming the parameter and the state buffers that would
        become non-finite, and how many elements of each; ``ValueError`` for the arguments that
        ``apply`` refuses (a read-only or non-contiguous ``param`` excepted) and for a ``known``
        bound that is not finite and >= 0 or names another operand; nothing has changed either way.
        """
        names, lr = self._check_arguments(param, grad, state, lr_scale, writing=False)
        for key, bound in (known or {}).items():
            if key not in ("param", "grad") or not (math.isfinite(bound) and bound >= 0):
                raise ValueError(f"a known magnitude must be of 'param' or 'grad', finite and >= 0: {key!r} {bound!r}")
        if param.size == 0 or not _is_float(param.dtype):
            return None
        after = state["step"].copy()  # the very arithmetic of apply's count, on a copy
        after[...] += 1
        step = int(after)
        rounding = _Rounding(param.dtype)
        with np.errstate(all="ignore"):
            bound = self._provably_finite(param, grad, state, names, lr, step, rounding, known or {})
            if bound is None and known:
                bound = self._provably_finite(param, grad, state, names, lr, step, rounding, {})
            if bound is not None:
                return bound
            bad = [0] * (1 + len(names))
            for work in self._slices(param, grad, state, names, lr, step, rounding, in_place=False):
                for i, values in enumerate(work):
                    finite = np.isfinite(values)
                    if not finite.all():
                        bad[i] += values.size - int(np.count_nonzero(finite))
        if any(bad):
            what = ["the parameter", *(f"state {key!r}" for key in names)]
            raise InvalidArgumentError(
                "the update would make "
                + ", ".join(f"{w} non-finite ({n} element{'s' * (n > 1)})" for w, n in zip(what, bad) if n)
            )
        return None

    def _check_arguments(self, param, grad, state, lr_scale, *, writing) -> tuple[list[str], float]:
        """The names of the state buffers to update and the learning rate, once the arguments
        are valid (raises ``ValueError`` otherwise); ``writing``: ``param`` too must be."""
        if grad.shape != param.shape or grad.dtype != param.dtype:
            # Without this check a (1, n) gradient would silently broadcast over an (m, n) param.
            raise ValueError(
                f"gradient {grad.dtype}{list(grad.shape)} does not match parameter {param.dtype}{list(param.shape)}"
            )
        if writing and not (param.flags.c_contiguous and param.flags.writeable):
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
        return names, self.config.lr * lr_scale

    def _slices(
        self, param, grad, state, names, lr, step, rounding, *, in_place, span: tuple[int, int] | None = None,
    ) -> Iterator[list[np.ndarray]]:
        """Update slice by slice; yield each slice's new values of ``param`` and of the buffers
        in ``names``, in that order. ``in_place``: written to the arrays; otherwise computed on
        copies of the slice (scratch reused across slices) and the arrays left untouched.
        ``span``: the flat elements ``[start, stop)`` only (default: all)."""
        chunk = self.chunk_elements
        slicers = [_flat_slicer(a) for a in (param, grad, *(state[key] for key in names))]
        scratch = []
        if not (in_place or rounding.needed):
            # One block rather than one array per buffer: separate slice-sized arrays left glibc's
            # heap trimmed and faulted in again on every slice (Adam's pass on copies took 4x
            # apply's time; one block, 1.3x).
            scratch = list(np.empty((1 + len(names), min(chunk, param.size)), dtype=param.dtype))
        first, last = span or (0, param.size)
        for start in range(first, last, chunk):
            p, g, *rest = (slicer(start, min(start + chunk, last)) for slicer in slicers)
            if rounding.needed:
                # Work on float32 copies of the slice; each result is rounded as it is made, so
                # writing them back is exact.
                work = [x.astype(_FLOAT32) for x in (p, *rest)]
                g = g.astype(_FLOAT32)
            elif in_place:
                work = [p, *rest]
            else:
                work = [buf[:p.size] for buf in scratch]
                for dst, src in zip(work, (p, *rest)):
                    dst[...] = src
            self._update(work[0], g, dict(zip(names, work[1:])), lr, step, rounding)
            if in_place and rounding.needed:
                for dst, src in zip((p, *rest), work):
                    dst[...] = src
            yield work

    _nonnegative: ClassVar[tuple[str, ...]] = ()
    """State buffers whose square root the rule takes: the screen needs them >= 0."""

    def _provably_finite(self, param, grad, state, names, lr, step, rounding, known) -> float | None:
        """A bound on the updated parameter's magnitudes if the update cannot give a non-finite
        value, judged from the largest magnitude of each operand (``known`` ones not read);
        None when that does not settle it (exactness is then for :meth:`_slices` on copies)."""
        largest = dict(known)
        for key, array in (("param", param), ("grad", grad), *((key, state[key]) for key in names)):
            if key in largest:
                continue
            magnitude, negative = _largest_magnitude(array, self.chunk_elements)
            if magnitude is None or (negative and key in self._nonnegative):
                return None  # a NaN or infinity already, or a square root of a negative
            largest[key] = magnitude
        bounds = _Bounds(param.dtype)
        bound = self._bound_update(largest, lr, step, rounding, bounds)
        return bound if bound is not None and bounds.ok else None

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

    @abc.abstractmethod
    def _bound_update(
        self, largest: dict[str, float], lr: float, step: int, r: _Rounding, b: _Bounds
    ) -> float | None:
        """:meth:`_update` on magnitudes: given upper bounds on the largest ``|x|`` of
        ``param``, ``grad`` and each state buffer, pass every value it computes, mirroring its
        operations and the very constants it uses, through ``b.up``, and return the bound of
        the updated parameter. Return None where a finite result needs more than those bounds (a
        denominator that may be zero); finite results are then proven if ``b.ok`` stays true,
        since only an overflow, a division by zero or the square root of a negative makes a NaN
        or an infinity from finite operands. Every operation is monotonic in its operands'
        magnitudes, so looser bounds in give a looser bound out, never a smaller one."""

    def _bound_weight_decay(self, largest: dict[str, float], r: _Rounding, b: _Bounds) -> float:
        if self.config.weight_decay != 0:
            return b.up(largest["grad"] + b.up(abs(r.alpha(self.config.weight_decay)) * largest["param"]))
        return largest["grad"]

    def _smallest_denominator(self, r: _Rounding) -> float:
        # denom = r(x + eps) with x >= 0 (or +inf): rounding is monotonic, so denom >= r(eps).
        # A 16-bit denominator is summed in float32 and then rounded.
        eps = np.asarray(r.s(self.config.eps), dtype=_FLOAT32 if r.needed else r.storage)
        return float(eps.astype(r.storage))

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

    def _bound_update(self, largest, lr, step, r, b):
        cfg = self.config
        d_p = self._bound_weight_decay(largest, r, b)
        if cfg.momentum != 0:
            if step == 1:
                buf = d_p
            else:
                buf = b.up(
                    b.up(largest["momentum_buffer"] * abs(r.s(cfg.momentum)))
                    + b.up(abs(r.alpha(1 - cfg.dampening)) * d_p)
                )
            d_p = b.up(d_p + b.up(abs(r.alpha(cfg.momentum)) * buf)) if cfg.nesterov else buf
        return b.up(largest["param"] + b.up(abs(r.alpha(-lr)) * d_p))


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

    _nonnegative = ("exp_avg_sq",)

    def _bound_update(self, largest, lr, step, r, b):
        cfg = self.config
        beta1, beta2 = cfg.beta1, cfg.beta2
        grad = self._bound_weight_decay(largest, r, b)
        exp_avg = largest["exp_avg"]
        difference = b.up(grad + exp_avg)
        weight = 1 - beta1
        if abs(weight) < 0.5:
            exp_avg = b.up(exp_avg + b.up(abs(r.s(weight)) * difference))
        else:
            exp_avg = b.up(grad + b.up(difference * abs(r.s(1 - weight))))
        # exp_avg_sq = beta2 * v + (1 - beta2) * g * g stays >= 0 from v >= 0 (beta2 in [0, 1)),
        # and so does max_exp_avg_sq = max(finite, exp_avg_sq): no square root of a negative.
        b.up(b.up(largest["exp_avg_sq"] * abs(r.s(beta2))) + b.up(b.up(abs(r.s(1 - beta2)) * grad) * grad))
        step_size = lr / (1 - beta1**step)
        denominator = self._smallest_denominator(r)
        if not (denominator > 0 and r.s((1 - beta2**step) ** 0.5) > 0):
            return None  # 0 / 0 is possible
        # An infinite denominator only sends a finite quotient to 0.
        return b.up(largest["param"] + b.up(b.up(abs(r.s(-step_size)) * exp_avg) / denominator))


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

    _nonnegative = ("sum",)

    def _bound_update(self, largest, lr, step, r, b):
        cfg = self.config
        grad = self._bound_weight_decay(largest, r, b)
        clr = lr / (1 + (step - 1) * cfg.lr_decay)
        b.up(largest["sum"] + b.up(grad * grad))  # >= 0 from sum >= 0
        denominator = self._smallest_denominator(r)
        if not denominator > 0:
            return None
        return b.up(largest["param"] + b.up(b.up(abs(r.s(-clr)) * grad) / denominator))


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
