"""Embedding tables that live only on the shards: what a table is (``TableSpec``), which shard
holds which row (a pure function, like ``pswire.placement``), and the rows' initial values.

Rows are split across the shards by hashing, as ps-lite and TensorFlow's ``fixed_size``
partitioners of ids do: row ``i`` of a table lives on shard ``i % num_shards``, at local index
``i // num_shards``. Modulo placement, not row ranges, because real ids are skewed (Zipf): the
frequent ids are the small ones, and ranges would put all of them on shard 0.

A row never written has its *initial value*, a pure function of (table, seed, row id, column)
computed wherever it is needed (``initial_rows``): the shard computes a row the first time a
pull or a push touches it, so nothing uploads a table at the start and a 10-million-row table
costs no memory until its rows are used. The same function gives a local ``nn.Embedding`` the
very values a sharded table starts from (``psworker.embedding``).

The initializer is counter-based: each element is SplitMix64 of a 64-bit counter (the table's
key, the row id and the column), so any subset of rows is computed in any order with the same
result. ``normal``: Box-Muller of two such uniforms, times ``init_scale`` (the standard
deviation); ``uniform``: in ``[-init_scale, init_scale)``; ``zeros``.

This module imports numpy only.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from pswire.optim import OptimizerConfig

__all__ = [
    "INITIALIZERS", "MAX_TABLE_ROWS", "TableSpec", "check_ids", "coalesce", "initial_rows", "local_index", "local_rows",
    "owner", "splitmix64",
]

INITIALIZERS = ("normal", "uniform", "zeros")

MAX_TABLE_ROWS = 1 << 40
"""The most rows a table may have (ids travel as int64)."""

MAX_TABLE_DIM = 1 << 16


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One embedding table of a job: ``num_rows`` rows of ``dim`` float32 values, their initial
    values, and the optimizer the shards apply to its rows.

    ``optimizer`` has ``torch.optim`` meanings, applied to the rows a push touches only (lazily):
    ``sgd`` without momentum (momentum on rows would need every row's buffer decayed every step;
    it is refused), ``adagrad`` as ``torch.optim.Adagrad`` does with sparse gradients, and
    ``adam`` as ``torch.optim.SparseAdam`` (lazy Adam: moments of untouched rows do not decay).
    Weight decay and AMSGrad are refused, as torch refuses them with sparse gradients.
    """

    name: str
    num_rows: int
    dim: int
    optimizer: OptimizerConfig
    init: str = "normal"
    init_scale: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 256:
            raise ValueError(f"a table needs a name of 1 to 256 characters, got {self.name!r}")
        if not 1 <= self.num_rows <= MAX_TABLE_ROWS:
            raise ValueError(f"table {self.name!r}: num_rows must be in [1, 2**40], got {self.num_rows}")
        if not 1 <= self.dim <= MAX_TABLE_DIM:
            raise ValueError(f"table {self.name!r}: dim must be in [1, 65536], got {self.dim}")
        if self.init not in INITIALIZERS:
            raise ValueError(f"table {self.name!r}: init must be one of {', '.join(INITIALIZERS)}, got {self.init!r}")
        if not (np.isfinite(self.init_scale) and self.init_scale >= 0):
            raise ValueError(f"table {self.name!r}: init_scale must be finite and >= 0, got {self.init_scale}")
        if not 0 <= self.seed < 1 << 63:
            raise ValueError(f"table {self.name!r}: seed must be in [0, 2**63), got {self.seed}")
        opt = self.optimizer
        if not isinstance(opt, OptimizerConfig):
            raise ValueError(f"table {self.name!r}: optimizer must be an OptimizerConfig")
        if opt.name == "sgd" and opt.momentum != 0:
            raise ValueError(
                f"table {self.name!r}: SGD momentum is not applied to table rows (every row's buffer would decay "
                "every step); give the table an optimizer without momentum, e.g. OptimizerConfig(name='adagrad', "
                "lr=...) or name='adam' (lazy Adam, as torch.optim.SparseAdam)"
            )
        if opt.weight_decay != 0:
            raise ValueError(f"table {self.name!r}: weight decay is not applied to table rows (torch refuses it "
                             "with sparse gradients too)")
        if opt.name == "adam" and opt.amsgrad:
            raise ValueError(f"table {self.name!r}: AMSGrad is not available for table rows (as in torch.optim.SparseAdam)")

    @property
    def row_bytes(self) -> int:
        return 4 * self.dim

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    def to_dict(self) -> dict:
        """The spec as JSON-ready values (checkpoint metadata)."""
        return {"name": self.name, "num_rows": self.num_rows, "dim": self.dim, "optimizer": self.optimizer.to_dict(),
                "init": self.init, "init_scale": self.init_scale, "seed": self.seed}

    @classmethod
    def from_dict(cls, doc: dict) -> "TableSpec":
        """Raises ``ValueError`` (or ``KeyError`` for a missing setting) for a spec that cannot be."""
        return cls(name=str(doc["name"]), num_rows=int(doc["num_rows"]), dim=int(doc["dim"]),
                   optimizer=OptimizerConfig.from_dict(doc["optimizer"]), init=str(doc["init"]),
                   init_scale=float(doc["init_scale"]), seed=int(doc["seed"]))

    def differences(self, other: "TableSpec") -> list[str]:
        """Human-readable list of the settings in which ``other`` differs from this one."""
        out = [f"{key}: job has {getattr(self, key)!r}, worker asked for {getattr(other, key)!r}"
               for key in ("num_rows", "dim", "init", "init_scale", "seed")
               if getattr(self, key) != getattr(other, key)]
        out += [f"optimizer {d}" for d in self.optimizer.differences(other.optimizer)]
        return out


def coalesce(blocks: list[tuple[np.ndarray, np.ndarray]], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Sum row gradients given as ``(ids, gradients)`` blocks into one float32 gradient per
    distinct id (sorted): a step's lookups of one table on a worker, or a sync clock's pushes of
    it on a shard."""
    if not blocks:
        return np.zeros(0, dtype=np.int64), np.zeros((0, dim), dtype=np.float32)
    ids = np.concatenate([b[0] for b in blocks])
    grads = np.concatenate([b[1] for b in blocks])
    unique, inverse = np.unique(ids, return_inverse=True)
    sums = np.zeros((unique.size, dim), dtype=np.float32)
    np.add.at(sums, inverse, grads)
    return unique, sums


def owner(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard holding each row id."""
    return ids % num_shards


def local_index(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Each row id's index among the rows its shard holds."""
    return ids // num_shards


def local_rows(num_rows: int, shard: int, num_shards: int) -> int:
    """How many rows of a table of ``num_rows`` rows shard ``shard`` holds."""
    return max(0, (num_rows - shard + num_shards - 1) // num_shards)


def check_ids(spec: TableSpec, ids: np.ndarray, *, shard: int | None = None, num_shards: int = 1) -> None:
    """Raise ``ValueError`` naming the first id of ``ids`` (int64) outside the table, or, with
    ``shard``, the first one that another shard holds."""
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= spec.num_rows:
        bad = low if low < 0 else high
        raise ValueError(f"table {spec.name!r}: row id {bad} is outside the table's {spec.num_rows} rows")
    if shard is not None and num_shards > 1:
        wrong = ids % num_shards != shard
        if wrong.any():
            raise ValueError(f"table {spec.name!r}: row id {int(ids[np.argmax(wrong)])} lives on shard "
                             f"{int(ids[np.argmax(wrong)]) % num_shards}, not on shard {shard} (row i lives on shard "
                             f"i % {num_shards})")


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of each uint64 counter of ``x`` (wrapping arithmetic): the
    counter-based generator behind the initial values (and ``dlrm-synth``'s data)."""
    with np.errstate(over="ignore"):
        # In place, with one temporary: the same operations as z = (z ^ (z >> 30)) * MIX1 ...
        z = np.array(x, dtype=np.uint64)  # a copy, an array even of one counter (0-d)
        z += _GOLDEN
        t = np.right_shift(z, _S30, out=np.empty_like(z))
        z ^= t
        z *= _MIX1
        np.right_shift(z, _S27, out=t)
        z ^= t
        z *= _MIX2
        np.right_shift(z, _S31, out=t)
        z ^= t
        return z


_S11, _S27, _S30, _S31 = (np.uint64(n) for n in (11, 27, 30, 31))


def _uniform01(counters: np.ndarray) -> np.ndarray:
    """A float64 in [0, 1) per counter: the top 53 bits of SplitMix64."""
    bits = splitmix64(counters)
    bits >>= _S11
    out = bits.astype(np.float64)
    out *= 1.0 / (1 << 53)
    return out


def _key(spec: TableSpec) -> np.uint64:
    # The table's name and seed pick its stream: two tables of one job start differently.
    return np.uint64((zlib.crc32(spec.name.encode()) << 32 ^ spec.seed * 0x2545F4914F6CDD1D) & ((1 << 64) - 1))


def initial_rows(spec: TableSpec, ids: np.ndarray, *, chunk_rows: int = 1 << 14) -> np.ndarray:
    """The initial values of rows ``ids`` (int64, any order, repeats allowed): a float32 array
    of shape ``(len(ids), dim)``, computed ``chunk_rows`` rows at a time."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    out = np.zeros((ids.size, spec.dim), dtype=np.float32)
    if spec.init == "zeros" or spec.init_scale == 0 or ids.size == 0:
        return out
    key = _key(spec)
    columns = np.arange(spec.dim, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for start in range(0, ids.size, chunk_rows):
            rows = ids[start:start + chunk_rows].astype(np.uint64)
            # Two counters per element (Box-Muller needs two uniforms); the key offsets them all.
            base = (rows[:, None] * np.uint64(spec.dim) + columns[None, :]) * np.uint64(2) + key
            # In place, each operation as the expressions in the comments (the same roundings).
            if spec.init == "uniform":
                values = _uniform01(base)  # (2.0 * u - 1.0) * init_scale
                values *= 2.0
                values -= 1.0
                values *= spec.init_scale
            else:
                values, u2 = _uniform01(base), _uniform01(base + np.uint64(1))
                # sqrt(-2.0 * log1p(-u1)) * cos(2.0 * pi * u2) * init_scale
                np.negative(values, out=values)
                np.log1p(values, out=values)
                values *= -2.0
                np.sqrt(values, out=values)
                u2 *= 2.0 * np.pi
                np.cos(u2, out=u2)
                values *= u2
                values *= spec.init_scale
            out[start:start + rows.size] = values.reshape(rows.size, spec.dim)
    return out
