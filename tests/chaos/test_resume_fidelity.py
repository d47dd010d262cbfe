"""Resume fidelity: in sync mode with one worker a run is deterministic, so N steps straight and
k steps, a stop of the whole cluster, a restore and N - k more steps must end in the same state
bit for bit: parameters, optimizer state (Adam's step count included) and the worker's data
position. Both runs end with an on-demand checkpoint, and the two checkpoints are compared."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from psserver.checkpoint import CheckpointStore
from tests.conftest import run_cli, start_shard

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

N, K = 60, 23
SHARDS = 2
FINAL_ID = 1_000_000


def _cluster(directory: Path, name: str, ckpt: Path, *extra: str):
    return [
        start_shard(directory, f"{name}{i}", "--checkpoint-dir", str(ckpt), "--shard-index", str(i),
                    "--num-shards", str(SHARDS), *extra)
        for i in range(SHARDS)
    ]


def _train(ps: str, steps: int) -> dict:
    done = run_cli(
        "psworker", "--ps", ps, "--task", "mnist1d-mlp", "--mode", "sync", "--optimizer", "adam",
        "--steps", str(steps), "--threads", "1", "--progress", "log",
        "--worker-index", "0",  # the static split: a restarted worker resumes at its recorded step
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def _checkpoint(ps: str, checkpoint_id: int) -> None:
    done = run_cli("psworker.ctl", "checkpoint", "--ps", ps, "--id", str(checkpoint_id), timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]


def _state(ckpt: Path) -> list[tuple[int, dict[str, np.ndarray], dict]]:
    store = CheckpointStore(str(ckpt))
    parts = []
    for index in range(SHARDS):
        found = store.load(index, SHARDS)
        assert found is not None, f"no complete checkpoint in {ckpt}"
        checkpoint_id, part = found
        parts.append((checkpoint_id, part.tensors, part.metadata))
    return parts


def _run(directory: Path, name: str, steps: int, checkpoint_id: int, *extra: str) -> dict:
    """Start the shards (with ``extra`` flags), train one worker to ``steps``, write checkpoint
    ``checkpoint_id`` and stop every shard. Returns the worker's result."""
    shards = _cluster(directory, name, directory / "ckpt", *extra)
    try:
        if "--restore" in extra:
            assert all("restored checkpoint" in s.log() for s in shards)
        ps = ",".join(s.address for s in shards)
        result = _train(ps, steps)
        _checkpoint(ps, checkpoint_id)
        return result
    finally:
        for shard in shards:
            shard.stop()


def test_k_steps_restore_and_the_rest_equals_n_steps_straight(tmp_path):
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    straight_dir.mkdir(), resumed_dir.mkdir()

    _run(straight_dir, "shard", N, FINAL_ID)
    first = _run(resumed_dir, "first", K, K)  # then the whole cluster goes down
    rest = _run(resumed_dir, "second", N, FINAL_ID, "--restore")

    assert (first["first_step"], first["steps"]) == (1, K)
    assert (rest["first_step"], rest["steps"]) == (K + 1, N), "the restarted worker must resume at step k + 1"
    assert rest["samples"] == (N - K) * 100

    a, b = _state(straight_dir / "ckpt"), _state(resumed_dir / "ckpt")
    compared = 0
    for (id_a, tensors_a, meta_a), (id_b, tensors_b, meta_b) in zip(a, b):
        assert id_a == id_b == FINAL_ID
        assert tensors_a.keys() == tensors_b.keys()
        for key, value in tensors_a.items():
            assert (value.dtype, value.shape) == (tensors_b[key].dtype, tensors_b[key].shape)
            assert value.tobytes() == tensors_b[key].tobytes(), f"{key} differs after the resume"
            compared += 1
        steps = {key: int(t) for key, t in tensors_a.items() if key.endswith("/step")}
        assert steps and set(steps.values()) == {N}, steps  # Adam's step count
        assert meta_a["version"] == meta_b["version"] == N
        assert meta_a["clock"] == meta_b["clock"] == N
        (worker_a,), (worker_b,) = meta_a["workers"], meta_b["workers"]
        assert worker_a["data"] == worker_b["data"]
        assert worker_a["data"]["step"] == N
    print(f"resume fidelity: {compared} tensors identical after {K} + {N - K} steps vs {N} straight; "
          f"data position {worker_a['data']}")
