"""psctl's status table and --watch rates with embedding tables: a line per table and shard,
and the rows touched and pulled per second since the last refresh."""

from __future__ import annotations

import pytest

from psworker.ctl import _rates, _table

pytestmark = pytest.mark.timeout(30)


def _shard(address: str, pushed: int, pulled: int, applied: int = 10) -> dict:
    return {
        "shard_index": 0, "num_shards": 2, "address": address, "state": "ready", "num_variables": 2,
        "bytes_held": 100, "optimizer_state_bytes": 100, "version": applied, "clock": 1, "workers": [],
        "pushes_applied": applied, "pushes_dropped": 0, "pushes_scaled": 0, "pushes_rejected": 0, "max_staleness": 0,
        "optimizer": {"name": "adagrad", "lr": 0.1}, "consistency": {"mode": "async"}, "staleness_histogram": [],
        "pull_wait_seconds": 0.0, "lease_seconds": 30.0, "workers_evicted": 0, "push_bytes_in_flight": 0,
        "push_bytes_in_flight_peak": 0, "max_inflight_bytes": 0, "last_checkpoint_id": 0, "data": None,
        "tables": [{"spec": {"name": "emb", "num_rows": 1000, "dim": 8, "optimizer": {"name": "adagrad", "lr": 0.1}},
                    "rows_held": 500, "rows_written": 120, "bytes_resident": 7680, "rows_pushed": pushed,
                    "rows_pulled": pulled, "step": 3}],
    }


def test_status_names_each_table_on_each_shard():
    text = _table([_shard("a:1", 300, 400), _shard("b:2", 100, 200)])
    assert text.count("table 'emb' (1000 x 8, adagrad lr 0.1): 500 rows here, 120 written") == 2
    assert "a:1: table 'emb'" in text and "300 pushed, 400 pulled, step 3" in text


def test_status_shows_a_schedule_and_the_rate_of_the_next_update():
    shard = _shard("a:1", 0, 0, applied=149)
    shard["optimizer"] = {"name": "adam", "lr": 0.01, "warmup_steps": 100, "decay_steps": 1100, "min_lr_ratio": 0.0}
    text = _table([shard])
    # Update 150: 50 updates into a 1000-update cosine decay.
    assert ("optimizer adam lr 0.01 (warm-up over 100 updates, then cosine decay to 0 x lr at update 1100; "
            "update 150 at 0.00994)") in text
    assert "optimizer adagrad lr 0.1;" in _table([_shard("a:1", 0, 0)])


def test_watch_rates_count_table_rows_per_second():
    before = [_shard("a:1", 300, 400), _shard("b:2", 100, 200)]
    after = [_shard("a:1", 700, 1000, applied=30), _shard("b:2", 300, 400, applied=30)]
    line = _rates(before, after, 2.0)
    assert "table rows 300 touched/s and 400 pulled/s" in line and "20.0 pushes applied/s" in line
    without = [{k: v for k, v in s.items() if k != "tables"} for s in after]
    assert "table rows" not in _rates(without, without, 2.0)
