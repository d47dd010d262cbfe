"""A job on a Ray cluster: ``pscluster --ray [ADDRESS]`` and ``psworker.ray.run(...)``.

Ray places, supervises and scales the processes; the data path stays this project's own (gRPC
and bulk lanes between nodes). What runs where:

- **Shards** are Ray actors, one per bundle of a placement group with the ``SPREAD`` strategy,
  so they land on different nodes when there are several. Each actor runs ``psserver`` as its
  child process bound to the node's address, with ``--restore auto`` and the job's checkpoints
  in ``RUN_DIR/checkpoints``. When the child dies the actor ends its own process, and when the
  actor's process dies Ray restarts it (``max_restarts``): on the same node (its bundle stays
  there) it serves on the port it had and restores the newest complete checkpoint, so the
  workers ride through as they do a restart under ``pscluster --restart``. A shard that comes
  back on another node (its node is gone) has a new address: the workers are then replaced by
  ones that know it.
- **Workers** are Ray actors that each run an elastic ``psworker`` (no ``--worker-index``:
  they lease data tasks from shard 0), asking Ray for ``--worker-cpus`` CPUs, a GPU each with
  ``--device cuda``, and ``--worker-resources``, spread over the nodes. A worker whose actor
  dies (its node went away, or its process was killed) is replaced under the same name while
  the job's data is not done, up to ``--max-restarts`` times per worker; the data tasks it held
  go back to the queue when its lease runs out or its replacement registers.
- **Scaling**: ``pscluster --ray ADDRESS --job-name NAME --set-workers N`` (or
  :func:`set_workers`) reaches the running job through a named actor. New workers join and
  lease data; removed ones (the newest first) stop after their step and hand back what they
  hold.
- **The run directory** (``--run-dir``) holds the checkpoints, the shards' addresses and the
  ``--auth`` tokens and ``--tls`` certificates: on several machines it must be a path every
  node sees (NFS, a shared volume). Every actor checks that it sees it and fails, naming it,
  when it does not.

Every child's lines reach the driver through Ray's log streaming, prefixed with the child's
name; the summary is ``pscluster``'s. ``ray`` is an optional dependency (``psgrpc[ray]``).

The actors, the code Ray runs on the nodes, are in ``psworker.ray_actors``; this module is the
driver's side.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from psworker.children import exit_reason
from psworker.cluster import _credentials, final_summary
from psworker.clusterflags import RAY_RUN_MARK, _metrics_flags, _shard_config
from psworker.ray_actors import JobControl, ShardActor, WorkerActor
from psworker.sdfile import MetricsTargets

__all__ = ["ShardActor", "WorkerActor", "run", "run_on_ray", "set_workers", "set_workers_cli", "worker_options"]

log = logging.getLogger("pscluster")

NAMESPACE = "psgrpc"
"""The Ray namespace of every job's actors (the control actor's name is the job's name)."""
_POLL_SECONDS = 0.5
_SHARD_POLL_SECONDS = 2.0


def worker_options(args: argparse.Namespace, device: str) -> dict:
    """What a worker asks Ray for: ``--worker-cpus`` CPUs, one GPU when its ``--device`` is
    CUDA (``auto`` asks for none: Ray would hold a GPU for a worker that might not use it), and
    ``--worker-resources``; spread over the nodes."""
    gpus = 1 if device.startswith("cuda") else 0
    return {"num_cpus": args.worker_cpus, "num_gpus": gpus, "resources": dict(args.worker_resources),
            "scheduling_strategy": "SPREAD", "max_restarts": 0}


def shard_bundles(args: argparse.Namespace) -> list[dict[str, float]]:
    """The shards' placement group bundles: one per shard, placed with the SPREAD strategy."""
    return [{"CPU": args.shard_cpus, **args.shard_resources} for _ in range(args.shards)]


@dataclass
class _Slot:
    """A worker of the job: its current actor, and what became of it."""

    index: int
    actor: object
    info: dict | None = None
    info_ref: object | None = None
    poll_ref: object | None = None
    stopping: bool = False
    restarts: int = 0
    ended: str | None = None  # "done", "removed" (scaled down), "lost" or "unplaced"
    results: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"worker-{self.index}"


@dataclass
class _ShardSlot:
    index: int
    actor: object
    info: dict
    ref: object | None = None
    restarts: int = 0


def _import_ray():
    """``ray``, with its log relay set for pscluster: every line of every child as it came (Ray
    folds repeated lines by default), colored only on a terminal."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    import ray

    return ray


class _RayJob:
    def __init__(self, args: argparse.Namespace, worker_args: list[str], run_dir: Path) -> None:
        ray = _import_ray()

        self.ray = ray
        self.args, self.worker_args, self.run_dir = args, worker_args, run_dir
        self.device = args.device
        self.job_id = uuid.uuid4().hex
        self.shards: list[_ShardSlot] = []
        self.workers: list[_Slot] = []
        self.recoveries: list[dict] = []
        self.ps = ""
        self.data_done = False
        self.control = self.pg = self.credentials = self.metrics = None
        self.shard_env: dict[str, str] = {}

    # -- start

    def start(self) -> None:
        ray, args = self.ray, self.args
        ray.init(address=args.ray or None, namespace=NAMESPACE, logging_level=logging.WARNING,
                 log_to_driver=True)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        hosts = sorted({n["NodeManagerAddress"] for n in nodes})
        total = ray.cluster_resources()
        log.info("Ray cluster: %d node(s) (%s), resources %s", len(nodes), ", ".join(hosts),
                 {k: v for k, v in total.items() if not k.startswith("node:") and "memory" not in k})
        if worker_options(args, self.device)["num_gpus"] and total.get("GPU", 0) < 1:
            raise RuntimeError(f"--device {self.device}: the Ray cluster has no GPU, so no worker could be placed "
                               "(start nodes with GPUs, or --device cpu)")
        if (self.run_dir / RAY_RUN_MARK).is_file():
            log.info("the run directory %s held a job before: its shards restore from its checkpoints, and the "
                     "job goes on from there", self.run_dir)
        (self.run_dir / RAY_RUN_MARK).write_text(self.job_id + "\n")
        env, _ = _shard_config(args, self.run_dir)
        # What pscluster sets for its shards (the checkpoint defaults) and the user's PSSERVER_*.
        self.shard_env = {k: v for k, v in env.items() if k.startswith("PSSERVER_")}
        self.shard_env.setdefault("PSSERVER_CHECKPOINT_DIR", str(self.run_dir / "checkpoints"))
        self.credentials = _credentials(args, self.run_dir, hosts)
        if args.metrics:
            sd_file = Path(args.metrics_sd_file).resolve() if args.metrics_sd_file else None
            self.metrics = MetricsTargets(sd_file, args.shards, args.workers)
        try:
            # On the driver's own node: it lives as long as the driver does, whatever node goes.
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self.control = ray.remote(JobControl).options(name=args.job_name, num_cpus=0,
                                                          scheduling_strategy=here).remote(args.workers)
        except ValueError as exc:
            raise RuntimeError(f"a job named {args.job_name!r} already runs on this Ray cluster ({exc}); give "
                               "another --job-name") from None
        self._start_shards()
        for i in range(args.workers):
            self._start_worker(i)

    def _start_shards(self) -> None:
        ray, args = self.ray, self.args
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = shard_bundles(args)
        self.pg = placement_group(bundles, strategy="SPREAD")
        try:
            ray.get(self.pg.ready(), timeout=args.start_timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"Ray could not place {args.shards} shard(s) needing {bundles[0]} each within "
                               f"{args.start_timeout:.0f}s: the cluster has {ray.available_resources()} "
                               "available") from None
        argv = ["--shard-index", None, "--num-shards", str(args.shards), "--restore", "auto",
                *self.credentials.shard_args, *args.shard_arg, *_metrics_flags(args)]
        actor = ray.remote(ShardActor)
        actors = []
        for i in range(args.shards):
            argv[1] = str(i)
            actors.append(actor.options(
                num_cpus=args.shard_cpus, resources=dict(args.shard_resources), max_restarts=args.max_restarts,
                max_task_retries=-1, scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, i),
            ).remote(i, args.shards, str(self.run_dir), self.job_id, list(argv), self.shard_env, args.start_timeout))
        try:
            infos = ray.get([a.info.remote() for a in actors], timeout=args.start_timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"shards did not start listening within {args.start_timeout:.0f}s") from None
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"a shard could not start: {exc}") from None
        self.shards = [_ShardSlot(i, a, info) for i, (a, info) in enumerate(zip(actors, infos))]
        self.ps = ",".join(info["address"] for info in infos)
        for s in self.shards:
            log.info("shard%d serves on %s (Ray actor pid %d, psserver pid %d)", s.index, s.info["address"],
                     s.info["pid"], s.info["server_pid"])
            self._report_metrics("shard", s.index, s.info)
        log.info("%d shard(s) listening: %s", args.shards, self.ps)

    def _worker_argv(self, name: str) -> list[str]:
        args, creds = self.args, self.credentials
        token = ["--token-file", str(creds.worker_token_file)] if creds.worker_token_file else []
        return ["--ps", self.ps, "--task", args.task, "--worker-name", name, "--progress", "log",
                "--threads", str(max(1, int(args.worker_cpus))), *creds.worker_args, *token,
                *_metrics_flags(args), *self.worker_args]

    def _start_worker(self, index: int, slot: _Slot | None = None) -> None:
        name = f"worker-{index}"
        actor = self.ray.remote(WorkerActor).options(**worker_options(self.args, self.device)).remote(
            name, str(self.run_dir), self.job_id, self._worker_argv(name), {})
        if slot is None:
            self.workers.append(_Slot(index, actor))
        else:
            slot.actor, slot.info, slot.info_ref, slot.poll_ref, slot.ended = actor, None, None, None, None
        log.info("%s asked of Ray (%s)", name, {k: v for k, v in worker_options(self.args, self.device).items()
                                                 if k in ("num_cpus", "num_gpus", "resources")})

    def _report_metrics(self, role: str, index: int, info: dict) -> None:
        if self.metrics is not None and info.get("metrics"):
            host, _, port = info["metrics"].rpartition(":")
            self.metrics.reported(f"{role}{index}", role, index,
                                  f"{info['host']}:{port}" if host in ("0.0.0.0", "[::]", "") else info["metrics"])

    # -- watch

    def _ready(self, ref) -> bool:
        return ref is not None and bool(self.ray.wait([ref], timeout=0)[0])

    def watch(self, interrupted: threading.Event) -> bool:
        last_shards = last_control = 0.0
        while not interrupted.is_set():
            now = time.monotonic()
            if now - last_shards >= _SHARD_POLL_SECONDS:
                last_shards = now
                self._watch_shards()
            if now - last_control >= 1.0:
                last_control = now
                self._scale()
            for slot in self.workers:
                self._watch_worker(slot)
            if self.data_done:
                for slot in self.workers:  # asked of Ray, not placed yet: no longer needed
                    if slot.ended is None and slot.info is None:
                        self.ray.kill(slot.actor)
                        slot.ended = "unplaced"
                        log.warning("%s was not placed by Ray before the job's data was done; it is not needed "
                                    "any more", slot.name)
                if all(slot.ended is not None for slot in self.workers):
                    return True
            interrupted.wait(timeout=_POLL_SECONDS)
        return False

    def _watch_shards(self) -> None:
        ray = self.ray
        for s in self.shards:
            if s.ref is None:
                s.ref = s.actor.info.remote()
                continue
            if not self._ready(s.ref):
                continue
            try:
                info = ray.get(s.ref)
            except ray.exceptions.ActorUnavailableError:
                continue  # restarting, or its node is not yet declared dead: asked again
            except ray.exceptions.RayActorError as exc:
                raise RuntimeError(f"shard{s.index} is gone for good ({exc})") from None
            finally:
                s.ref = None
            if info["pid"] != s.info["pid"]:
                s.restarts += 1
                restored = (f"restored checkpoint {info['restored']}" if info["restored"] is not None
                            else "started empty (no complete checkpoint yet)")
                log.warning("shard%d was restarted by Ray (restart %d): serving on %s (Ray actor pid %d, psserver "
                            "pid %d), %s", s.index, s.restarts, info["address"], info["pid"], info["server_pid"],
                            restored)
                self.recoveries.append({"process": f"shard{s.index}", "reason": "restarted by Ray",
                                        "pid": s.info["pid"], "new_pid": info["pid"],
                                        "restored": info["restored"], "address": info["address"]})
                moved = info["address"] != s.info["address"]
                s.info = info
                self._report_metrics("shard", s.index, info)
                if moved:
                    self._follow_moved_shards()
            elif info.get("metrics") != s.info.get("metrics"):
                s.info = info
                self._report_metrics("shard", s.index, info)

    def _follow_moved_shards(self) -> None:
        """A shard came back on another node: running workers know its old address, so each is
        replaced by one (same name) that knows the new one."""
        self.ps = ",".join(s.info["address"] for s in self.shards)
        log.warning("a shard moved to another node: the job's shards are now %s; replacing the running workers",
                    self.ps)
        for slot in self.workers:
            if slot.ended is None:
                self.ray.kill(slot.actor)
                self._start_worker(slot.index, slot)

    def _scale(self) -> None:
        ray = self.ray
        try:
            wanted = ray.get(self.control.workers_wanted.remote(), timeout=10)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
            log.warning("cannot read the job's wanted workers from its control actor: %s", _first_line(exc))
            return
        live = [s for s in self.workers if s.ended is None and not s.stopping]
        if not self.data_done and wanted > len(live):
            log.info("scaling to %d worker(s): adding %d", wanted, wanted - len(live))
            for _ in range(wanted - len(live)):
                self._start_worker(len(self.workers))
        elif wanted < len(live):
            log.info("scaling to %d worker(s): stopping %d (they hand back their data)", wanted, len(live) - wanted)
            for slot in live[wanted:]:
                slot.stopping = True
                if slot.info is None:
                    ray.kill(slot.actor)
                    slot.ended = "removed"
                else:
                    slot.actor.stop.remote()
        self.control.publish.remote({
            "ps": self.ps, "wanted": wanted, "data_done": self.data_done,
            "workers": {s.name: {"host": (s.info or {}).get("host"), "state": s.ended or
                                 ("stopping" if s.stopping else "running" if s.info else "pending")}
                        for s in self.workers}})

    def _watch_worker(self, slot: _Slot) -> None:
        ray = self.ray
        if slot.ended is not None:
            return
        try:
            if slot.info is None:
                slot.info_ref = slot.info_ref or slot.actor.info.remote()
                if not self._ready(slot.info_ref):
                    return
                slot.info = ray.get(slot.info_ref)
                log.info("%s runs on %s (Ray actor pid %d, psworker pid %d)", slot.name, slot.info["host"],
                         slot.info["pid"], slot.info["worker_pid"])
            slot.poll_ref = slot.poll_ref or slot.actor.poll.remote()
            if not self._ready(slot.poll_ref):
                return
            state, slot.poll_ref = ray.get(slot.poll_ref), None
        except ray.exceptions.ActorUnavailableError:
            # Unreachable for now (a network blip, or a node Ray has not yet declared dead):
            # asked again until Ray says it is alive or dead.
            slot.info_ref = slot.poll_ref = None
            return
        except ray.exceptions.RayActorError as exc:
            self._lost(slot, f"its actor died ({_first_line(exc)})")
            return
        if not slot.info.get("metrics") and state.get("metrics"):
            slot.info["metrics"] = state["metrics"]
            self._report_metrics("worker", slot.index, slot.info)
        if state["returncode"] is None:
            return
        ray.kill(slot.actor)
        if state["returncode"] == 0 and state["result"] is not None:
            slot.results.append(state["result"])
            slot.ended = "removed" if slot.stopping else "done"
            if not slot.stopping:
                self.data_done = True
            return
        self._lost(slot, f"psworker ended with {exit_reason(state['returncode'])}: {' | '.join(state['tail'])}")

    def _lost(self, slot: _Slot, reason: str) -> None:
        if slot.stopping or self.data_done:
            slot.ended = "lost"
            log.warning("%s lost: %s", slot.name, reason)
            return
        if slot.restarts >= self.args.max_restarts:
            raise RuntimeError(f"{slot.name} lost after {slot.restarts} replacement(s) (--max-restarts "
                               f"{self.args.max_restarts}): {reason}")
        slot.restarts += 1
        log.warning("%s lost: %s; the data tasks it held go back to the queue; replacing it (replacement %d of %d)",
                    slot.name, reason, slot.restarts, self.args.max_restarts)
        self.recoveries.append({"process": slot.name, "reason": reason,
                                "pid": (slot.info or {}).get("pid"), "replacement": slot.restarts})
        self._start_worker(slot.index, slot)

    # -- end

    def results(self) -> list[dict]:
        return [r for slot in self.workers for r in slot.results]

    def stop(self) -> None:
        ray = self.ray
        if not ray.is_initialized():
            return
        for slot in self.workers:
            if slot.ended is None:
                ray.kill(slot.actor)
        refs = [s.actor.stop.remote() for s in self.shards]
        try:
            ray.get(refs, timeout=30)
        except Exception as exc:  # noqa: BLE001 - stopping whatever state the shards are in
            log.warning("stopping the shards: %s", _first_line(exc))
        for s in self.shards:
            ray.kill(s.actor, no_restart=True)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        if self.control is not None:
            ray.kill(self.control)
        if self.metrics is not None:
            self.metrics.clear()
        ray.shutdown()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def run_on_ray(args: argparse.Namespace, worker_args: list[str], run_dir: Path,
               interrupted: threading.Event) -> tuple[int, dict | None]:
    """``pscluster --ray``: (exit status, summary once the job finished)."""
    try:
        _import_ray()
    except ImportError:
        log.error("--ray needs Ray: pip install 'psgrpc[ray]' (or ray) into this environment")
        return 1, None
    job = _RayJob(args, worker_args, run_dir)
    started = time.monotonic()
    try:
        job.start()
        if not job.watch(interrupted):
            log.warning("interrupted; stopping the job's actors")
            return 130, None
        results = job.results()
        if not results:
            log.error("no worker finished with a result")
            return 1, None
        return 0, final_summary(args, worker_args, job.ps, job.credentials.evaluation, results,
                                time.monotonic() - started, job.recoveries)
    except KeyboardInterrupt:
        log.warning("interrupted; stopping the job's actors")
        return 130, None
    except (RuntimeError, TimeoutError, ConnectionError) as exc:
        log.error("%s", exc)
        return 1, None
    finally:
        job.stop()


def set_workers(n: int, job_name: str = "psgrpc", address: str | None = None) -> dict:
    """Scale the running job ``job_name`` on the Ray cluster at ``address`` to ``n`` workers;
    returns what the job last published of itself (its shards and workers)."""
    ray = _import_ray()

    connected = ray.is_initialized()
    if not connected:
        ray.init(address=address or "auto", namespace=NAMESPACE, logging_level=logging.WARNING)
    try:
        try:
            control = ray.get_actor(job_name, namespace=NAMESPACE)
        except ValueError:
            raise RuntimeError(f"no job named {job_name!r} runs on this Ray cluster") from None
        return ray.get(control.set_workers.remote(n), timeout=30)
    finally:
        if not connected:
            ray.shutdown()


def set_workers_cli(args: argparse.Namespace) -> int:
    """``pscluster --ray ADDRESS --job-name NAME --set-workers N``."""
    try:
        state = set_workers(args.set_workers, args.job_name, args.ray or None)
    except (RuntimeError, ConnectionError, ImportError) as exc:
        log.error("%s", exc)
        return 1
    log.info("job %r: %d worker(s) wanted (was: %s)", args.job_name, args.set_workers, state.get("wanted"))
    print(json.dumps({"job": args.job_name, "workers": args.set_workers, "before": state}), flush=True)
    return 0


def run(task: str = "mnist1d-cnn", *, address: str | None = None, shards: int = 2, workers: int = 2,
        worker_args: Sequence[str] = (), shard_args: Sequence[str] = (), run_dir: str | None = None,
        job_name: str = "psgrpc", **flags) -> dict:
    """The Python form of ``pscluster --ray``: runs the job and returns its summary. ``flags`` are
    pscluster's other flags by their Python names (``max_restarts=2``, ``auth=True``,
    ``worker_resources={"gpu_node": 1}``, ``save="model.safetensors"`` ...). Raises
    ``RuntimeError`` when the job fails."""
    from psworker import cluster

    argv = ["--ray", address or "", "--task", task, "--shards", str(shards), "--workers", str(workers),
            "--job-name", job_name, *(["--run-dir", run_dir] if run_dir is not None else []),
            *[f"--shard-arg={a}" for a in shard_args]]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value not in (False, None):
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    args, rest = cluster._parse([*argv, *worker_args])
    interrupted = threading.Event()
    with tempfile.TemporaryDirectory(prefix="psray-") as tmp:
        directory = Path(run_dir).resolve() if run_dir is not None else Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        code, summary = run_on_ray(args, rest, directory, interrupted)
    if code or summary is None:
        raise RuntimeError(f"the job failed (exit status {code}); its log says why")
    return summary
