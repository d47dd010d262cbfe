"""Dynamic data's two values, shared by the shard that holds the queue and the workers that train
it: the job's ``DataPlan`` and a ``DataTask``, a range of one epoch's permutation."""

from __future__ import annotations

from dataclasses import dataclass

from pswire.errors import InvalidArgumentError

__all__ = ["DataPlan", "DataTask", "MAX_HELD"]

MAX_HELD = 32
"""The most data tasks one worker may hold at once: nobody can drain the queue and starve the rest
(a worker leases no more than its share of what is left besides, ``psworker.elastic.DataFeed``)."""

@dataclass(frozen=True)
class DataPlan:
    """What the job trains: ``total`` examples over epochs of ``examples`` (the dataset's size),
    in data tasks of ``task_size``, each epoch in the order of a permutation seeded by ``seed``.
    Raises ``InvalidArgumentError`` when a field is out of range."""

    examples: int
    task_size: int
    seed: int
    total: int

    def __post_init__(self) -> None:
        from pswire.wire import MAX_COUNT  # here: pswire.wire imports this module

        for name in ("examples", "task_size", "total", "seed"):
            value = getattr(self, name)
            low = 0 if name == "seed" else 1
            if not isinstance(value, int) or not low <= value <= MAX_COUNT:
                raise InvalidArgumentError(f"data plan's {name} is {value!r}, not in {low}..{MAX_COUNT}")

    @property
    def epochs(self) -> float:
        return self.total / self.examples

    def describe(self) -> str:
        return (f"{self.total} examples ({self.epochs:g} epoch(s) of {self.examples}) in tasks of "
                f"{self.task_size}, seed {self.seed}")

    def to_dict(self) -> dict[str, int]:
        return {"examples": self.examples, "task_size": self.task_size, "seed": self.seed, "total": self.total}


@dataclass(frozen=True)
class DataTask:
    """Positions ``[start, end)`` of epoch ``epoch``'s permutation of the examples."""

    epoch: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"epoch {self.epoch} [{self.start}, {self.end})"
