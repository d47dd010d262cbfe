"""The learning-rate schedule the shards run over their update count (``OptimizerConfig``'s
``warmup_steps``, ``decay_steps``, ``min_lr_ratio``): torch's schedulers' rates, refused settings
named, carried on the wire and in checkpoints, applied by a shard at its update ``t`` (also to a
sync clock's mean and after a restore), and by ``--local``'s baseline at step ``t``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from psserver.store import ShardStore
from pswire.consistency import Consistency, Mode
from pswire.optim import MAX_SCHEDULE_STEPS, OptimizerConfig
from pswire.v1 import ps_pb2
from pswire.wire import optimizer_from_proto, optimizer_to_proto
from pswire.errors import InvalidArgumentError
from psworker.config import parse_args
from psworker.training import local_training
from tests.unit.test_shard_metrics import PART, registration, registry_of

pytestmark = pytest.mark.timeout(120)


def _torch_rates(warmup: int, decay: int, ratio: float, updates: int) -> list[float]:
    """torch's rates for updates 1..``updates``: LinearLR over the warm-up, then
    CosineAnnealingLR, with lr 1."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    stages, milestones = [], []
    if warmup:
        stages.append(torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0,
                                                        total_iters=max(warmup - 1, 1)))
        milestones.append(warmup)
    if decay:
        stages.append(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=decay - warmup, eta_min=ratio))
    scheduler = stages[0] if len(stages) == 1 else torch.optim.lr_scheduler.SequentialLR(opt, stages, milestones)
    rates = []
    for _ in range(updates):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("warmup,decay,ratio", [(10, 100, 0.1), (0, 50, 0.0), (5, 0, 0.0), (1, 7, 0.5)])
def test_the_rates_are_torch_schedulers_rates_and_decay_holds_at_its_end(warmup, decay, ratio):
    config = OptimizerConfig(lr=1.0, warmup_steps=warmup, decay_steps=decay, min_lr_ratio=ratio)
    end = decay or warmup
    ours = [config.lr_factor(t) for t in range(1, end + 1)]
    assert ours == pytest.approx(_torch_rates(warmup, decay, ratio, end), rel=1e-12, abs=1e-15)
    # After the schedule: the last rate held (torch's cosine would climb again), never 0.
    assert [config.lr_factor(t) for t in (end + 1, end + 1000)] == [ours[-1]] * 2
    assert min(ours) > 0
    assert config.scheduled


def test_no_schedule_is_exactly_lr():
    config = OptimizerConfig(name="adam", lr=0.01)
    assert not config.scheduled and config.describe_schedule() == "constant"
    assert {config.lr_factor(t) for t in (1, 2, 10**12)} == {1.0}
    with pytest.raises(ValueError, match="counted from 1"):
        config.lr_factor(0)


@pytest.mark.parametrize("settings,message", [
    ({"warmup_steps": -1}, "warmup_steps must be an integer"),
    ({"decay_steps": 2.5}, "decay_steps must be an integer"),
    ({"warmup_steps": True}, "warmup_steps must be an integer"),
    ({"decay_steps": MAX_SCHEDULE_STEPS + 1}, "decay_steps must be an integer"),
    ({"warmup_steps": 10, "decay_steps": 10}, r"decay_steps \(10\) must be above warmup_steps \(10\)"),
    ({"decay_steps": 10, "min_lr_ratio": 1.5}, r"min_lr_ratio must be in \[0, 1\]"),
    ({"min_lr_ratio": 0.1}, "min_lr_ratio needs decay_steps"),
])
def test_bad_schedules_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**settings)
    # The same refusal when the settings come off the wire, as the shard's InvalidArgument.
    msg = optimizer_to_proto(OptimizerConfig())
    for key, value in settings.items():
        try:
            setattr(msg, key, value)
        except (TypeError, ValueError):
            return  # the proto's types refuse it first
    with pytest.raises(InvalidArgumentError, match=message):
        optimizer_from_proto(msg)


def test_the_schedule_rides_the_wire_and_checkpoints_and_old_peers_send_none():
    config = OptimizerConfig(name="adam", lr=0.01, warmup_steps=300, decay_steps=6000, min_lr_ratio=0.05)
    assert optimizer_from_proto(optimizer_to_proto(config)) == config
    assert OptimizerConfig.from_dict(config.to_dict()) == config
    # A peer or checkpoint from before schedules sends none of the three: a constant rate.
    legacy = ps_pb2.OptimizerSettings(name="adam", lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8)
    assert not optimizer_from_proto(legacy).scheduled
    old = {k: v for k, v in config.to_dict().items() if k not in ("warmup_steps", "decay_steps", "min_lr_ratio")}
    assert not OptimizerConfig.from_dict(old).scheduled


SCHEDULE = OptimizerConfig(name="sgd", lr=1.0, warmup_steps=4, decay_steps=10, min_lr_ratio=0.25)


def _scheduled_job(consistency: Consistency = Consistency()):
    store = ShardStore()
    reg = store.register(dataclasses.replace(registration("a", consistency), optimizer=SCHEDULE))
    assert store.initialize(reg.worker_id, reg.generation, [np.zeros(2)]) == (True, 0)
    return store, reg


def _weights(store: ShardStore) -> np.ndarray:
    snapshot = store.pull({}, timeout=5)
    try:
        return snapshot.parts[0].value.copy()
    finally:
        snapshot.release()


def test_a_shard_applies_update_t_at_lr_times_the_factor_of_t_and_resumes_after_a_restore():
    store, w = _scheduled_job()
    registry = registry_of(store)
    expected = np.zeros(2)
    for t in range(1, 7):
        # psserver_learning_rate: the rate the next update (t) runs at.
        assert registry.get_sample_value("psserver_learning_rate") == SCHEDULE.lr * SCHEDULE.lr_factor(t)
        result = store.apply_push(w.worker_id, w.generation, t, t - 1, [PART], [np.ones(2)], session=w.session)
        assert result.version == t
        expected -= SCHEDULE.lr_factor(t)  # SGD with lr 1 and a gradient of ones
        assert _weights(store) == pytest.approx(expected, rel=1e-15)
    assert registry_of(ShardStore()).get_sample_value("psserver_learning_rate") == 0.0  # before a job
    # A restored shard carries on at its restored update count, not from the warm-up again.
    _, tensors, metadata = store.export()
    restored = ShardStore()
    restored.restore(tensors, metadata, source="test")
    again = restored.register(dataclasses.replace(registration("a"), optimizer=SCHEDULE))
    restored.apply_push(again.worker_id, again.generation, 1, 6, [PART], [np.ones(2)], session=again.session)
    assert _weights(restored) == pytest.approx(expected - SCHEDULE.lr_factor(7), rel=1e-15)


def test_a_sync_clocks_mean_is_applied_at_its_updates_rate():
    store, w = _scheduled_job(Consistency(mode=Mode.SYNC))
    expected = np.zeros(2)
    for clock in range(3):
        store.apply_push(w.worker_id, w.generation, clock + 1, clock, [PART], [np.full(2, 2.0)], clock=clock,
                         base_clock=clock, session=w.session)
        expected -= 2.0 * SCHEDULE.lr_factor(clock + 1)
        assert _weights(store) == pytest.approx(expected, rel=1e-15)


def test_local_training_steps_at_the_same_rates():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    _, optimizer = local_training(model, SCHEDULE)
    expected = 0.0
    for t in range(1, 13):
        optimizer.zero_grad()
        model.weight.grad = torch.ones_like(model.weight)
        optimizer.step()
        expected -= SCHEDULE.lr_factor(t)
        assert model.weight.detach().numpy() == pytest.approx(np.full((1, 2), expected), rel=1e-6)


def test_worker_flags_make_the_schedule_and_cosine_ends_with_the_job_by_default():
    def config(*flags: str, job_updates: int = 6000) -> OptimizerConfig:
        return parse_args(["--ps", "h:1", *flags], env={}).optimizer_config(default_name="adam", default_lr=0.01,
                                                                    job_updates=job_updates)

    assert not config().scheduled
    assert config("--warmup-steps", "100").warmup_steps == 100 and config("--warmup-steps", "100").decay_steps == 0
    cosine = config("--lr-schedule", "cosine", "--warmup-steps", "100", "--min-lr-ratio", "0.1")
    assert (cosine.warmup_steps, cosine.decay_steps, cosine.min_lr_ratio) == (100, 6000, 0.1)
    assert config("--lr-schedule", "cosine", "--decay-steps", "500").decay_steps == 500
    with pytest.raises(ValueError, match="belong to --lr-schedule cosine"):
        config("--decay-steps", "500")
    with pytest.raises(ValueError, match="the decay ends at update 50"):
        config("--lr-schedule", "cosine", "--warmup-steps", "100", job_updates=50)
