"""The dynamic-data ledger: with workers joining, killed and stopped, and shard 0 killed and
restored mid-epoch, every example of the job is trained, none is skipped, and an example is
trained twice only where a task went back to the queue with some of it already trained.

The job is ``tests.chaos.ledger_task:ledger``: its parameter ``counts`` gains exactly 1 at index
``i`` each time example ``i`` is trained (SGD, lr 1, gradient -1), and it lies whole on shard 0
beside the data queue, so a reader that pulls it after the job reads how often every example
was trained. A task goes back to the queue partly trained in two ways only, and those are the
examples allowed a second training:

- its holder was evicted (SIGKILL here) or registered again: the tasks it held, which the shard
  logs as "NAME was evicted: N data task(s) back in the queue (...)";
- shard 0 was restored from a checkpoint: the tasks leased in that checkpoint go back whole,
  their counts as they were when the checkpoint was cut.

A worker stopped with SIGTERM reports what it trained of its task and hands back only the rest:
it adds nothing to the allowed doubles. Real psserver and psworker processes on loopback, async.

The last test: a worker that registered after the checkpoint shard 0 restores from is not in it;
after the restore it must drop the tasks it held (the restored queue leases them again) even
though the restored shard may give it its old generation number again.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from psserver.checkpoint import CheckpointStore
from pswire.placement import model_spec
from psworker.client import ClientOptions, PSClient
from psworker.elastic import epoch_order
from tests.chaos.ledger_task import BATCH, EXAMPLES, Ledger, ledger_placement
from tests.conftest import ROOT, child_env, run_cli, terminate, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LEASE = 3.0
"""Seconds: short, so that a killed worker is evicted soon, but beyond the stalls of two busy cores."""
TASK = "tests.chaos.ledger_task:ledger"
TASK_SIZE = 40
"""Examples per data task: 20 steps, about half a second of one worker's training."""
SEED = 0
OPTIONS = ClientOptions(timeout=10, connect_timeout=10)
WAIT = 120.0
"""Deadline of every wait for the job to reach a point: generous, for two busy cores."""

_RELEASED = re.compile(r"(\S+) (was evicted|registered again|left): \d+ data task\(s\) back in the queue \((.*)\)$",
                       re.MULTILINE)
_TASK = re.compile(r"epoch (\d+) \[(\d+), (\d+)\)")

TaskRange = tuple[int, int, int]
"""A data task as (epoch, start, end)."""


class Worker:
    """One ``psworker`` with dynamic data (no --worker-index) training the ledger's one epoch."""

    def __init__(self, directory: Path, ps: str, name: str) -> None:
        self.name = name
        self.out_path, self.err_path = directory / f"{name}.out", directory / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "psworker", "--ps", ps, "--task", TASK, "--epochs", "1",
                 "--data-task-size", str(TASK_SIZE), "--seed", str(SEED), "--worker-name", name,
                 "--threads", "1", "--progress", "log", "--rpc-timeout", "10"],
                stdout=out, stderr=err, env=child_env(), cwd=ROOT,
            )

    def log(self) -> str:
        return self.err_path.read_text(errors="replace")[-4000:]

    def alive(self) -> bool:
        assert self.popen.poll() is None, f"{self.name} exited with {self.popen.returncode}:\n{self.log()}"
        return True

    def result(self, timeout: float = 240) -> dict:
        """Wait for the worker to exit 0 and return its JSON line."""
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            terminate(self.popen)
            raise AssertionError(f"{self.name} did not finish within {timeout}s:\n{self.log()}") from None
        assert self.popen.returncode == 0, f"{self.name} exited with {self.popen.returncode}:\n{self.log()}"
        lines = [line for line in self.out_path.read_text().splitlines() if line.startswith("{")]
        assert lines, f"{self.name} printed no result:\n{self.log()}"
        return json.loads(lines[-1])

    def kill(self, sig: signal.Signals) -> None:
        self.popen.send_signal(sig)


@pytest.fixture
def workers(tmp_path):
    """A factory: ``workers(ps, name)`` starts a :class:`Worker`; any still running after the
    test are stopped."""
    started: list[Worker] = []

    def start(ps: str, name: str) -> Worker:
        started.append(Worker(tmp_path, ps, name))
        return started[-1]

    yield start
    for worker in started:
        terminate(worker.popen)


def _status(ps: str):
    """Shard 0's StatusResponse (the queue and the workers live there)."""
    with PSClient(ps, OPTIONS) as client:
        return client.status()[0]


def _held(status, name: str) -> set[TaskRange]:
    return {(h.task.epoch, h.task.start, h.task.end) for h in status.data.holders if h.worker_name == name}


def _pushes(status, name: str) -> int:
    return sum(w.pushes for w in status.workers if w.worker_name == name)


def _counts(ps: str) -> torch.Tensor:
    """How often each example was trained: the job's ``counts``, pulled by a reader."""
    params = {name: p.data for name, p in Ledger().named_parameters()}
    with PSClient(ps, OPTIONS) as client:
        client.wait_connected()
        client.set_placement(model_spec(params.items()))
        client.pull(params, skip_unchanged=False)
    return params["counts"]


def _released(log: str) -> list[tuple[str, str, set[TaskRange]]]:
    """Every "data task(s) back in the queue" line of a shard's log: (worker, why, tasks)."""
    return [(name, why, {tuple(map(int, t)) for t in _TASK.findall(tasks)})
            for name, why, tasks in _RELEASED.findall(log)]


def _examples(tasks: set[TaskRange]) -> set[int]:
    """The example indices of data tasks of the ledger's (single) epoch."""
    order = epoch_order(EXAMPLES, SEED, 0)
    assert all(epoch == 0 for epoch, _, _ in tasks), tasks
    return {int(i) for _, start, end in tasks for i in order[start:end]}


def _check_ledger(counts: torch.Tensor, allowed: set[int], why: str, thrice_allowed: frozenset[int] = frozenset()
                  ) -> set[int]:
    """Every example trained once, or twice where ``allowed``, or three times where
    ``thrice_allowed`` (its task had two second chances); returns the doubles."""
    assert torch.equal(counts, counts.round()), "counts must stay whole numbers (+1 per training)"
    skipped = (counts < 1).nonzero().flatten().tolist()
    assert not skipped, f"{len(skipped)} example(s) never trained, e.g. {skipped[:10]}"
    over = (counts > 3).nonzero().flatten().tolist()
    assert not over, f"{len(over)} example(s) trained 4+ times, e.g. {over[:10]}: {counts[over[:10]]}"
    thrice = [i for i in (counts == 3).nonzero().flatten().tolist() if i not in thrice_allowed]
    assert not thrice, f"{len(thrice)} example(s) trained 3 times, e.g. {thrice[:10]}: {counts[thrice[:10]]}"
    doubles = set((counts == 2).nonzero().flatten().tolist())
    unexpected = sorted(doubles - allowed)
    assert not unexpected, (f"{len(unexpected)} example(s) trained twice outside the tasks {why} "
                            f"({len(allowed)} examples), e.g. {unexpected[:10]}")
    return doubles


def _given_back(logs: list[str]) -> dict[str, set[TaskRange]]:
    """Per worker, the tasks that went back to the queue because its registration ended without
    a report (it was evicted, or registered again): the tasks allowed a second training. In these
    tests that is the worker killed with SIGKILL, every worker after a restore, and (on a machine
    so busy that a live worker's heartbeats stall past the lease) possibly another: an eviction
    is an eviction. A worker leaving gracefully reports first, so a release on leaving is a bug."""
    given: dict[str, set[TaskRange]] = {}
    for log in logs:
        for name, why, tasks in _released(log):
            assert why != "left", f"{name} left holding {tasks}: it should have reported them first"
            given.setdefault(name, set()).update(tasks)
    return given


def _scale_to_three_and_kill_b(ps: str, workers):
    """w-a trains two tasks alone, w-b and w-c join; once both hold a task and w-b is 5 steps
    into its own, w-b is SIGKILLed. Returns (w-a, w-c), still training."""
    a = workers(ps, "w-a")
    wait_until(lambda: a.alive() and _status(ps).data.tasks_done >= 2, WAIT, a.popen, "w-a's first two tasks")
    b, c = workers(ps, "w-b"), workers(ps, "w-c")
    wait_until(lambda: all(w.alive() for w in (a, b, c))
               and (s := _status(ps)) and _held(s, "w-b") and _held(s, "w-c") and _pushes(s, "w-b") >= 5,
               WAIT, b.popen, "w-b and w-c holding tasks, w-b 5 steps in")
    b.kill(signal.SIGKILL)
    b.popen.wait(timeout=30)
    return a, c


def test_workers_scaled_1_3_2_train_every_example_once_but_the_killed_ones_tasks(shards, workers):
    ledger_placement(2)  # counts whole on shard 0, beside the queue; pad on shard 1
    shard0, shard1 = shards(2, "--lease-timeout", str(LEASE))
    ps = f"{shard0.address},{shard1.address}"

    # Three workers train; w-b is some steps into a task when it dies.
    a, c = _scale_to_three_and_kill_b(ps, workers)
    # What the queue leases to w-b now, it died holding (a request of w-b's already on its way
    # could still report or lease one more: the eviction's own record is below).
    died_holding = _held(_status(ps), "w-b")

    # w-a and w-c train on; w-c stops gracefully mid-task halfway through the job: it reports
    # what it trained of its task and exits 0.
    wait_until(lambda: c.alive() and (s := _status(ps)) and _held(s, "w-c") and s.data.examples_done >= EXAMPLES // 2,
               WAIT, c.popen, "half of the job done, w-c holding a task")
    c.kill(signal.SIGTERM)
    result_c = c.result(timeout=60)
    assert not _held(_status(ps), "w-c"), "w-c handed back everything it held before exiting"

    wait_until(lambda: "evicted w-b " in shard0.log(), 10 * LEASE, a.popen, "w-b's eviction")
    result_a = a.result()
    assert result_a["data"]["stopped"] is False and result_c["data"]["stopped"] is True
    assert result_c["data"]["examples"] > 0

    given = _given_back([shard0.log()])
    from_b = given.get("w-b", set())
    doubles = _check_job(ps, set().union(died_holding, *given.values()), "the killed worker held")
    if set(given) <= {"w-b"}:  # (no live worker was evicted)
        for r in (result_a, result_c):  # every example it trained was reported, and only those
            assert r["data"]["examples"] == r["samples"], r
        # The queue credits each example once: w-a's and w-c's reports, and w-b's trainings but
        # those it died before reporting (the doubles, retrained by the others).
        credited_b = _pushes(_status(ps), "w-b") * BATCH - len(doubles)
        assert result_a["data"]["examples"] + result_c["data"]["examples"] + credited_b == EXAMPLES, (
            result_a["data"], result_c["data"], credited_b)
    print(f"w-b died holding {sorted(died_holding)}, its eviction gave back {sorted(from_b)}; also given back: "
          f"{ {k: sorted(v) for k, v in given.items() if k != 'w-b'} }; {len(doubles)} example(s) trained twice; "
          f"w-a {result_a['data']['examples']} examples, w-c {result_c['data']['examples']} (stopped)")


def _restart_restored(shards, shard, flags: tuple[str, ...], ckpt: Path):
    """SIGKILL shard 0 and start it again with --restore on its port. Returns the new shard,
    the id of the checkpoint it restored and that checkpoint's part (read the way the shard reads
    it, before it can write a newer one), after checking that part's counts and queue agree."""
    shard.popen.send_signal(signal.SIGKILL)
    shard.popen.wait(timeout=30)
    loaded = CheckpointStore(ckpt).load(0, 1)
    assert loaded is not None, "no complete checkpoint to restore"
    checkpoint_id, part = loaded
    (restored,) = shards(1, *flags, "--port", str(shard.port), "--restore")
    assert f"restored checkpoint {checkpoint_id} " in restored.log(), restored.log()
    _check_checkpoint(part)
    return restored, checkpoint_id, part


def _registrations(status) -> dict[str, int]:
    """Live workers and their generations, as shard 0's Status tells them."""
    return {w.worker_name: w.generation for w in status.workers if w.live}


def _checkpointed_registrations(metadata: dict) -> dict[str, int]:
    """Live workers and their generations, as a checkpoint of shard 0 holds them."""
    return {w["name"]: w["generation"] for w in metadata["workers"] if w["live"]}


def test_shard0_restored_from_a_checkpoint_trains_every_example_once_but_the_leased_ones(tmp_path, shards, workers):
    ledger_placement(1)
    ckpt = tmp_path / "ckpt"
    flags = ("--lease-timeout", str(LEASE), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "40",
             "--shard-index", "0", "--num-shards", "1")
    (shard,) = shards(1, *flags)
    ps = shard.address
    a, c = _scale_to_three_and_kill_b(ps, workers)
    wait_until(lambda: "evicted w-b " in shard.log(), 10 * LEASE, a.popen, "w-b's eviction")

    # Kill shard 0 mid-task for w-a and w-c, once the newest checkpoint was cut after w-b's
    # eviction with every live registration as it is now (a worker registered after the
    # checkpoint is test_worker_registered_after_the_checkpoint_... below).
    def cut_after_eviction() -> bool:
        assert a.alive() and c.alive()
        loaded = CheckpointStore(ckpt).load(0, 1)
        if loaded is None:
            return False
        metadata = loaded[1].metadata
        registrations = _checkpointed_registrations(metadata)
        return (set(registrations) == {"w-a", "w-c"} and registrations == _registrations(_status(ps))
                and bool(metadata["data"]["leased"]))

    wait_until(cut_after_eviction, WAIT, a.popen, "a checkpoint cut after w-b's eviction")
    old_log = shard.log()
    shard, checkpoint_id, part = _restart_restored(shards, shard, flags, ckpt)
    leased = {tuple(t) for t in part.metadata["data"]["leased"]}

    # After the restore w-c re-registers, leases again and stops gracefully some steps in.
    restored_pushes = _pushes(_status(ps), "w-c")
    wait_until(lambda: c.alive() and (s := _status(ps)) and _held(s, "w-c")
               and _pushes(s, "w-c") >= restored_pushes + 25, WAIT, c.popen, "w-c 25 steps past the restore")
    c.kill(signal.SIGTERM)
    result_c = c.result(timeout=60)
    assert not _held(_status(ps), "w-c"), "w-c handed back everything it held before exiting"
    result_a = a.result()
    assert result_a["rejoins"] >= 1 and result_c["rejoins"] >= 1, "both rode through the restore"
    assert result_a["data"]["stopped"] is False and result_c["data"]["stopped"] is True

    # A task can have two second chances: w-b's, given back at its eviction and trained again
    # by w-a or w-c, can be theirs mid-way when the checkpoint is cut, and so go back once more
    # at the restore. Its examples (w-b's part, then the re-leaser's part before the cut) may
    # then count three trainings.
    at_eviction, at_restore = _given_back([old_log]), _given_back([shard.log()])
    evicted = set().union(*at_eviction.values())
    restored = set().union(leased, *at_restore.values())
    doubles = _check_job(ps, evicted | restored, f"leased in checkpoint {checkpoint_id} or the killed worker held",
                         thrice_allowed=frozenset(_examples(evicted) & _examples(restored)))
    print(f"restored checkpoint {checkpoint_id} with {len(leased)} task(s) leased; given back at the eviction "
          f"{ {k: sorted(v) for k, v in at_eviction.items()} }, at the restore "
          f"{ {k: sorted(v) for k, v in at_restore.items()} }; {len(doubles)} example(s) trained twice")


def test_worker_registered_after_the_checkpoint_drops_its_tasks_on_the_restore(tmp_path, shards, workers):
    ledger_placement(1)
    ckpt = tmp_path / "ckpt"
    flags = ("--lease-timeout", str(LEASE), "--checkpoint-dir", str(ckpt), "--shard-index", "0", "--num-shards", "1")
    (shard,) = shards(1, *flags)
    ps = shard.address
    a = workers(ps, "w-a")
    wait_until(lambda: a.alive() and _status(ps).data.tasks_done >= 1, WAIT, a.popen, "w-a's first task")
    done = run_cli("psworker.ctl", "checkpoint", "--ps", ps, timeout=60)  # psctl checkpoint
    assert done.returncode == 0, done.stderr
    b = workers(ps, "w-b")  # joins after the checkpoint
    wait_until(lambda: b.alive() and (s := _status(ps)) and _held(s, "w-b") and _pushes(s, "w-b") >= 5,
               WAIT, b.popen, "w-b 5 steps in")
    old_log = shard.log()
    shard, checkpoint_id, part = _restart_restored(shards, shard, flags, ckpt)
    leased = {tuple(t) for t in part.metadata["data"]["leased"]}
    results = {"w-a": a.result(), "w-b": b.result()}
    assert all(r["rejoins"] >= 1 for r in results.values()), "both rode through the restore"
    _check_job(ps, set().union(leased, *_given_back([old_log, shard.log()]).values()),
               f"leased in checkpoint {checkpoint_id}")


def _check_job(ps: str, allowed: set[TaskRange], why: str, thrice_allowed: frozenset[int] = frozenset()) -> set[int]:
    """The finished job's queue and ledger: every example credited once, trained once or, in
    ``allowed`` tasks, twice (the examples ``thrice_allowed``: three times); the counts are
    exactly the applied pushes. Returns the doubles."""
    status = _status(ps)
    assert status.data.finished and status.data.examples_done == EXAMPLES, status.data
    assert status.data.tasks_leased == 0 and not status.data.holders
    counts = _counts(ps)
    assert counts.sum().item() == status.pushes_applied * BATCH, "every applied push trained one batch, once"
    return _check_ledger(counts, _examples(allowed), why, thrice_allowed)


def _check_checkpoint(part) -> None:
    """The checkpoint holds the counts and the queue as of one moment: every example of a task
    done is counted, none past the frontier is, and the queue credits exactly the examples cut
    but not queued or leased; the counts sum to the pushes applied."""
    queue = part.metadata["data"]
    (key,) = [k for k in part.tensors if k.startswith("var/counts")]
    counts = torch.from_numpy(part.tensors[key].copy())
    frontier = queue["frontier"]
    open_tasks = [tuple(t) for t in queue["queued"] + queue["leased"]]
    assert queue["examples_done"] == frontier - sum(end - start for _, start, end in open_tasks), queue
    order = epoch_order(EXAMPLES, SEED, 0)
    undone = torch.zeros(EXAMPLES, dtype=torch.bool)
    for _, start, end in open_tasks:
        undone[order[start:end]] = True
    undone[order[frontier:]] = True
    done = ~undone
    assert bool((counts[done] >= 1).all()), "an example of a task done is not counted in the checkpoint"
    assert bool((counts[order[frontier:]] == 0).all()), "an example past the frontier is counted"
    applied = part.metadata["counters"]["pushes_applied"]
    assert counts.sum().item() == applied * BATCH, (counts.sum().item(), applied)
