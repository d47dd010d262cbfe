"""The job's optimizer settings: chosen by the first worker, held and applied by every shard.

The update rules themselves live on the shards (``psserver.optimizers``); this module only
describes them, so that workers and shards agree on one validated value and can compare it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_SCHEDULE_STEPS", "OPTIMIZERS", "OptimizerConfig"]

OPTIMIZERS = ("sgd", "adam", "adagrad")
MAX_SCHEDULE_STEPS = 1 << 53
"""The largest ``warmup_steps`` or ``decay_steps``: update counts stay exact as floats."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Hyper-parameters of a server-side optimizer, with ``torch.optim`` meanings and defaults."""

    name: str = "sgd"
    """One of ``sgd``, ``adam``, ``adagrad``."""
    lr: float = 0.01
    """Learning rate."""
    momentum: float = 0.0
    """SGD momentum factor."""
    dampening: float = 0.0
    """SGD dampening for momentum."""
    nesterov: bool = False
    """SGD Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``)."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient (all optimizers, as in ``torch.optim``)."""
    beta1: float = 0.9
    """Adam: decay of the first moment."""
    beta2: float = 0.999
    """Adam: decay of the second moment."""
    eps: float = 1e-8
    """Term added to the denominator (Adam, Adagrad). ``torch.optim.Adagrad``'s default is 1e-10:
    pass it explicitly (the CLI does) to match."""
    amsgrad: bool = False
    """Adam: use the AMSGrad variant."""
    lr_decay: float = 0.0
    """Adagrad: learning-rate decay."""
    initial_accumulator_value: float = 0.0
    """Adagrad: starting value of the sum of squares."""
    warmup_steps: int = 0
    """Learning-rate warm-up: the shard's first N updates use ``lr * t / N`` (update ``t``
    counted from 1), as ``torch.optim.lr_scheduler.LinearLR(start_factor=1/N, total_iters=N-1)``."""
    decay_steps: int = 0
    """Cosine decay: updates after the warm-up, up to update N, follow
    ``torch.optim.lr_scheduler.CosineAnnealingLR(T_max=N - warmup_steps, eta_min=min_lr_ratio * lr)``
    and later ones keep update N's rate. 0: no decay."""
    min_lr_ratio: float = 0.0
    """Cosine decay: the rate it tends to, as a fraction of ``lr``."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"optimizer {field.name} must be finite, got {value}")
        if self.lr <= 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr}")
        if self.momentum < 0:
            raise ValueError(f"momentum must be >= 0, got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov momentum needs momentum > 0 and dampening == 0")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ValueError(f"adam betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.lr_decay < 0 or self.initial_accumulator_value < 0:
            raise ValueError("adagrad lr_decay and initial_accumulator_value must be >= 0")
        for name in ("warmup_steps", "decay_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SCHEDULE_STEPS:
                raise ValueError(f"{name} must be an integer in 0..{MAX_SCHEDULE_STEPS}, got {value!r}")
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"decay_steps ({self.decay_steps}) must be above warmup_steps ({self.warmup_steps}): the decay "
                "follows the warm-up"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.min_lr_ratio and not self.decay_steps:
            raise ValueError("min_lr_ratio needs decay_steps: it is where the cosine decay ends")

    @property
    def scheduled(self) -> bool:
        """Whether the learning rate changes with the update count."""
        return bool(self.warmup_steps or self.decay_steps)

    def lr_factor(self, update: int) -> float:
        """The multiple of ``lr`` that update ``update`` (the shard's, counted from 1) uses: 1.0
        without a schedule, else the warm-up then the cosine decay. Always > 0 for ``update >= 1``."""
        warmup, decay = self.warmup_steps, self.decay_steps
        if update < 1:
            raise ValueError(f"updates are counted from 1, got {update}")
        if warmup and update <= warmup:
            return update / warmup
        if not decay:
            return 1.0
        span = decay - warmup
        done = min(update - warmup - 1, span - 1)  # CosineAnnealingLR's epoch: 0 for the first decayed update
        floor = self.min_lr_ratio
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * done / span))

    def describe_schedule(self) -> str:
        """The schedule in words (``constant`` when there is none)."""
        parts = []
        if self.warmup_steps:
            parts.append(f"warm-up over {self.warmup_steps} updates")
        if self.decay_steps:
            parts.append(f"cosine decay to {self.min_lr_ratio:g} x lr at update {self.decay_steps}")
        return ", then ".join(parts) or "constant"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "OptimizerConfig":
        """Build from a mapping; raises ``ValueError`` on unknown keys or invalid values."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown optimizer settings: {', '.join(unknown)}")
        return cls(**values)

    def differences(self, other: "OptimizerConfig") -> list[str]:
        """Human-readable list of the settings in which ``other`` differs from this one."""
        out = []
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                out.append(f"{field.name}: job has {mine!r}, worker asked for {theirs!r}")
        return out

    @classmethod
    def from_torch(cls, optimizer: Any) -> "OptimizerConfig":
        """Describe a ``torch.optim`` SGD, Adam or Adagrad instance (its first param group).

        Raises ``ValueError`` for other optimizer classes, for settings the shards do not
        implement, and for param groups with differing hyper-parameters.
        """
        import torch

        groups = optimizer.param_groups
        if not groups:
            raise ValueError("optimizer has no parameter groups")
        group = groups[0]
        for other in groups[1:]:
            for key, value in group.items():
                if key != "params" and other.get(key) != value:
                    raise ValueError(
                        f"all parameter groups must share hyper-parameters; {key!r} differs"
                    )
        if group.get("maximize"):
            raise ValueError("maximize=True is not supported by the parameter server")
        if group.get("decoupled_weight_decay"):
            raise ValueError("decoupled weight decay (AdamW) is not supported on the shards; use Adam")

        def _lr() -> float:
            lr = group["lr"]
            return float(lr.item() if isinstance(lr, torch.Tensor) else lr)

        if type(optimizer) is torch.optim.SGD:
            return cls(
                name="sgd",
                lr=_lr(),
                momentum=float(group["momentum"]),
                dampening=float(group["dampening"]),
                nesterov=bool(group["nesterov"]),
                weight_decay=float(group["weight_decay"]),
            )
        if type(optimizer) is torch.optim.Adam:
            beta1, beta2 = group["betas"]
            return cls(
                name="adam",
                lr=_lr(),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                amsgrad=bool(group["amsgrad"]),
            )
        if type(optimizer) is torch.optim.Adagrad:
            return cls(
                name="adagrad",
                lr=_lr(),
                lr_decay=float(group["lr_decay"]),
                weight_decay=float(group["weight_decay"]),
                eps=float(group["eps"]),
                initial_accumulator_value=float(group["initial_accumulator_value"]),
            )
        raise ValueError(
            f"{type(optimizer).__name__} is not supported on the shards; use SGD, Adam or Adagrad"
        )
