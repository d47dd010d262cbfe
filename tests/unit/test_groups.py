"""A shard's small variables updated as one (``psserver.groups``): bit for bit what updating them
one by one gives, for every rule; pushes that leave a member out; pulls holding a member while
the group is updated; refusals that name the member at fault and change nothing; checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from psserver import groups
from psserver.consistency import Consistency, Mode
from psserver.store import NonFiniteError, Registration, ShardStore
from pswire.codec import Part
from pswire.dtypes import FLOAT16, FLOAT32, FLOAT64
from pswire.optim import OptimizerConfig

pytestmark = pytest.mark.timeout(60)

CONFIGS = [
    OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
    OptimizerConfig(name="adam", lr=0.01, eps=1e-3),  # float16 squares of small gradients underflow to 0
    OptimizerConfig(name="adagrad", lr=0.1, eps=1e-3),
]


def parts(dtype=FLOAT32) -> tuple[Part, ...]:
    """Three small variables of one dtype, a large one, and one of another dtype."""
    other = FLOAT64 if dtype is not FLOAT64 else FLOAT32
    return (Part("a", (3, 4), dtype, 0, 3), Part("b", (4,), dtype, 0, 4), Part("big", (600, 256), dtype, 0, 600),
            Part("c", (5, 2), dtype, 0, 5), Part("d", (6,), other, 0, 6))


def started(config: OptimizerConfig, layout: tuple[Part, ...], mode: Mode = Mode.ASYNC, workers: int = 1):
    store = ShardStore()
    regs = [store.register(Registration(
        worker_name=f"w{i}", shard_index=0, num_shards=1, placement_digest="digest", parts=layout,
        optimizer=config, job_fingerprint="job", consistency=Consistency(mode=mode),
    )) for i in range(workers)]
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in layout]
    assert store.initialize(regs[0].worker_id, regs[0].generation, values)[0]
    return store, regs


def push(store, reg, sequence, layout, grads, keys=None, *, clock=0):
    chosen = [(p, g) for p, g in zip(layout, grads) if keys is None or p.key in keys]
    return store.apply_push(reg.worker_id, reg.generation, sequence, 0, [p for p, _ in chosen],
                            [g.copy() for _, g in chosen], session=reg.session, clock=clock, base_clock=clock)


def everything(store, layout) -> dict:
    _, tensors, _ = store.export()
    return {name: (t.dtype, t.shape, t.tobytes()) for name, t in tensors.items()
            if name.startswith(("var/", "opt/"))}


def gradients(layout, rng):
    return [rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in layout]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT64, FLOAT16], ids=lambda d: d.name)
def test_grouped_updates_are_bit_for_bit_the_updates_one_by_one(monkeypatch, config, dtype):
    layout = parts(dtype)
    results = []
    for limit in (0, groups.GROUP_PART_BYTES):  # 0: nothing grouped, as before groups
        monkeypatch.setattr(groups, "GROUP_PART_BYTES", limit)
        store, (reg,) = started(config, layout)
        grouped = {key for key, slot in store._slots.items() if slot.group is not None}
        assert grouped == (set() if limit == 0 else {"a", "b", "c"})
        rng = np.random.default_rng(1)
        sequence = 0
        for keys in (None, None, {"a", "c", "big"}, None, None):  # one push leaves "b" out
            sequence += 1
            push(store, reg, sequence, layout, gradients(layout, rng), keys)
        results.append(everything(store, layout))
    assert results[0] == results[1]


def test_a_pull_holding_a_grouped_variable_keeps_its_values_while_the_group_is_updated():
    layout = parts()
    store, (reg,) = started(CONFIGS[0], layout)
    snapshot = store.pull({}, timeout=1.0)
    held = {p.part.key: p.value.copy() for p in snapshot.parts}
    push(store, reg, 1, layout, gradients(layout, np.random.default_rng(2)))
    push(store, reg, 2, layout, gradients(layout, np.random.default_rng(3)), {"b"})  # one member alone
    for pulled in snapshot.parts:
        assert np.array_equal(pulled.value, held[pulled.part.key])
    snapshot.release()
    for key in ("a", "b", "c"):
        assert not np.array_equal(store.tensor(key), held[key])
        slot = store._slots[key]
        assert np.shares_memory(slot.value, slot.group.value)  # still views of the group's array


@pytest.mark.parametrize("bad", ["nan", "overflow"])
def test_a_refused_grouped_push_names_the_member_at_fault_and_changes_nothing(bad):
    layout = parts()
    store, (reg,) = started(CONFIGS[2], layout)  # adagrad: a finite gradient of 3e38 squares to infinity
    before = everything(store, layout)
    grads = gradients(layout, np.random.default_rng(4))
    grads[3][2, 1] = np.nan if bad == "nan" else np.float32(3e38)
    message = "gradient for 'c' contains NaN or Inf" if bad == "nan" else "refused: 'c': the update would make"
    with pytest.raises(NonFiniteError, match=message):
        push(store, reg, 1, layout, grads)
    assert everything(store, layout) == before
    status = store.status()
    assert status["updates_nonfinite"] == (bad == "overflow")
    grads[3][2, 1] = 0.0
    assert push(store, reg, 1, layout, grads).version == 1  # the same sequence, now finite


def test_a_sync_clock_updates_the_group_as_one_and_a_restored_shard_groups_again():
    layout = parts()
    store, regs = started(CONFIGS[1], layout, Mode.SYNC, workers=2)
    rng = np.random.default_rng(5)
    for sequence in (1, 2):
        for reg in regs:
            push(store, reg, sequence, layout, gradients(layout, rng), clock=sequence - 1)
    assert store.status()["version"] == 2
    _, tensors, metadata = store.export()
    restored = ShardStore()
    restored.restore(tensors, metadata, source="test")
    assert everything(restored, layout) == everything(store, layout)
    assert {key for key, slot in restored._slots.items() if slot.group is not None} == {"a", "b", "c"}
