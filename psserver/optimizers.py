"""Shard-side update rules: SGD, Adam and Adagrad, applied in place to one tensor at a time.

Each rule reproduces the single-tensor (``foreach=False``) algorithm of ``torch.optim`` in
torch 2.13, operation for operation, so that a parameter updated on a shard agrees with one
updated locally up to the rounding of its dtype (bit for bit on CPU in practice). Every rule is
elementwise, so a tensor split into row slices, each with its own state, is updated exactly as
the whole tensor would be.

A large tensor is updated in slices of ``CHUNK_ELEMENTS`` (a multiple of every SIMD width, so
each element still takes the same path through torch's kernels): the temporaries a rule needs
(Adam's denominator, a weight-decayed gradient) then cost one slice, not a second copy of the
variable, and each slice stays in cache across the rule's several passes.

Optimizer state is a flat ``dict[str, torch.Tensor]`` with stable names (``step``,
``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``sum``) and contiguous
tensors only, so a shard can checkpoint it as safetensors without conversion.

This module imports no gRPC: the transport hands it tensors and takes its errors.
"""

from __future__ import annotations

import abc
import math
from typing import ClassVar

import torch

from pswire.optim import OptimizerConfig

__all__ = ["CHUNK_ELEMENTS", "Adagrad", "Adam", "Sgd", "UpdateRule", "create_update_rule"]

CHUNK_ELEMENTS = 1 << 18
"""Elements per slice of an update (1 MiB of float32)."""


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
        self.single_pass = False
        """True when the update is one in-place op with no temporary: slicing would only add calls."""

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fresh state for ``param``: contiguous tensors on its device, plus an int64 ``step``.

        Raises ``ValueError`` if ``param`` is not a floating-point tensor.
        """
        if not param.is_floating_point():
            raise ValueError(f"parameters must be floating point, got {param.dtype}")
        # int64 rather than torch's float32: exact past 2**24 steps, and still a plain tensor.
        state = {"step": torch.zeros((), dtype=torch.int64)}
        state.update(self._init_buffers(param))
        return state

    def apply(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        *,
        lr_scale: float = 1.0,
    ) -> None:
        """Apply one step to ``param`` and ``state`` in place, with learning rate ``lr * lr_scale``.

        ``grad`` is only read, never written, so it may be a view of a reused receive buffer.
        ``lr_scale=1.0`` reproduces ``torch.optim`` exactly.

        Raises ``ValueError`` if ``grad`` does not match ``param`` in shape, dtype or device,
        if ``state`` lacks a buffer this rule needs or holds one of another shape, or if
        ``lr_scale`` is not finite and > 0.
        """
        if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
            # Without this check a (1, n) gradient would silently broadcast over an (m, n) param.
            raise ValueError(
                f"gradient {grad.dtype}{list(grad.shape)} on {grad.device} does not match "
                f"parameter {param.dtype}{list(param.shape)} on {param.device}"
            )
        missing = [key for key in self.state_names if key not in state]
        if missing:
            raise ValueError(f"{self.name} state lacks {', '.join(missing)}")
        for key in self.state_names:
            # In-place ops broadcast their other operand, so a larger buffer would absorb the
            # step before param.add_ failed, leaving state and param out of step.
            if key != "step" and state[key].shape != param.shape:
                raise ValueError(f"{self.name} state {key!r} has shape {list(state[key].shape)}")
        if not (math.isfinite(lr_scale) and lr_scale > 0):
            raise ValueError(f"lr_scale must be finite and > 0, got {lr_scale}")
        # Multiplying by exactly 1.0 leaves lr unchanged, keeping parity with torch.optim.
        lr = self.config.lr * lr_scale
        with torch.no_grad():
            state["step"] += 1
            step = int(state["step"].item())
            names = [key for key in self.state_names if key != "step"]
            tensors = [param, grad, *(state[key] for key in names)]
            n, chunk = param.numel(), self.chunk_elements
            if self.single_pass or n <= chunk or not all(t.is_contiguous() for t in tensors):
                self._update(param, grad, state, lr, step)
                return
            flat = [t.view(-1) for t in tensors]
            for start in range(0, n, chunk):
                p, g, *rest = (t[start:start + chunk] for t in flat)
                self._update(p, g, dict(zip(names, rest)), lr, step)

    @abc.abstractmethod
    def _init_buffers(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-element buffers of a fresh state (everything but ``step``)."""

    @abc.abstractmethod
    def _update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        lr: float,
        step: int,
    ) -> None:
        """The step proper, on the whole tensor or one slice of it (``state`` then holds the same
        slice of each buffer, and no ``step``); ``step`` counts from 1."""

    def _with_weight_decay(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        # A fresh tensor rather than grad.add_: the caller's gradient buffer stays untouched,
        # and this is the one temporary torch allocates for L2 decay as well.
        if self.config.weight_decay != 0:
            return grad.add(param, alpha=self.config.weight_decay)
        return grad


def _zeros(param: torch.Tensor) -> torch.Tensor:
    # Not zeros_like: that keeps a transposed view's strides, and safetensors wants contiguous.
    return torch.zeros(param.shape, dtype=param.dtype, device=param.device)


class Sgd(UpdateRule):
    """``torch.optim.SGD``: momentum, dampening, Nesterov and L2 weight decay."""

    name = "sgd"

    def __init__(self, config: OptimizerConfig, *, chunk_elements: int = CHUNK_ELEMENTS) -> None:
        super().__init__(config, chunk_elements=chunk_elements)
        self.state_names = ("step", "momentum_buffer") if config.momentum != 0 else ("step",)
        self.single_pass = config.momentum == 0 and config.weight_decay == 0

    def _init_buffers(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"momentum_buffer": _zeros(param)} if self.config.momentum != 0 else {}

    def _update(self, param, grad, state, lr, step):
        cfg = self.config
        d_p = self._with_weight_decay(param, grad)
        if cfg.momentum != 0:
            buf = state["momentum_buffer"]
            if step == 1:
                # torch starts the buffer as a copy of the first gradient, without dampening.
                buf.copy_(d_p)
            else:
                buf.mul_(cfg.momentum).add_(d_p, alpha=1 - cfg.dampening)
            if cfg.nesterov:
                # Reuse the weight-decay temporary when there is one; never write into grad.
                if d_p is grad:
                    d_p = d_p.add(buf, alpha=cfg.momentum)
                else:
                    d_p.add_(buf, alpha=cfg.momentum)
            else:
                d_p = buf
        param.add_(d_p, alpha=-lr)


class Adam(UpdateRule):
    """``torch.optim.Adam``: bias correction, L2 weight decay added to the gradient, AMSGrad."""

    name = "adam"

    def __init__(self, config: OptimizerConfig, *, chunk_elements: int = CHUNK_ELEMENTS) -> None:
        super().__init__(config, chunk_elements=chunk_elements)
        self.state_names = ("step", "exp_avg", "exp_avg_sq") + (
            ("max_exp_avg_sq",) if config.amsgrad else ()
        )

    def _init_buffers(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return {key: _zeros(param) for key in self.state_names if key != "step"}

    def _update(self, param, grad, state, lr, step):
        cfg = self.config
        beta1, beta2 = cfg.beta1, cfg.beta2
        grad = self._with_weight_decay(param, grad)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5

        if cfg.amsgrad:
            max_exp_avg_sq = state["max_exp_avg_sq"]
            torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            second_moment = max_exp_avg_sq
        else:
            second_moment = exp_avg_sq
        # torch computes sqrt() / c, allocating twice; dividing in place rounds identically.
        denom = second_moment.sqrt().div_(bias_correction2_sqrt).add_(cfg.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


class Adagrad(UpdateRule):
    """``torch.optim.Adagrad``: learning-rate decay, L2 weight decay, initial accumulator.

    Note that ``OptimizerConfig.eps`` defaults to 1e-8 while ``torch.optim.Adagrad`` uses 1e-10;
    the config's value is used as given.
    """

    name = "adagrad"
    state_names = ("step", "sum")

    def _init_buffers(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        value = self.config.initial_accumulator_value
        return {"sum": torch.full(param.shape, value, dtype=param.dtype, device=param.device)}

    def _update(self, param, grad, state, lr, step):
        cfg = self.config
        grad = self._with_weight_decay(param, grad)
        clr = lr / (1 + (step - 1) * cfg.lr_decay)
        state_sum = state["sum"]
        state_sum.addcmul_(grad, grad, value=1)
        std = state_sum.sqrt().add_(cfg.eps)
        param.addcdiv_(grad, std, value=-clr)


_RULES: dict[str, type[UpdateRule]] = {rule.name: rule for rule in (Sgd, Adam, Adagrad)}


def create_update_rule(config: OptimizerConfig, *, chunk_elements: int = CHUNK_ELEMENTS) -> UpdateRule:
    """The update rule for ``config``, updating large tensors ``chunk_elements`` at a time.

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
