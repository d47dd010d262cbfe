"""A task whose first layer is large enough that placement splits it by rows across two shards
(``--task tests.integration.wide_task:wide_mlp``), for the tests of the model's way out.

``Linear(40, WIDTH)``'s weight (WIDTH x 40 float32, 320 KB) is above ``MIN_SPLIT_BYTES``: on two
shards, rows [0, WIDTH / 2) live on one and the rest on the other. The data is MNIST-1D's.
"""

from __future__ import annotations

from torch import nn

from psworker.tasks import Task, TaskDefaults, load_task

__all__ = ["WIDTH", "wide_mlp"]

WIDTH = 2000


def wide_mlp(seed: int = 0) -> Task:
    """MNIST-1D with a wide hidden layer; SGD with momentum, as a short run trains it well enough."""
    base = load_task("mnist1d-mlp", seed=seed)  # its data (the model is replaced)
    model = nn.Sequential(nn.Linear(40, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))
    return Task(name="wide-mlp", model=model, train=base.train, test=base.test, loss_fn=base.loss_fn,
                defaults=TaskDefaults(optimizer="sgd", lr=0.05, momentum=0.9, batch_size=100, steps=200))
