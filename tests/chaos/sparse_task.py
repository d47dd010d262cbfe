"""A small task with an embedding table on the shards, for the sparse chaos tests
(``--task tests.chaos.sparse_task:task``): 4 skewed ids per example into a 20000-row table,
regressed onto a planted per-row value."""

from __future__ import annotations

import torch
from torch import nn

from pswire.optim import OptimizerConfig
from psworker.embedding import ShardedEmbedding
from psworker.tasks import Task, TaskDefaults

ROWS, DIM, FEATURES, EXAMPLES = 20000, 16, 4, 8192


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = ShardedEmbedding(ROWS, DIM, init_scale=0.05, seed=1,
                                    optimizer=OptimizerConfig(name="adagrad", lr=0.1, eps=1e-10))
        self.top = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.top(self.emb(x.long()).sum(dim=1))


def task(seed: int = 0) -> Task:
    g = torch.Generator().manual_seed(1234)  # the data is the same for every model seed
    ids = (torch.rand(EXAMPLES, FEATURES, generator=g) ** 2 * ROWS).long()
    planted = torch.randn(ROWS, generator=g)
    y = planted[ids].sum(dim=1, keepdim=True) + 0.01 * torch.randn(EXAMPLES, 1, generator=g)
    x = ids.double()
    return Task(name="sparse-chaos", model=Model(), train=(x[:7168], y[:7168]), test=(x[7168:], y[7168:]),
                loss_fn=nn.functional.mse_loss, classification=False,
                defaults=TaskDefaults(optimizer="adagrad", lr=0.1, batch_size=64, steps=600))
