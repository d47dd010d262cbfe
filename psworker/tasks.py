"""Training tasks: what a worker trains, on which data, and with which recommended settings.

A task is a model with freshly initialised weights, a training split, a loss function and an
optional test split. Built-in tasks are named (``BUILTIN_TASKS``); user tasks are named
``"package.module:function"`` where ``function(seed=...)`` returns a :class:`Task`. A task may
take options, strings passed to its function as keyword arguments (``load_task(...,
options={"rows": "100000"})``, the worker's ``--task-options rows=100000``).

Example::

    task = load_task("mnist1d-mlp", seed=0)
    print(evaluate(task.model, task))   # {"test_loss": ..., "test_accuracy": ...}
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import io
import logging
import math
import os
import random
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pswire.files import write_atomically

__all__ = ["BUILTIN_TASKS", "CACHE_ENV", "Task", "TaskDefaults", "data_cache_dir", "evaluate", "linreg_optimum",
           "load_task"]

log = logging.getLogger(__name__)

CACHE_ENV = "PSGRPC_CACHE_DIR"
"""Environment variable: the directory where generated datasets (MNIST-1D) are kept for the
next process; ``off`` keeps none (default: ``$XDG_CACHE_HOME/psgrpc``, else ``~/.cache/psgrpc``)."""

BUILTIN_TASKS: tuple[str, ...] = ("mnist1d-mlp", "mnist1d-cnn", "linreg", "dlrm-synth")

_OPTIMIZERS = ("sgd", "adam", "adagrad")


@dataclass(frozen=True, kw_only=True)
class TaskDefaults:
    """A task's recommended training settings, used by the CLI when a flag is not given."""

    optimizer: str
    """Server-side update rule: "sgd", "adam" or "adagrad"."""
    lr: float
    """Learning rate."""
    batch_size: int
    """Examples per worker step."""
    steps: int
    """Total optimizer steps for the whole job; each of N workers runs ``steps // N``."""
    momentum: float = 0.0
    """SGD momentum (ignored by the other optimizers)."""

    def __post_init__(self) -> None:
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {self.optimizer!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size!r}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")


def _check_split(what: str, split: object) -> None:
    if not (isinstance(split, tuple) and len(split) == 2
            and all(isinstance(t, torch.Tensor) for t in split)):
        raise ValueError(f"{what} must be a tuple (inputs, targets) of two tensors")
    inputs, targets = split
    if inputs.dim() == 0 or targets.dim() == 0:
        raise ValueError(f"{what} tensors must have a first (examples) dimension")
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"{what} inputs and targets differ in length: "
                         f"{inputs.shape[0]} vs {targets.shape[0]}")
    if inputs.shape[0] == 0:
        raise ValueError(f"{what} split is empty")


@dataclass(kw_only=True)
class Task:
    """A model to train with its data and loss. Validated on construction (raises ValueError)."""

    name: str
    """Human-readable name, used in logs."""
    model: nn.Module
    """The model with its initial weights."""
    train: tuple[torch.Tensor, torch.Tensor]
    """Training (inputs, targets); the first dimension indexes examples."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(model output, targets) -> scalar loss, the mean over the batch."""
    test: tuple[torch.Tensor, torch.Tensor] | None = None
    """Optional held-out (inputs, targets) used by :func:`evaluate`."""
    classification: bool = True
    """If True, :func:`evaluate` also reports accuracy (argmax of output vs integer targets)."""
    defaults: TaskDefaults = field(
        default_factory=lambda: TaskDefaults(optimizer="sgd", lr=0.01, batch_size=64, steps=1000))
    """Recommended settings; generic ones unless the task knows better."""
    metrics: Callable[[torch.Tensor, torch.Tensor], dict[str, float]] | None = None
    """Optional extra metrics over the whole test split: (all outputs, all targets) -> a dict
    (e.g. ``{"test_auc": ...}``) that :func:`evaluate` merges into its result."""
    reference: dict[str, float] = field(default_factory=dict)
    """Known best values (e.g. ``{"teacher_auc": ...}``), included in :func:`evaluate`'s result
    so that a run's numbers show next to them."""
    prefetch: Callable[[nn.Module, torch.Tensor], None] | None = None
    """Optional, for models with ``ShardedEmbedding`` tables: ``(model, the next batch's
    inputs)``, called by the training loop of a cluster worker between a step's backward and its
    ``optimizer.step()``, announces the rows the next batch looks up
    (``ShardedEmbedding.prefetch(ids, with_step=True)``), so that they ride on the step's calls."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("task name must be a non-empty string")
        if not isinstance(self.model, nn.Module):
            raise ValueError(f"task {self.name!r}: model must be a torch.nn.Module, "
                             f"got {type(self.model).__name__}")
        if not callable(self.loss_fn):
            raise ValueError(f"task {self.name!r}: loss_fn must be callable")
        _check_split(f"task {self.name!r}: train", self.train)
        if self.test is not None:
            _check_split(f"task {self.name!r}: test", self.test)
        if not isinstance(self.defaults, TaskDefaults):
            raise ValueError(f"task {self.name!r}: defaults must be a TaskDefaults")
        if self.metrics is not None and not callable(self.metrics):
            raise ValueError(f"task {self.name!r}: metrics must be callable or None")
        if self.prefetch is not None and not callable(self.prefetch):
            raise ValueError(f"task {self.name!r}: prefetch must be callable or None")
        if not (isinstance(self.reference, dict)
                and all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in self.reference.items())):
            raise ValueError(f"task {self.name!r}: reference must be a dict of names to numbers")


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    # Importing matplotlib builds its font cache, once per MPLCONFIGDIR, and says so at INFO
    # ("generated new fontManager"), which reads as the worker's own news in its log. Its
    # warnings still show, and a level someone set on that logger is left alone.
    logger = logging.getLogger(logger_name)
    if logger.level != logging.NOTSET:
        yield
        return
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(logging.NOTSET)


def data_cache_dir() -> Path | None:
    """Where generated datasets are kept (``CACHE_ENV``), or None when caching is off or the
    user has no home directory."""
    configured = os.environ.get(CACHE_ENV, "").strip()
    if configured.lower() == "off":
        return None
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return None if base.startswith("~") else Path(base) / "psgrpc"


_MNIST1D_ARRAYS = {"x": (np.float32, 2), "y": (np.int64, 1), "x_test": (np.float32, 2), "y_test": (np.int64, 1)}


def _digest(arrays: tuple[np.ndarray, ...]) -> bytes:
    hasher = hashlib.sha256()
    for a in arrays:
        hasher.update(f"{a.dtype.str}{a.shape}".encode())
        hasher.update(np.ascontiguousarray(a).data)
    return hasher.digest()


def _mnist1d_cache_file() -> Path | None:
    # The data is a pure function of the mnist1d release (get_dataset_args()' defaults, seed 42).
    directory = data_cache_dir()
    if directory is None:
        return None
    try:
        release = importlib.metadata.version("mnist1d")
    except importlib.metadata.PackageNotFoundError:
        return None
    return directory / f"mnist1d-{release}.npz"


def _read_mnist1d(path: Path) -> tuple[np.ndarray, ...] | None:
    """The arrays kept in ``path``, or None (logged) when it is missing, unreadable, of the
    wrong form or fails its checksum. Read with ``allow_pickle=False``: nothing is unpickled."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = tuple(np.array(data[key]) for key in _MNIST1D_ARRAYS)
            digest = np.array(data["sha256"]).tobytes()
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        log.warning("ignoring the cached MNIST-1D data in %s (%s): generating it again", path, exc)
        return None
    for (key, (dtype, ndim)), a in zip(_MNIST1D_ARRAYS.items(), arrays):
        if a.dtype != dtype or a.ndim != ndim:
            log.warning("ignoring the cached MNIST-1D data in %s: %r is %s of %d dimension(s), expected %s of %d; "
                        "generating it again", path, key, a.dtype, a.ndim, np.dtype(dtype), ndim)
            return None
    if digest != _digest(arrays):
        log.warning("ignoring the cached MNIST-1D data in %s: its checksum does not match its arrays; "
                    "generating it again", path)
        return None
    return arrays


def _keep_mnist1d(path: Path, arrays: tuple[np.ndarray, ...]) -> None:
    """Write ``arrays`` to ``path`` in one rename; a directory that cannot take it is logged
    and skipped (the next process generates the data again)."""
    buffer = io.BytesIO()
    np.savez(buffer, **dict(zip(_MNIST1D_ARRAYS, arrays)), sha256=np.frombuffer(_digest(arrays), dtype=np.uint8))
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomically(path, buffer.getvalue())
    except OSError as exc:
        log.info("cannot keep MNIST-1D in %s (%s): the next process generates it again (%s=off skips this)",
                 path.parent, exc, CACHE_ENV)


@functools.lru_cache(maxsize=1)
def _mnist1d_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """MNIST-1D's train and test arrays, read-only: from the data cache (:func:`data_cache_dir`)
    when it holds them, else generated (several seconds of CPU) and kept there."""
    path = _mnist1d_cache_file()
    arrays = _read_mnist1d(path) if path is not None else None
    if arrays is None:
        arrays = _generate_mnist1d()
        if path is not None:
            _keep_mnist1d(path, arrays)
    for a in arrays:
        a.flags.writeable = False  # shared by every load in this process
    return arrays  # type: ignore[return-value]


def _generate_mnist1d() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    # mnist1d imports matplotlib.pyplot; a headless worker must not need a display.
    os.environ.setdefault("MPLBACKEND", "Agg")
    with _quiet("matplotlib"):
        from mnist1d.data import get_dataset_args, make_dataset

    # make_dataset reseeds the global `random` and numpy RNGs (fixed seed 42, so the data
    # is the same for every task seed); restore them so callers' randomness is untouched.
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(get_dataset_args())  # generated offline; get_dataset would download
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return (data["x"].astype(np.float32), data["y"].astype(np.int64),
            data["x_test"].astype(np.float32), data["y_test"].astype(np.int64))


def _mnist1d_task(name: str, model: nn.Module, defaults: TaskDefaults) -> Task:
    x, y, x_test, y_test = (torch.tensor(a) for a in _mnist1d_arrays())  # private copies
    return Task(name=name, model=model, train=(x, y), test=(x_test, y_test),
                loss_fn=nn.functional.cross_entropy, defaults=defaults)


class _MnistCnn(nn.Module):
    """The MNIST-1D paper's CNN: three strided convolutions, then a linear classifier."""

    def __init__(self, channels: int = 25) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(1, channels, 5, stride=2, padding=1), nn.ReLU(),   # 40 -> 19
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),  # 19 -> 10
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),  # 10 -> 5
        )
        self.linear = nn.Linear(channels * 5, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.conv(x.view(-1, 1, x.shape[-1])).flatten(1))


# The MNIST-1D data is fixed (mnist1d's own seed 42); `seed` reaches the weights through the
# global RNG that load_task seeds. Both use the paper's Adam, lr 1e-2, batch 100: lower lr
# plateaus lower, and batch 50/64 or lr 1.5e-2 peak higher but, with 1-step-stale gradients,
# dip below 0.90 now and then. Steps: the MLP's test accuracy settles at 0.64-0.68 after about
# 2000 steps; the CNN's at 0.91-0.93 after about 2500, but 4000-step runs could still end in a
# dip, so it keeps the paper's 6000.
def _mnist1d_mlp(seed: int) -> Task:
    model = nn.Sequential(nn.Linear(40, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(),
                          nn.Linear(100, 10))
    return _mnist1d_task("mnist1d-mlp", model,
                         TaskDefaults(optimizer="adam", lr=1e-2, batch_size=100, steps=4000))


def _mnist1d_cnn(seed: int) -> Task:
    return _mnist1d_task("mnist1d-cnn", _MnistCnn(),
                         TaskDefaults(optimizer="adam", lr=1e-2, batch_size=100, steps=6000))


_LINREG_DIM, _LINREG_TRAIN, _LINREG_TEST, _LINREG_NOISE = 32, 4096, 1024, 0.01


def linreg_optimum(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The generating (weight, bias) of the ``linreg`` task for ``seed``.

    Shapes match ``nn.Linear(32, 1)``: weight (1, 32), bias (1,). With noise std 0.01 this is
    the least-squares optimum up to about 1e-3. Raises nothing.
    """
    g = torch.Generator().manual_seed(seed)  # private: depends on `seed` alone
    # Scaled so that targets have unit-order variance for standard-normal inputs.
    w = torch.randn(1, _LINREG_DIM, generator=g) / math.sqrt(_LINREG_DIM)
    b = torch.randn(1, generator=g)
    return w, b


def _linreg(seed: int) -> Task:
    w, b = linreg_optimum(seed)
    g = torch.Generator().manual_seed(seed + 1_000_003)  # a stream apart from the optimum's
    n = _LINREG_TRAIN + _LINREG_TEST
    x = torch.randn(n, _LINREG_DIM, generator=g)
    y = x @ w.T + b + _LINREG_NOISE * torch.randn(n, 1, generator=g)
    model = nn.Linear(_LINREG_DIM, 1)  # from the global RNG that load_task seeds
    defaults = TaskDefaults(optimizer="sgd", lr=0.05, batch_size=64, steps=1000)
    return Task(name="linreg", model=model,
                train=(x[:_LINREG_TRAIN], y[:_LINREG_TRAIN]),
                test=(x[_LINREG_TRAIN:], y[_LINREG_TRAIN:]),
                loss_fn=nn.functional.mse_loss, classification=False, defaults=defaults)


# A factory named "module:function" is imported when first loaded (dlrm-synth needs
# psworker.embedding, which the other tasks do not).
_BUILTIN_FACTORIES: dict[str, Callable[..., Task] | str] = {
    "mnist1d-mlp": _mnist1d_mlp, "mnist1d-cnn": _mnist1d_cnn, "linreg": _linreg,
    "dlrm-synth": "psworker.dlrm:dlrm_synth"}


def _builtin(spec: str) -> Callable[..., Task]:
    factory = _BUILTIN_FACTORIES[spec]
    if isinstance(factory, str):
        module_name, _, func_name = factory.partition(":")
        factory = getattr(importlib.import_module(module_name), func_name)
    return factory


def _check_options(spec: str, func: Callable[..., object], options: dict[str, str]) -> None:
    """Raise ValueError naming the first option ``func`` does not take."""
    for key, value in options.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"task {spec!r}: options must map strings to strings, got {key!r}: {value!r}")
    if "seed" in options:
        raise ValueError(f"task {spec!r}: 'seed' is not an option (it is load_task's seed=)")
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return  # no introspectable signature: let the call decide
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    known = [p.name for p in parameters if p.name != "seed"
             and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    for key in options:
        if key not in known:
            takes = f"its options are {', '.join(known)}" if known else "it takes no options"
            raise ValueError(f"task {spec!r} has no option {key!r} ({takes})")


def _resolve(spec: str) -> Callable[..., object]:
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name or ":" in func_name:
        raise ValueError(f"unknown task {spec!r}: expected one of {BUILTIN_TASKS} "
                         f"or 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"task {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    try:
        func = getattr(module, func_name)
    except AttributeError as exc:
        raise ValueError(f"task {spec!r}: module {module_name!r} has no attribute "
                         f"{func_name!r}") from exc
    if not callable(func):
        raise ValueError(f"task {spec!r}: {func_name!r} is not callable")
    try:
        # Checked up front so that a TypeError raised inside the function is not misreported.
        inspect.signature(func).bind(seed=0)
    except TypeError as exc:
        raise ValueError(f"task {spec!r}: {func_name!r} must accept a seed= keyword "
                         f"argument") from exc
    except ValueError:
        pass  # no introspectable signature (some builtins): let the call decide
    return func


def load_task(spec: str, *, seed: int = 0, options: Mapping[str, str] | None = None) -> Task:
    """Build the task named by ``spec``, with model weights initialised from ``seed``.

    ``spec`` is a name in ``BUILTIN_TASKS`` or ``"package.module:function"``; the function is
    called as ``function(seed=seed, **options)`` and must return a :class:`Task`. ``options``
    are the task's own settings, as strings (for ``dlrm-synth``: ``rows``, ``dim``, ...); the
    function converts them. The global torch RNG is seeded with ``seed`` during the call and
    restored afterwards, so user tasks that simply build their model get deterministic weights
    and the caller's RNG is unaffected.

    Raises ValueError if the name is unknown, the syntax is bad, the module cannot be imported,
    the function does not exist or takes no ``seed=``, an option is one the function does not
    take (every option, for built-in tasks without options), or it returns something other
    than a Task. Exceptions raised inside the user's function (including a Task's own
    ValueError from validation, and a built-in task's ValueError for a bad option value)
    propagate unchanged.
    """
    factory = _builtin(spec) if spec in _BUILTIN_FACTORIES else _resolve(spec)
    options = dict(options or {})
    _check_options(spec, factory, options)
    # Only the CPU generator is forked and seeded: models are built on the CPU, and touching
    # CUDA RNGs would initialise CUDA (and torch.manual_seed would leak into them unrestored).
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        task = factory(seed=seed, **options)
    if not isinstance(task, Task):
        raise ValueError(f"task {spec!r}: function returned {type(task).__name__}, not a Task")
    return task


def evaluate(model: nn.Module, task: Task, *, batch_size: int = 1000) -> dict[str, float]:
    """Mean loss (and accuracy, for classification tasks) of ``model`` on ``task.test``.

    Returns ``{"test_loss": ..., "test_accuracy": ...}`` (no accuracy for regression), then
    what ``task.metrics`` makes of all the test outputs and targets, and ``task.reference``;
    or ``{}`` if the task has no test split. Runs in eval mode without gradients, on the device of
    the model's parameters, and restores the model's previous mode. Raises ValueError if
    ``batch_size`` < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    if task.test is None:
        return {}
    inputs, targets = task.test
    # The test split stays on the CPU; batches follow the model (a worker may train on a GPU).
    device = next(model.parameters(), torch.empty(0)).device
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    outputs: list[torch.Tensor] = []  # kept only for task.metrics
    try:
        with torch.no_grad():
            for start in range(0, inputs.shape[0], batch_size):
                x = inputs[start:start + batch_size].to(device)
                y = targets[start:start + batch_size].to(device)
                out = model(x)
                # loss_fn is a batch mean; weight by batch size so a short last batch counts right.
                loss_sum += float(task.loss_fn(out, y)) * x.shape[0]
                if task.classification:
                    correct += int((out.argmax(dim=-1) == y).sum())
                if task.metrics is not None:
                    outputs.append(out.detach().cpu())
    finally:
        model.train(was_training)
    result = {"test_loss": loss_sum / inputs.shape[0]}
    if task.classification:
        result["test_accuracy"] = correct / inputs.shape[0]
    if task.metrics is not None:
        result.update(task.metrics(torch.cat(outputs), targets))
    result.update(task.reference)
    return result
