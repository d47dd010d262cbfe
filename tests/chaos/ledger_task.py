"""A task whose model is a ledger of the examples it was trained on, for the dynamic-data chaos
tests (``--task tests.chaos.ledger_task:ledger``).

The model's parameter ``counts`` has one entry per training example; the input of example ``i``
is ``i`` itself, the forward pass returns ``counts[x]`` and the loss is ``-out.sum()``. The
gradient of that loss is -1 at every index of the batch (-k for an index that appears k times),
so plain SGD with lr 1 adds exactly 1 to ``counts[i]`` each time example ``i`` is trained and
touches nothing else: after the job, ``counts`` says how often every example was trained (small
integers, exact in float32). A second, smaller parameter ``pad`` (always a zero gradient) gives a
second shard something to hold, so a two-shard job keeps ``counts`` whole on shard 0, beside the
data queue (``ledger_placement`` checks it).

Every forward pass also sleeps ``STEP_SECONDS``: a step takes about a millisecond otherwise, and a
worker started alone would finish the whole job before the tests could add and remove workers. A
fixed pause (rather than ``--slowdown``, which stretches each step by a factor of its measured
length) keeps the job's length about the same on an idle machine and a busy one.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from pswire.placement import Placement, model_spec, place
from psworker.tasks import Task, TaskDefaults

__all__ = ["BATCH", "EXAMPLES", "STEP_SECONDS", "Ledger", "ledger", "ledger_placement"]

EXAMPLES = 3000
"""Training examples (and entries of ``counts``)."""
BATCH = 2
"""Examples per step: with ``STEP_SECONDS`` one worker trains about 80 examples a second, so one
epoch keeps a lone worker busy for over 30 s."""
STEP_SECONDS = 0.02
"""The pause of every forward pass (see the module's docstring)."""


class Ledger(nn.Module):
    """``counts[i]``: how often example ``i`` was trained (see the module's docstring)."""

    def __init__(self, examples: int = EXAMPLES) -> None:
        super().__init__()
        self.counts = nn.Parameter(torch.zeros(examples))
        self.pad = nn.Parameter(torch.zeros(examples // 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(STEP_SECONDS)
        # pad joins the graph with a zero factor: every step pushes a (zero) gradient to each shard.
        return self.counts[x] + 0.0 * self.pad.sum()


def _minus_sum(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -out.sum()


def ledger(seed: int = 0) -> Task:
    """The ledger task: ``EXAMPLES`` examples whose inputs are their own indices; SGD, lr 1, no
    momentum (the exact +1 per training needs all three). ``seed`` changes nothing: the initial
    counts are zeros."""
    x = torch.arange(EXAMPLES)
    return Task(name="ledger", model=Ledger(), train=(x, torch.zeros(EXAMPLES)), loss_fn=_minus_sum,
                classification=False,
                defaults=TaskDefaults(optimizer="sgd", lr=1.0, momentum=0.0, batch_size=BATCH, steps=EXAMPLES // BATCH))


def ledger_placement(num_shards: int) -> Placement:
    """Where the shards keep the ledger's variables. Raises ``AssertionError`` unless ``counts``
    lies whole on shard 0, where the data queue is: only then does a restored shard 0 roll the
    counts and the queue back to the same moment."""
    model = Ledger()
    # Spread as the tests' workers spread it (tests/conftest.py SPREAD): the ledger stands in for a large model.
    placement = place(model_spec((name, p.data) for name, p in model.named_parameters()), num_shards, pack_below=0)
    parts = placement.parts_of("counts")
    assert [(shard, p.row_start, p.row_end) for shard, p in parts] == [(0, 0, EXAMPLES)], parts
    return placement
