"""The benchmark's training tasks: MNIST-1D MLPs ``40 -> W -> W -> 10`` (ReLU), loadable by any
worker as a user task, e.g. ``psworker --task psbench.tasks:mlp1024``, and psworker's built-in
``mnist1d-cnn`` as ``psbench.tasks:mnist1d_cnn`` (for the elastic section).

Three widths span the regimes that limit a parameter server differently: at W=100 (about 15K
parameters) a step is almost all per-call overhead, at W=2048 (about 4.3M parameters, 17 MiB)
it is bytes on the wire against matrix products.

Generating MNIST-1D takes several seconds per process. ``psbench`` generates it once, before
its first worker starts, into psworker's data cache (``psworker.tasks.data_cache_dir``), where
every worker then reads it.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from torch import nn

from psworker.tasks import Task, TaskDefaults, _mnist1d_arrays, _MnistCnn

__all__ = ["CNN_DEFAULTS", "WIDTHS", "build_mlp", "mlp100", "mlp1024", "mlp2048", "mnist1d_cnn"]

WIDTHS = (100, 1024, 2048)
"""Hidden widths of the benchmark MLPs: about 15K, 1.1M and 4.3M parameters."""

# SGD keeps the shard's apply cheap (no optimizer state), so the figures measure the transport
# and the training loop, not Adam's arithmetic. Plain SGD at 0.05 trains these MLPs stably.
_DEFAULTS = TaskDefaults(optimizer="sgd", lr=0.05, batch_size=64, steps=2000)

CNN_DEFAULTS = TaskDefaults(optimizer="adam", lr=1e-2, batch_size=100, steps=6000)
"""psworker's ``mnist1d-cnn`` defaults (``psworker.tasks``; a test holds the two equal)."""


def build_mlp(width: int) -> nn.Sequential:
    """``40 -> width -> width -> 10`` with ReLU. Raises ``ValueError`` if ``width`` < 1."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    return nn.Sequential(nn.Linear(40, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def _task(width: int) -> Task:
    x, y, x_test, y_test = (torch.from_numpy(np.array(a)) for a in _mnist1d_arrays())  # private copies
    return Task(name=f"psbench-mlp{width}", model=build_mlp(width), train=(x, y), test=(x_test, y_test),
                loss_fn=nn.functional.cross_entropy, defaults=_DEFAULTS)


def mlp100(seed: int = 0) -> Task:
    """About 15K parameters: per-step overhead dominates."""
    return _task(100)


def mlp1024(seed: int = 0) -> Task:
    """About 1.1M parameters (4.3 MiB)."""
    return _task(1024)


def mlp2048(seed: int = 0) -> Task:
    """About 4.3M parameters (17 MiB): bytes on the wire dominate."""
    return _task(2048)


def mnist1d_cnn(seed: int = 0, compute_ms: str | float = 0) -> Task:
    """psworker's built-in ``mnist1d-cnn``, the same model, weights, data and defaults, on the
    data psbench cached (the same arrays): workers start without generating MNIST-1D.

    ``compute_ms`` (``--task-options compute_ms=30``): each training forward pass also sleeps
    this long, standing for compute on an accelerator of the worker's own, so that workers do not
    share the machine's cores for it (the elastic section's accuracy runs). An evaluation does
    not sleep, and the model's variables are the same either way."""
    delay = float(compute_ms) / 1e3
    if not (math.isfinite(delay) and delay >= 0):
        raise ValueError(f"compute_ms must be a finite number >= 0, got {compute_ms!r}")
    model = _MnistCnn()  # first, as the built-in does: the seeded RNG gives the same weights
    if delay > 0:
        model.register_forward_pre_hook(lambda module, inputs: time.sleep(delay) if module.training else None)
    x, y, x_test, y_test = (torch.from_numpy(np.array(a)) for a in _mnist1d_arrays())
    return Task(name="mnist1d-cnn", model=model, train=(x, y), test=(x_test, y_test),
                loss_fn=nn.functional.cross_entropy, defaults=CNN_DEFAULTS)
