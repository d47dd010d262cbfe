"""Unit tests for the dlrm-synth task (psworker.dlrm), task options and Task.metrics/reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from psworker.config import parse_args as worker_args
from psworker.dlrm import _Zipf, auc, dlrm_synth
from psworker.embedding import ShardedEmbedding, localize
from psworker.tasks import Task, evaluate, load_task

pytestmark = pytest.mark.timeout(60)

HERE = "tests.unit.test_dlrm"
SMALL = {"rows": "20000", "examples": "4000", "test_examples": "2000"}


def _load(seed: int = 0, **options: str) -> Task:
    return load_task("dlrm-synth", seed=seed, options={**SMALL, **options})


# --- data ---------------------------------------------------------------------------------------

def test_data_is_deterministic_and_independent_of_the_model_seed() -> None:
    a, b, c = _load(0), _load(0), _load(7)
    for split in ("train", "test"):
        for t_a, t_b, t_c in zip(getattr(a, split), getattr(b, split), getattr(c, split)):
            assert torch.equal(t_a, t_b) and torch.equal(t_a, t_c)
    assert a.reference == c.reference
    # The model's seed reaches the MLP and the table's initializer.
    assert not torch.equal(a.model.top[0].weight, c.model.top[0].weight)
    assert torch.equal(a.model.top[0].weight, b.model.top[0].weight)
    assert (a.model.emb.seed, c.model.emb.seed) == (0, 7)
    # The test split does not depend on the training split's size.
    more = _load(0, examples="5000")
    assert torch.equal(more.test[0], a.test[0]) and torch.equal(more.train[0][:4000], a.train[0])


def test_shapes_dtypes_and_labels() -> None:
    task = _load(dense="5", features="3")
    x, y = task.train
    assert x.shape == (4000, 8) and x.dtype == torch.float64
    assert y.shape == (4000, 1) and y.dtype == torch.float32
    assert task.test[0].shape == (2000, 8)
    assert set(y.unique().tolist()) == {0.0, 1.0}
    assert 0.3 < float(y.mean()) < 0.7  # the teacher's logits are centred
    assert not task.classification and task.defaults.optimizer == "adagrad"
    assert task.defaults.batch_size == 256 and task.defaults.steps == 16  # one pass: ceil(4000 / 256)
    assert isinstance(task.model.emb, ShardedEmbedding) and task.model.emb.num_embeddings == 20000


def test_ids_stay_in_their_features_range_and_are_zipf_skewed() -> None:
    task = _load(examples="20000", features="4")
    ids = task.train[0][:, 13:]
    assert torch.equal(ids, ids.round())  # stored exactly
    ids = ids.long()
    for k in range(4):
        column = ids[:, k]
        lo, hi = k * 5000, (k + 1) * 5000
        assert lo <= int(column.min()) and int(column.max()) < hi
        counts = torch.bincount(column - lo, minlength=5000).sort(descending=True).values
        assert int(counts[:50].sum()) > 0.5 * column.numel()  # the top 1% of the ids: most examples
        assert int(torch.bincount(column - lo).argmax()) == 0  # rank 0 is the hottest id
    uniform = _load(examples="20000", zipf="0").train[0][:, 13].long()
    assert int(torch.bincount(uniform, minlength=5000).sort(descending=True).values[:50].sum()) < 0.05 * 20000


def test_zipf_sampler_matches_the_law_head_and_tail() -> None:
    size, s = 100_000, 1.1
    ranks = _Zipf(size, s).ranks(np.random.default_rng(0).random(400_000))
    assert ranks.min() >= 0 and ranks.max() < size
    p = np.arange(1, size + 1, dtype=np.float64) ** -s
    p /= p.sum()
    for lo, hi in [(0, 1), (1, 10), (10, 4096), (4096, 20_000), (20_000, size)]:
        assert np.mean((ranks >= lo) & (ranks < hi)) == pytest.approx(p[lo:hi].sum(), abs=0.005)
    small = _Zipf(3, 1.0).ranks(np.linspace(0, 1, 1000, endpoint=False))
    assert set(small.tolist()) == {0, 1, 2}


def test_a_ten_million_row_table_allocates_nothing_of_its_size() -> None:
    task = load_task("dlrm-synth", options={"rows": "10000000", "examples": "1000", "test_examples": "100"})
    assert int(task.train[0][:, 13:].max()) < 10_000_000
    assert sum(t.numel() * t.element_size() for t in (*task.train, *task.test)) < 1 << 20
    assert sum(p.numel() for p in task.model.parameters()) < 100_000  # the table is on the shards


# --- options ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "message"), [
    ({"rows": "many"}, r"rows='many' is not an integer"),
    ({"rows": "0"}, "rows='0' must be in"),
    ({"rows": "3", "features": "4"}, "must be >= features"),
    ({"dim": "1.5"}, "dim='1.5' is not an integer"),
    ({"zipf": "-1"}, "zipf='-1' must be a finite number >= 0"),
    ({"zipf": "nan"}, "zipf='nan' must be"),
    ({"batch": "0"}, "batch='0' must be >= 1"),
    ({"examples": ""}, "examples='' is not an integer"),
    ({"colour": "blue"}, "task 'dlrm-synth' has no option 'colour' \\(its options are rows, dim"),
    ({"seed": "1"}, "'seed' is not an option"),
    ({"init": "zeros"}, "init='zeros' must be uniform or normal"),
])
def test_bad_options_raise_value_error_naming_them(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_task("dlrm-synth", options={**SMALL, **options})


def test_numbers_may_be_written_as_whole_floats() -> None:
    task = dlrm_synth(rows="2e4", examples="4_000", test_examples=2000)
    assert task.model.emb.num_embeddings == 20000 and task.train[0].shape[0] == 4000


@pytest.mark.parametrize("name", ["linreg", "mnist1d-mlp"])
def test_builtin_tasks_without_options_refuse_any(name: str) -> None:
    with pytest.raises(ValueError, match=f"task '{name}' has no option 'x' \\(it takes no options\\)"):
        load_task(name, options={"x": "1"})
    assert load_task("linreg", options={}).name == "linreg"


def user_task(*, seed: int, size: str = "6") -> Task:
    n = int(size)
    x, y = torch.zeros(n, 2), torch.zeros(n, dtype=torch.int64)
    return Task(name=f"user-{n}", model=nn.Linear(2, 2), train=(x, y), loss_fn=nn.functional.cross_entropy)


def user_task_any(*, seed: int, **options: str) -> Task:
    return user_task(seed=seed, size=options.get("size", "3"))


def test_user_tasks_take_options_their_signature_names() -> None:
    assert load_task(f"{HERE}:user_task", options={"size": "4"}).name == "user-4"
    assert load_task(f"{HERE}:user_task").name == "user-6"
    assert load_task(f"{HERE}:user_task_any", options={"size": "5", "other": "x"}).name == "user-5"
    with pytest.raises(ValueError, match=f"task '{HERE}:user_task' has no option 'sise' \\(its options are size\\)"):
        load_task(f"{HERE}:user_task", options={"sise": "4"})


# --- teacher, metrics, evaluate and training ----------------------------------------------------

def test_auc_is_exact_with_ties() -> None:
    assert auc(torch.tensor([1.0, 2.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 1.0, 1.0])) == 0.875
    assert auc(np.array([3.0, 2.0, 1.0]), np.array([1, 0, 0])) == 1.0
    assert auc(np.array([1.0, 1.0]), np.array([1, 0])) == 0.5
    assert np.isnan(auc(np.array([1.0, 2.0]), np.array([1, 1])))
    rng = np.random.default_rng(1)
    s, y = rng.integers(0, 5, 300).astype(float), rng.integers(0, 2, 300)
    pairs = (s[y == 1][:, None] > s[y == 0][None, :]) + 0.5 * (s[y == 1][:, None] == s[y == 0][None, :])
    assert auc(s, y) == pytest.approx(pairs.mean())


def test_teacher_auc_is_in_a_sensible_range() -> None:
    reference = _load(test_examples="20000").reference
    assert 0.75 < reference["teacher_auc"] < 0.95
    assert 0.7 < reference["teacher_dense_auc"] < reference["teacher_auc"] - 0.03  # ids matter


@pytest.mark.parametrize("init", ["uniform", "normal"])
def test_init_scale_is_the_rows_standard_deviation_whichever_the_initializer(init: str) -> None:
    model = _load(init=init, init_scale="0.05").model
    assert model.emb.init == init
    rows = localize(model).emb.weight.detach()
    assert abs(float(rows.std()) - 0.05) < 0.002
    if init == "uniform":
        assert float(rows.abs().max()) <= 0.05 * 3 ** 0.5


def test_the_model_needs_its_table_prepared_or_localized() -> None:
    task = _load()
    with pytest.raises(RuntimeError, match="session.prepare"):
        task.model(task.train[0][:4])
    with pytest.raises(RuntimeError, match="session.prepare"):
        evaluate(task.model, task)


def test_evaluate_reports_auc_accuracy_and_the_reference() -> None:
    task = _load()
    model = localize(task.model)
    result = evaluate(model, task, batch_size=300)  # does not divide 2000
    assert set(result) == {"test_loss", "test_auc", "test_accuracy", "teacher_auc", "teacher_dense_auc"}
    assert result["teacher_auc"] == task.reference["teacher_auc"]
    with torch.no_grad():
        logits = model(task.test[0])
    assert result["test_auc"] == pytest.approx(auc(logits, task.test[1]))
    assert result["test_accuracy"] == pytest.approx(float(((logits > 0) == (task.test[1] > 0.5)).float().mean()))
    assert evaluate(model, task, batch_size=5000)["test_auc"] == pytest.approx(result["test_auc"])


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's Adagrad on sparse gradients
def test_short_local_training_learns_the_ids_too() -> None:
    # 100 ids per feature, each seen often enough to be learnt within a few hundred steps.
    task = load_task("dlrm-synth", seed=0, options={"rows": "400", "dim": "16", "examples": "20000",
                                                    "test_examples": "5000", "batch": "128"})
    model = localize(task.model)
    before = evaluate(model, task)["test_auc"]
    opt = torch.optim.Adagrad(model.parameters(), lr=task.defaults.lr)
    x, y = task.train
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        idx = torch.randint(0, x.shape[0], (task.defaults.batch_size,), generator=gen)
        loss = task.loss_fn(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    result = evaluate(model, task)
    assert result["test_auc"] > max(0.75, before + 0.1)
    assert result["test_auc"] > result["teacher_dense_auc"] + 0.015  # beyond what the dense features give
    assert result["test_auc"] > 0.95 * result["teacher_auc"]


def test_evaluate_keeps_other_tasks_results() -> None:
    task = load_task("linreg", seed=0)
    assert set(evaluate(task.model, task)) == {"test_loss"}


def test_task_validates_metrics_and_reference() -> None:
    x, y = torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64)
    base = dict(name="t", model=nn.Linear(2, 2), train=(x, y), loss_fn=nn.functional.cross_entropy)
    with pytest.raises(ValueError, match="metrics must be callable"):
        Task(**base, metrics=3)
    with pytest.raises(ValueError, match="reference must be a dict"):
        Task(**base, reference={"a": "b"})
    task = Task(**base, test=(x, y), metrics=lambda out, t: {"n": float(out.shape[0])}, reference={"best": 1.0})
    result = evaluate(task.model, task, batch_size=3)  # the metrics see all 4 outputs at once
    assert list(result) == ["test_loss", "test_accuracy", "n", "best"]
    assert (result["n"], result["best"]) == (4.0, 1.0)


# --- config -------------------------------------------------------------------------------------

def test_config_task_options() -> None:
    config = worker_args(["--local", "--task", "dlrm-synth", "--task-options", " rows=1000, dim = 8,,zipf=1.2"], {})
    assert config.task_option_map() == {"rows": "1000", "dim": "8", "zipf": "1.2"}
    assert worker_args(["--local"], {}).task_option_map() == {}
    env = worker_args(["--local"], {"PSWORKER_TASK_OPTIONS": "rows=5,name=a=b"})
    assert env.task_option_map() == {"rows": "5", "name": "a=b"}


@pytest.mark.parametrize(("text", "message"), [
    ("rows", "'rows' is not KEY=VALUE"),
    ("=5", "'=5' is not KEY=VALUE"),
    ("rows=1,rows=2", "'rows' is given twice"),
])
def test_config_refuses_malformed_task_options(text: str, message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        worker_args(["--local", "--task-options", text], {})
    assert message in capsys.readouterr().err
