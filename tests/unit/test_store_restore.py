"""What a restored shard gives out: never a worker id that a worker still uses from before the
crash, so that worker is told to re-register (fenced), not refused as someone else."""

from __future__ import annotations

import pytest

from psserver.store import RESTORE_ID_GAP, ShardStore
from pswire.errors import FencedError
from tests.unit.test_shard_metrics import ONES, PART, job, registration

pytestmark = pytest.mark.timeout(60)


def test_a_worker_that_joined_after_the_checkpoint_is_fenced_not_taken_for_a_newcomer():
    store, w = job("a")
    _, tensors, metadata = store.export()  # the checkpoint: it knows only "a"
    late = store.register(registration("late"))  # joins after the checkpoint, then the shard dies
    restored = ShardStore()
    restored.restore(tensors, metadata, source="test")
    newcomer = restored.register(registration("newcomer"))
    assert newcomer.worker_id >= late.worker_id + RESTORE_ID_GAP - 1
    with pytest.raises(FencedError, match="not registered with this shard"):
        restored.apply_push(late.worker_id, late.generation, 1, 0, [PART], [ONES], session=late.session)
    again = restored.register(registration("late"))  # what the fenced worker does next
    assert restored.apply_push(again.worker_id, again.generation, 1, 0, [PART], [ONES], session=again.session)
