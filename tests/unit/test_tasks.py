"""Unit tests for psworker.tasks: built-in tasks, the user-task contract, evaluation."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from psworker import tasks
from psworker.embedding import localize
from psworker.tasks import BUILTIN_TASKS, Task, TaskDefaults, evaluate, linreg_optimum, load_task

pytestmark = pytest.mark.timeout(120)

HERE = "tests.unit.test_tasks"


# --- helpers loaded through "module:function" specs -------------------------------------------

def make_tiny_task(*, seed: int) -> Task:
    """A user task whose model is built from the global RNG, as a user would write it."""
    x = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    y = torch.tensor([0, 1, 0, 1, 0, 1])
    return Task(name=f"tiny-{seed}", model=nn.Linear(2, 2), train=(x, y), test=(x, y),
                loss_fn=nn.functional.cross_entropy)


def returns_not_a_task(*, seed: int) -> dict:
    return {"seed": seed}


def takes_no_seed() -> Task:
    return make_tiny_task(seed=0)


NOT_CALLABLE = 42


# --- built-ins ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_builtin_loads_with_consistent_shapes(name: str) -> None:
    # dlrm-synth's table lives on the shards (localize makes it local); its inputs are float64
    # so that they hold the ids exactly (tests/unit/test_dlrm.py).
    options = {"examples": "1000", "test_examples": "100"} if name == "dlrm-synth" else {}
    task = load_task(name, seed=0, options=options)
    assert task.name == name
    (x, y), (x_test, y_test) = task.train, task.test
    assert x.dtype == (torch.float64 if name == "dlrm-synth" else torch.float32)
    assert x.shape[0] == y.shape[0] and x_test.shape[0] == y_test.shape[0]
    localize(task.model)
    out = task.model(x[:7])
    loss = task.loss_fn(out, y[:7])
    assert loss.dim() == 0
    loss.backward()  # every parameter takes part in training
    assert all(p.grad is not None for p in task.model.parameters())
    if task.classification:
        assert out.shape == (7, 10) and y.dtype == torch.int64
    else:
        assert out.shape == y[:7].shape


def test_mnist1d_split_sizes() -> None:
    task = load_task("mnist1d-cnn", seed=0)
    assert task.train[0].shape == (4000, 40) and task.test[0].shape == (1000, 40)
    assert set(task.train[1].unique().tolist()) == set(range(10))


def test_linreg_shapes() -> None:
    task = load_task("linreg", seed=0)
    assert task.train[0].shape == (4096, 32) and task.train[1].shape == (4096, 1)
    assert task.test[0].shape == (1024, 32)
    assert not task.classification
    w, b = linreg_optimum(0)
    assert w.shape == task.model.weight.shape and b.shape == task.model.bias.shape


@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_same_seed_same_weights_and_data_different_seed_different_weights(name: str) -> None:
    a, b, c = load_task(name, seed=3), load_task(name, seed=3), load_task(name, seed=4)
    for key, value in a.model.state_dict().items():
        assert torch.equal(value, b.model.state_dict()[key])
    assert torch.equal(a.train[0], b.train[0]) and torch.equal(a.train[1], b.train[1])
    assert any(not torch.equal(v, c.model.state_dict()[k]) for k, v in a.model.state_dict().items())


def test_loads_do_not_share_tensors() -> None:
    # The data is cached; a worker mutating its copy must not affect the next load.
    a = load_task("mnist1d-mlp", seed=0)
    a.train[0].zero_()
    assert load_task("mnist1d-mlp", seed=0).train[0].abs().sum() > 0


def test_load_task_leaves_global_rngs_untouched() -> None:
    tasks._mnist1d_arrays.cache_clear()  # exercise the generation path, which reseeds numpy
    torch.manual_seed(123); np.random.seed(123); random.seed(123)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(123); np.random.seed(123); random.seed(123)
    load_task("mnist1d-mlp", seed=7)
    load_task(f"{HERE}:make_tiny_task", seed=7)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_linreg_sgd_converges_to_known_optimum() -> None:
    torch.manual_seed(0)
    task = load_task("linreg", seed=5)
    x, y = task.train
    opt = torch.optim.SGD(task.model.parameters(), lr=task.defaults.lr)
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        idx = torch.randint(0, x.shape[0], (task.defaults.batch_size,), generator=gen)
        opt.zero_grad()
        task.loss_fn(task.model(x[idx]), y[idx]).backward()
        opt.step()
    w, b = linreg_optimum(5)
    torch.testing.assert_close(task.model.weight.detach(), w, atol=5e-3, rtol=0)
    torch.testing.assert_close(task.model.bias.detach(), b, atol=5e-3, rtol=0)
    assert evaluate(task.model, task)["test_loss"] < 1e-3  # noise variance is 1e-4


# --- user tasks --------------------------------------------------------------------------------

def test_user_task_via_module_function_is_seeded() -> None:
    a = load_task(f"{HERE}:make_tiny_task", seed=1)
    b = load_task(f"{HERE}:make_tiny_task", seed=1)
    c = load_task(f"{HERE}:make_tiny_task", seed=2)
    assert a.name == "tiny-1"
    assert torch.equal(a.model.weight, b.model.weight)
    assert not torch.equal(a.model.weight, c.model.weight)
    assert a.defaults == TaskDefaults(optimizer="sgd", lr=0.01, batch_size=64, steps=1000)


@pytest.mark.parametrize(("spec", "message"), [
    ("mnist1d-transformer", "unknown task 'mnist1d-transformer'"),
    ("a:b:c", "unknown task 'a:b:c'"),
    (":make_tiny_task", "unknown task"),
    (f"{HERE}:", "unknown task"),
    ("no_such_package_xyz.mod:f", "cannot import module 'no_such_package_xyz.mod'"),
    (f"{HERE}:no_such_function", "has no attribute 'no_such_function'"),
    (f"{HERE}:NOT_CALLABLE", "'NOT_CALLABLE' is not callable"),
    (f"{HERE}:returns_not_a_task", "returned dict, not a Task"),
    (f"{HERE}:takes_no_seed", "must accept a seed= keyword"),
])
def test_bad_specs_raise_value_error_naming_the_spec(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        load_task(spec)
    assert repr(spec) in str(info.value)


# --- validation --------------------------------------------------------------------------------

def _task(**overrides: object) -> Task:
    x, y = torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64)
    kwargs = dict(name="t", model=nn.Linear(2, 2), train=(x, y), loss_fn=nn.functional.cross_entropy)
    kwargs.update(overrides)
    return Task(**kwargs)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"name": ""}, "non-empty"),
    ({"model": lambda x: x}, "must be a torch.nn.Module"),
    ({"loss_fn": 3}, "loss_fn must be callable"),
    ({"train": (torch.zeros(4, 2), torch.zeros(3))}, "differ in length: 4 vs 3"),
    ({"train": (torch.zeros(0, 2), torch.zeros(0))}, "empty"),
    ({"train": [torch.zeros(4, 2), torch.zeros(4)]}, "tuple"),
    ({"test": (torch.zeros(2, 2), torch.zeros(5))}, "test inputs and targets differ"),
    ({"defaults": {"lr": 1}}, "TaskDefaults"),
])
def test_task_validation(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _task(**overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"optimizer": "rmsprop"}, "optimizer"),
    ({"lr": 0.0}, "lr"),
    ({"lr": float("nan")}, "lr"),
    ({"batch_size": 0}, "batch_size"),
    ({"steps": 0}, "steps"),
    ({"momentum": 1.0}, "momentum"),
])
def test_task_defaults_validation(overrides: dict, message: str) -> None:
    kwargs = dict(optimizer="sgd", lr=0.1, batch_size=8, steps=10)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=message):
        TaskDefaults(**kwargs)


# --- evaluate ----------------------------------------------------------------------------------

class _OneHot(nn.Module):
    """Outputs the one-hot of its integer input: a perfect classifier for targets == inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 10.0 * nn.functional.one_hot(x.long().squeeze(-1), 3).float()


def test_evaluate_perfect_classifier_and_restores_mode() -> None:
    y = torch.tensor([0, 1, 2, 2, 1, 0, 1])
    model = _OneHot()
    task = _task(model=model, train=(y[:, None].float(), y), test=(y[:, None].float(), y))
    result = evaluate(model, task, batch_size=3)  # 3 does not divide 7: partial last batch
    assert result["test_accuracy"] == 1.0
    assert result["test_loss"] < 1e-3
    assert model.training
    model.eval()
    evaluate(model, task)
    assert not model.training


def test_evaluate_loss_is_independent_of_batch_size() -> None:
    task = load_task("linreg", seed=0)
    full = evaluate(task.model, task, batch_size=10_000)
    assert set(full) == {"test_loss"}
    assert evaluate(task.model, task, batch_size=100)["test_loss"] == pytest.approx(full["test_loss"])


def test_evaluate_without_test_split_and_bad_batch_size() -> None:
    task = _task()
    assert evaluate(task.model, task) == {}
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(task.model, task, batch_size=0)


def test_public_surface() -> None:
    assert set(tasks.__all__) == {"BUILTIN_TASKS", "CACHE_ENV", "Task", "TaskDefaults", "data_cache_dir", "evaluate",
                                  "linreg_optimum", "load_task"}
    assert BUILTIN_TASKS == ("mnist1d-mlp", "mnist1d-cnn", "linreg", "dlrm-synth")
