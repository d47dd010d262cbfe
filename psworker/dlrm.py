"""``dlrm-synth``: a click-through-rate task in the style of DLRM's synthetic benchmark, whose
embedding table lives on the shards (``psworker.embedding.ShardedEmbedding``).

Each example has ``dense`` standard-normal features and ``features`` categorical ids. All ids
index one table of ``rows`` rows: feature ``k`` uses rows ``[k*rows//features,
(k+1)*rows//features)``, and its id is that range's start plus a Zipf(``zipf``) rank, so the
small ranks are the hot ids (the shards place row ``i`` on shard ``i % num_shards``, which
spreads them). The label is Bernoulli(sigmoid(logit)) of a planted teacher::

    logit = w . dense + sum_k t(id_k) / sqrt(features) + b

where ``t(id)`` is a standard-normal scalar per id, a pure function of the id (counter-based
hash, as the tables' initializer in ``pswire.tables``): no teacher table exists anywhere. ``w``
has norm 1.5 (the dense part's standard deviation) and the embedding part's is about 1; ``b``
centres the logits, so about half the labels are 1. The teacher's own test AUC, the best any
model can reach on the sampled labels, is the task's ``reference["teacher_auc"]``; evaluation
reports ``test_auc`` next to it, and next to ``teacher_dense_auc``, the AUC of the teacher's
dense part alone: about what a model whose embeddings learn nothing reaches.

The data is generated from a fixed data seed, never the model seed, so every worker of a job
(and every run) sees the same examples; every random number is SplitMix64 of a counter (no
numpy RNG stream, whose algorithms may change between versions), and nothing of size ``rows`` is
ever allocated: generating the default 500,000 examples takes about 70 MB for the inputs, whatever
the table's size.

Zipf ranks over a range of ``M`` ids follow ``P(r) ~ (r + 1) ** -zipf``, ``r < M``: the first
4096 ranks are drawn exactly (inverse CDF over their cumulative table), the rest from the
continuous bounded power law ``x ** -zipf`` on ``[4096.5, M + 0.5)`` rounded to the nearest
rank (midpoint rule: the tail's probabilities are off by well under 1e-3 relative), with the
tail's share of the mass taken from that same integral.

Inputs are one float64 tensor per example, ``[dense features..., ids...]`` (ids are exact below
2**53); the model splits them. Targets are float32 labels of shape ``[n, 1]``; the loss is the
mean binary cross-entropy of the logits.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from pswire.tables import splitmix64
from psworker.embedding import ShardedEmbedding
from psworker.tasks import Task, TaskDefaults

__all__ = ["auc", "dlrm_synth"]

_DATA_SEED = 0x5EED_D1_12
"""The data's seed: fixed, so that the data does not depend on the model's seed."""

_HEAD = 4096
"""Ranks drawn exactly from their cumulative table; the tail beyond uses the continuous law."""

_CHUNK = 1 << 15
"""Examples generated at a time (bounds the temporaries to a few MB)."""

_DENSE_STD = 1.5
"""Standard deviation of the teacher's dense part (the norm of ``w``)."""

_EPOCHS = 1
"""Passes over the training split in the default job (TaskDefaults.steps). One, as DLRM trains:
test AUC peaks at the end of the first pass, then drops as the rarely seen ids' rows memorize
their few labels (by 0.02-0.03 AUC over the second pass, at every lr tried)."""

_LR = 0.02
"""Adagrad's default lr: 0.01 to 0.1 end the first pass within 0.001 AUC of each other; the
lower end stays safer with stale gradients."""

_MAX_ROWS = 1 << 40

def _stream(*parts: int) -> np.uint64:
    """The 64-bit start of the counter stream named by ``parts`` (distinct streams start at
    unrelated points of the 2**64 counters, so they never meet in practice)."""
    key = np.uint64(_DATA_SEED)
    for part in parts:
        key = splitmix64(np.asarray(key ^ np.uint64(part), dtype=np.uint64))[()]
    return np.uint64(key)


def _uniform(stream: np.uint64, counters: np.ndarray) -> np.ndarray:
    """A float64 in [0, 1) per counter (uint64) of ``stream``: the top 53 bits of SplitMix64."""
    with np.errstate(over="ignore"):
        bits = splitmix64(counters + stream)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _normal(stream: np.uint64, counters: np.ndarray) -> np.ndarray:
    """A standard normal per counter of ``stream`` (Box-Muller of counters 2c and 2c + 1)."""
    with np.errstate(over="ignore"):
        twice = counters * np.uint64(2)
    u1, u2 = _uniform(stream, twice), _uniform(stream, twice + np.uint64(1))
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


def teacher_values(ids: np.ndarray) -> np.ndarray:
    """The teacher's scalar ``t(id)`` (float64, standard normal) of each id (int64)."""
    return _normal(_stream(1), np.asarray(ids, dtype=np.int64).astype(np.uint64))


class _Zipf:
    """Ranks ``r < size`` with ``P(r) ~ (r + 1) ** -s``: exact for the head, a bounded
    continuous power law for the tail (the module's docstring)."""

    def __init__(self, size: int, s: float) -> None:
        self.size, self.s = size, s
        head = min(size, _HEAD)
        weights = np.arange(1, head + 1, dtype=np.float64) ** -s
        self.head_cdf = np.cumsum(weights)
        self.head_mass = float(self.head_cdf[-1])
        # The tail: j = r + 1 in head+1..size, sum of j**-s ~ integral of x**-s over [head+.5, size+.5).
        self.lo, self.hi = head + 0.5, size + 0.5
        if size <= head:
            self.tail_mass = 0.0
        elif s == 1.0:
            self.tail_mass = math.log(self.hi / self.lo)
        else:
            self.tail_mass = (self.hi ** (1 - s) - self.lo ** (1 - s)) / (1 - s)
        self.total = self.head_mass + self.tail_mass
        self.probabilities_head = weights / self.total

    def ranks(self, u: np.ndarray) -> np.ndarray:
        """The rank (int64) of each uniform in ``u``."""
        mass = u * self.total
        out = np.searchsorted(self.head_cdf, mass, side="right").astype(np.int64)
        tail = mass >= self.head_mass
        if self.tail_mass > 0 and tail.any():
            v = (mass[tail] - self.head_mass) / self.tail_mass  # uniform in [0, 1) over the tail
            if self.s == 1.0:
                x = self.lo * (self.hi / self.lo) ** v
            else:
                a, b = self.lo ** (1 - self.s), self.hi ** (1 - self.s)
                x = (a + v * (b - a)) ** (1 / (1 - self.s))
            out[tail] = np.floor(x + 0.5).astype(np.int64) - 1  # j = round(x), r = j - 1
        return np.clip(out, 0, self.size - 1)


class _Data:
    """The generator of one ``dlrm-synth`` configuration's examples (and its teacher)."""

    def __init__(self, *, rows: int, features: int, dense: int, zipf: float) -> None:
        self.rows, self.features, self.dense = rows, features, dense
        self.offsets = [k * rows // features for k in range(features + 1)]
        self.zipfs = [_Zipf(self.offsets[k + 1] - self.offsets[k], zipf) for k in range(features)]
        w = _normal(_stream(2, dense), np.arange(dense, dtype=np.uint64))
        self.w = w * (_DENSE_STD / max(np.linalg.norm(w), 1e-12))
        self.a = 1.0 / math.sqrt(features)
        # b: minus the logit's mean, the head's exact expectation of t (the tail's is ~0).
        self.b = -self.a * sum(
            float(np.dot(z.probabilities_head, teacher_values(self.offsets[k] + np.arange(z.head_cdf.size))))
            for k, z in enumerate(self.zipfs))

    def split(self, name: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``n`` examples of split ``name`` (0 train, 1 test): inputs float64 [n, dense + features],
        labels float32 [n, 1], and the teacher's logits float64 [n]."""
        d, f = self.dense, self.features
        x = np.empty((n, d + f), dtype=np.float64)
        y = np.empty((n, 1), dtype=np.float32)
        logits = np.empty(n, dtype=np.float64)
        dense_s, ids_s, label_s = _stream(3, name, 0), _stream(3, name, 1), _stream(3, name, 2)
        for start in range(0, n, _CHUNK):
            count = min(_CHUNK, n - start)
            index = np.arange(start, start + count, dtype=np.uint64)
            dense = _normal(dense_s, (index[:, None] * np.uint64(d) + np.arange(d, dtype=np.uint64)).reshape(-1))
            dense = dense.reshape(count, d)
            u = _uniform(ids_s, (index[:, None] * np.uint64(f) + np.arange(f, dtype=np.uint64)).reshape(-1))
            u = u.reshape(count, f)
            ids = np.stack([self.offsets[k] + self.zipfs[k].ranks(u[:, k]) for k in range(f)], axis=1)
            logit = dense @ self.w + self.a * teacher_values(ids.reshape(-1)).reshape(count, f).sum(axis=1) + self.b
            x[start:start + count, :d] = dense
            x[start:start + count, d:] = ids
            logits[start:start + count] = logit
            p = 1.0 / (1.0 + np.exp(-logit))
            y[start:start + count, 0] = _uniform(label_s, index) < p
        return x, y, logits


def auc(scores: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray) -> float:
    """The exact area under the ROC curve of ``scores`` for binary ``labels`` (> 0.5 is
    positive): the Mann-Whitney statistic, ties counted as half. NaN when a class is absent."""
    s = np.asarray(scores.detach().cpu() if isinstance(scores, torch.Tensor) else scores, dtype=np.float64).reshape(-1)
    pos = np.asarray(labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels).reshape(-1) > 0.5
    if s.shape != pos.shape:
        raise ValueError(f"auc: {s.size} scores for {pos.size} labels")
    n_pos = int(pos.sum())
    n_neg = pos.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    # Average 1-based rank of each distinct value: ties share the mean of their ranks.
    ends = np.cumsum(counts)
    average = ends - (counts - 1) / 2.0
    rank_sum = float(average[inverse.reshape(-1)][pos].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def _metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    out, y = outputs.detach().cpu().reshape(-1), targets.detach().cpu().reshape(-1)
    return {"test_auc": auc(out, y), "test_accuracy": float(((out > 0) == (y > 0.5)).float().mean())}


class DlrmModel(nn.Module):
    """Inputs ``[dense..., ids...]`` (float64); dense through ``Linear(dense, dim)``, ids through
    the (sharded) table, the concatenation through ``Linear -> ReLU -> Linear(64, 1)``: a logit."""

    def __init__(self, *, rows: int, dim: int, features: int, dense: int, seed: int,
                 init_scale: float, init: str = "uniform") -> None:
        super().__init__()
        self.dense_features = dense
        self.bottom = nn.Linear(dense, dim)
        # init_scale is the rows' standard deviation either way: U(-a, a) has a / sqrt(3).
        bound = init_scale * math.sqrt(3.0) if init == "uniform" else init_scale
        self.emb = ShardedEmbedding(rows, dim, init=init, init_scale=bound, seed=seed)
        self.top = nn.Sequential(nn.Linear(dim * (features + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = x[:, :self.dense_features].float()
        ids = x[:, self.dense_features:].long()
        return self.top(torch.cat([self.bottom(dense), self.emb(ids).flatten(1)], dim=1))

    def prefetch(self, x: torch.Tensor) -> None:
        """Announce the rows batch ``x`` looks up, to be read with this step's push-and-pull
        (``ShardedEmbedding.prefetch(..., with_step=True)``); nothing for a local table."""
        if isinstance(self.emb, ShardedEmbedding):
            self.emb.prefetch(x[:, self.dense_features:].long(), with_step=True)


def _int(name: str, value: object, low: int, high: int | None = None) -> int:
    text = str(value).strip()
    try:
        number = int(text)
    except ValueError:
        try:
            as_float = float(text)  # "1e6" is fine when it is a whole number
        except ValueError:
            as_float = math.nan
        if not (math.isfinite(as_float) and as_float.is_integer()):
            raise ValueError(f"dlrm-synth: option {name}={value!r} is not an integer") from None
        number = int(as_float)
    if number < low or (high is not None and number > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"dlrm-synth: option {name}={value!r} must be {bound}")
    return number


def _float(name: str, value: object, low: float) -> float:
    try:
        number = float(str(value).strip())
    except ValueError:
        raise ValueError(f"dlrm-synth: option {name}={value!r} is not a number") from None
    if not (math.isfinite(number) and number >= low):
        raise ValueError(f"dlrm-synth: option {name}={value!r} must be a finite number >= {low}")
    return number


def dlrm_synth(seed: int = 0, rows: str = "1000000", dim: str = "64", features: str = "4", dense: str = "13",
               examples: str = "500000", test_examples: str = "50000", zipf: str = "1.1", batch: str = "256",
               init_scale: str = "0.01", init: str = "uniform") -> Task:
    """The ``dlrm-synth`` task (module docstring). Options arrive as strings (``--task-options
    rows=10000000,dim=32``): ``rows`` of the one table, its ``dim``, the number of categorical
    ``features`` and of ``dense`` ones, ``examples`` and ``test_examples`` (the splits' sizes),
    the ids' ``zipf`` exponent (0: uniform), the default ``batch`` size, and the table's
    ``init_scale`` (standard deviation of its initial rows), drawn by ``init``: ``uniform`` (the
    default, as DLRM's reference initializes its tables; also a third of ``normal``'s cost for
    the shard, which computes a row's initial value when a read first meets it) or ``normal``.
    ``seed`` seeds the model only. Raises ``ValueError`` naming a bad option."""
    n_features = _int("features", features, 1, 1 << 16)
    n_rows = _int("rows", rows, 1, _MAX_ROWS)
    if n_rows < n_features:
        raise ValueError(f"dlrm-synth: option rows={rows!r} must be >= features ({n_features}): "
                         "each feature needs its own rows")
    n_dim = _int("dim", dim, 1, 1 << 16)
    n_dense = _int("dense", dense, 1, 1 << 16)
    n_train = _int("examples", examples, 1)
    n_test = _int("test_examples", test_examples, 1)
    s = _float("zipf", zipf, 0.0)
    batch_size = _int("batch", batch, 1)
    scale = _float("init_scale", init_scale, 0.0)
    drawn = str(init).strip()
    if drawn not in ("uniform", "normal"):
        raise ValueError(f"dlrm-synth: option init={init!r} must be uniform or normal")

    data = _Data(rows=n_rows, features=n_features, dense=n_dense, zipf=s)
    x, y, _ = data.split(0, n_train)
    x_test, y_test, teacher_logits = data.split(1, n_test)
    dense_logits = x_test[:, :n_dense] @ data.w
    model = DlrmModel(rows=n_rows, dim=n_dim, features=n_features, dense=n_dense, seed=seed, init_scale=scale,
                      init=drawn)
    defaults = TaskDefaults(optimizer="adagrad", lr=_LR, batch_size=batch_size,
                            steps=max(1, math.ceil(_EPOCHS * n_train / batch_size)))
    return Task(name="dlrm-synth", model=model, train=(torch.from_numpy(x), torch.from_numpy(y)),
                test=(torch.from_numpy(x_test), torch.from_numpy(y_test)),
                loss_fn=nn.functional.binary_cross_entropy_with_logits, classification=False,
                defaults=defaults, metrics=_metrics, prefetch=DlrmModel.prefetch, reference={"teacher_auc": auc(teacher_logits, y_test),
                               "teacher_dense_auc": auc(dense_logits, y_test)})
