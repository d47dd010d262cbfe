"""Throughput against the number of workers, with the workers' compute emulated: how many
workers a shard feeds before it saturates.

Each worker is a light process (``python -m psbench.scale``, below) that does what a training
worker does on the wire and nothing else: it registers a psbench MLP (``40 -> W -> W -> 10``,
``psbench.tasks.build_mlp``; SGD), computes one real gradient (one backward pass of a seeded
batch), and then steps: ``PSClient.push_pull`` of that gradient into preallocated tensors, then
``time.sleep(compute_ms)``, the forward and backward pass an accelerator would run while the
host's cores sit idle. So the cores of this machine go to the shards and the clients, as they
would on a host of GPU workers; a real worker's compute would not compete for them.

For each model and shard count, fresh shards and ``max(workers)`` worker processes start once
and stay; psbench then tells them through a control file (JSON, replaced atomically, polled
every 20 ms) how many of them step and when: each count of workers steps together for
``warmup_seconds``, then ``seconds`` timed, the others idle (registered, sending nothing). A
worker's rate is its steps completed in the timed window less one over the time from the first
to the last of them; the count's throughput is the sum of its workers' rates. Over the same
window psbench reads each shard's CPU time (``/proc/PID/stat``) and its ``pushes_applied``
(``StatusResponse``): the shard's CPU per update. The counts run ``reps`` times (ascending, then
descending); a count's scaling efficiency is the median over the repetitions of its throughput
over ``N x`` the throughput of one worker in the same repetition, against the same shards.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from psbench.config import ScaleBench
from psbench.procs import Child, Children
from psbench.stats import median, percentile
from pswire.files import write_atomically

__all__ = ["CONTROL_POLL_SECONDS", "PassFigures", "WorkerWindow", "cost_fits", "linear_fit", "machine_busy_seconds",
           "main", "measure_scale", "point_figures", "predict", "predicted_exchange", "window_figures",
           "write_control"]

log = logging.getLogger(__name__)

MIB = 1 << 20
CONTROL_POLL_SECONDS = 0.02
_LR = 1e-3
"""SGD without momentum: no state, one in-place op per update (what the update costs does not
depend on the rate; a small one keeps a fixed gradient applied thousands of times harmless)."""


# -- the worker (a child process) ------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerWindow:
    """One worker's steps in a timed window."""

    steps: int
    """Steps completed inside the window."""
    steps_per_second: float
    """(steps - 1) / (last completion - first completion)."""
    exchange_seconds: float
    """Median ``push_pull`` time of those steps."""
    exchange_p90_seconds: float
    client_cpu_seconds_per_step: float
    """This worker process's CPU (all threads) per step, first completion to last."""


def window_figures(completed: Sequence[float], exchanges: Sequence[float], cpu: Sequence[float]) -> WorkerWindow:
    """The figures of one worker's window from each step's completion time, ``push_pull``
    seconds and process CPU time at completion. Raises ``ValueError`` below two steps."""
    if len(completed) < 2 or len(exchanges) != len(completed) or len(cpu) != len(completed):
        raise ValueError(f"need two or more steps with one exchange and one CPU reading each, got "
                         f"{len(completed)}, {len(exchanges)} and {len(cpu)}")
    span = completed[-1] - completed[0]
    if not span > 0:
        raise ValueError(f"steps completed over {span} s")
    steps = len(completed)
    return WorkerWindow(steps, (steps - 1) / span, median(exchanges), percentile(exchanges, 90.0),
                        (cpu[-1] - cpu[0]) / (steps - 1))


def _say(record: dict) -> None:
    print(json.dumps(record), flush=True)


def _read_control(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_control(path: Path, control: dict) -> None:
    """Replace the control file atomically: a worker never reads half of it."""
    write_atomically(path, json.dumps(control))


def _step_window(client, grads: dict, dest: dict, compute: float, start: float, end: float) -> WorkerWindow:
    completed: list[float] = []
    exchanges: list[float] = []
    cpu: list[float] = []
    while time.time() < end:
        began = time.perf_counter()
        client.push_pull(grads, dest)
        took = time.perf_counter() - began
        time.sleep(compute)  # the forward and backward pass, on an accelerator
        now = time.time()
        if start <= now <= end:
            completed.append(now)
            exchanges.append(took)
            cpu.append(time.process_time())
    return window_figures(completed, exchanges, cpu)


def _worker(args: argparse.Namespace) -> int:
    import torch
    from torch import nn

    from psbench.tasks import build_mlp
    from pswire.optim import OptimizerConfig
    from pswire.placement import model_spec
    from psworker.client import ClientOptions, PSClient

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every worker the same initial values: any of them may initialise the job
    model = build_mlp(args.width)
    x, y = torch.randn(args.batch, 40), torch.randint(0, 10, (args.batch,))
    nn.functional.cross_entropy(model(x), y).backward()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    dest = {name: torch.empty_like(t) for name, t in initial.items()}
    del model
    control_path = Path(args.control)
    options = ClientOptions(timeout=120.0, connect_timeout=120.0, min_bandwidth=5e6)
    with PSClient.connected(args.ps.split(","), options) as client:
        client.register(model_spec(initial.items()), OptimizerConfig(name="sgd", lr=_LR), worker_name=args.name,
                        initial_values=initial)
        client.pull(dest)
        _say({"ready": args.index})
        seen = None
        while True:
            control = _read_control(control_path)
            if control is None or control["phase"] == seen:
                time.sleep(CONTROL_POLL_SECONDS)
                continue
            seen = control["phase"]
            if control.get("stop"):
                return 0
            if args.index < control["active"]:
                window = _step_window(client, grads, dest, args.compute_ms / 1e3, control["start"], control["end"])
                _say({"phase": seen, "worker": args.index, **vars(window)})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m psbench.scale",
                                     description="A psbench scale worker: push_pull of a fixed gradient, then a "
                                     "sleep standing for the step's compute, in the windows a control file names.")
    parser.add_argument("--ps", required=True, help="the shards' addresses, comma-separated")
    parser.add_argument("--width", type=int, required=True, help="hidden width of the 40-W-W-10 MLP")
    parser.add_argument("--index", type=int, required=True, help="this worker's index: it steps when < active")
    parser.add_argument("--compute-ms", type=float, required=True, help="the sleep after each push_pull")
    parser.add_argument("--batch", type=int, default=64, help="examples of the batch the gradient is computed on")
    parser.add_argument("--control", required=True, help="the control file psbench writes")
    parser.add_argument("--name", required=True, help="worker name to register under")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _worker(args)


# -- psbench's side ------------------------------------------------------------------------------

def machine_busy_seconds() -> float | None:
    """CPU seconds all cores of this machine have been busy (``/proc/stat``: everything but idle
    and iowait), or None without ``/proc``."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class _Reading:
    at: float
    cpu: list[float]
    applied: list[int]
    busy: float | None


def _reading(shards: list[Child], admin) -> _Reading:
    cpu = [child.cpu_seconds() for child in shards]
    busy = machine_busy_seconds()
    at = time.monotonic()
    return _Reading(at, cpu, [s.pushes_applied for s in admin.status()], busy)


@dataclass(frozen=True)
class PassFigures:
    """One worker count's timed window in one repetition."""

    workers: list[WorkerWindow]
    shard_cpu_seconds: list[float]
    """Each shard's CPU over the window."""
    updates: list[int]
    """Pushes each shard applied over the window."""
    seconds: float
    busy_seconds: float | None
    """CPU seconds the machine's cores were busy over the window (every process)."""

    @property
    def steps_per_second(self) -> float:
        return sum(w.steps_per_second for w in self.workers)


def _sleep_until(wall: float) -> None:
    delay = wall - time.time()
    if delay > 0:
        time.sleep(delay)


def _lines(child: Child) -> list[dict]:
    assert child.stdout_path is not None
    try:
        text = child.stdout_path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                pass
    return out


def _await(children: Sequence[Child], wanted, timeout: float, what: str) -> list[dict]:
    """Each child's first line for which ``wanted(line)``; raises ``ChildError`` for a child
    that exits first or past ``timeout``."""
    deadline = time.monotonic() + timeout
    found: dict[int, dict] = {}
    while True:
        for k, child in enumerate(children):
            if k in found:
                continue
            line = next((line for line in _lines(child) if wanted(line)), None)
            if line is not None:
                found[k] = line
            elif child.popen.poll() is not None:
                raise child.failure(f"exited with status {child.popen.returncode} before {what}")
        if len(found) == len(children):
            return [found[k] for k in range(len(children))]
        if time.monotonic() > deadline:
            late = next(child for k, child in enumerate(children) if k not in found)
            raise late.failure(f"did not report {what} within {timeout:.0f}s")
        time.sleep(0.05)


def _window(line: dict) -> WorkerWindow:
    return WorkerWindow(**{k: line[k] for k in WorkerWindow.__dataclass_fields__})


class _Config:
    """Fresh shards serving one MLP, and ``bench.max_workers`` workers registered on them."""

    def __init__(self, children: Children, bench: ScaleBench, width: int, shards: int, timeout: float) -> None:
        from psbench.ps import start_shards

        self.children = children
        self.bench = bench
        self.width = width
        self.timeout = timeout
        self.control = children.workdir / f"scale-mlp{width}-{shards}shards.control"
        self.started = start_shards(children, shards)
        self.shards = [child for child, _ in self.started]
        self.addresses = [address for _, address in self.started]
        self.workers: list[Child] = []
        self.phase = 0

    def start_workers(self) -> None:
        bench = self.bench
        for i in range(bench.max_workers):
            self.workers.append(self.children.start_module(
                f"scale-worker{i}-mlp{self.width}-{len(self.shards)}shards", "psbench.scale",
                "--ps", ",".join(self.addresses), "--width", str(self.width), "--index", str(i),
                "--compute-ms", str(bench.compute_ms), "--batch", str(bench.batch), "--control", str(self.control),
                "--name", f"psbench-scale-worker{i}", separate_stdout=True))
        _await(self.workers, lambda line: "ready" in line, self.timeout, "registering")

    def timed_pass(self, admin, count: int) -> PassFigures:
        """``count`` workers step for the warm-up, then the timed window."""
        bench = self.bench
        self.phase += 1
        phase = self.phase
        start = time.time() + bench.warmup_seconds
        end = start + bench.seconds
        write_control(self.control, {"phase": phase, "active": count, "start": start, "end": end})
        _sleep_until(start)
        before = _reading(self.shards, admin)
        _sleep_until(end)
        after = _reading(self.shards, admin)
        lines = _await(self.workers[:count], lambda line: line.get("phase") == phase, self.timeout,
                       f"its steps of phase {phase}")
        busy = after.busy - before.busy if after.busy is not None and before.busy is not None else None
        return PassFigures([_window(line) for line in lines], [a - b for a, b in zip(after.cpu, before.cpu)],
                           [a - b for a, b in zip(after.applied, before.applied)], after.at - before.at, busy)

    def stop(self) -> None:
        if self.workers:
            try:
                write_control(self.control, {"phase": self.phase + 1, "stop": True})
                for child in self.workers:
                    child.wait(30.0)
            except Exception as exc:  # they are stopped below whatever happened
                log.warning("scale workers did not all stop by themselves: %s", exc)
        for child in self.workers + self.shards:
            self.children.stop(child)


def point_figures(count: int, passes: list[PassFigures], single: list[PassFigures], *, batch: int,
                  model_bytes: int, shard_bytes: list[int]) -> dict:
    """The figures of one worker count against one worker: each list holds a pass per
    repetition, ``passes[r]`` and ``single[r]`` from the same repetition."""
    rates = [p.steps_per_second for p in passes]
    efficiency = [p.steps_per_second / (count * s.steps_per_second) for p, s in zip(passes, single)]
    per_update = [sum(p.shard_cpu_seconds) / sum(p.updates) if sum(p.updates) else None for p in passes]
    per_update = [v for v in per_update if v is not None]
    shard_cores = [max(c / p.seconds for c in p.shard_cpu_seconds) for p in passes]
    # What the rest of the machine used meanwhile: busy cores less the shards' and the workers' CPU.
    external = [p.busy_seconds / p.seconds - sum(p.shard_cpu_seconds) / p.seconds
                - sum(w.client_cpu_seconds_per_step * w.steps_per_second for w in p.workers)
                for p in passes if p.busy_seconds is not None]
    moved = [2 * b for b in shard_bytes]  # pushed, then pulled: every byte both ways each step
    return {
        "workers": count,
        "samples_per_second": median(rates) * batch,
        "steps_per_second": median(rates),
        "efficiency": median(efficiency),
        "step_seconds": median([1 / w.steps_per_second for p in passes for w in p.workers]),
        "exchange_seconds": median([w.exchange_seconds for p in passes for w in p.workers]),
        "exchange_p90_seconds": median([w.exchange_p90_seconds for p in passes for w in p.workers]),
        "client_cpu_seconds_per_step": median([w.client_cpu_seconds_per_step for p in passes for w in p.workers]),
        "shard_cpu_seconds_per_update": median(per_update) if per_update else None,
        "shard_cpu_seconds_per_mib": (median(per_update) / (sum(moved) / len(moved) / MIB)) if per_update else None,
        "shard_cpu_cores": median(shard_cores),
        "updates_per_second": median([sum(p.updates) / len(p.updates) / p.seconds for p in passes]),
        "bytes_per_second": median(rates) * 2 * model_bytes,
        "machine_busy_cores": (median([p.busy_seconds / p.seconds for p in passes])
                               if all(p.busy_seconds is not None for p in passes) else None),
        "external_cores": max(0.0, median(external)) if external else None,
        "samples_per_second_reps": [r * batch for r in rates],
        "efficiency_reps": efficiency,
        "worker_steps_per_second_reps": [[w.steps_per_second for w in p.workers] for p in passes],
        "worker_steps_reps": [[w.steps for w in p.workers] for p in passes],
        "shard_cpu_seconds_per_update_reps": per_update,
        "shard_cpu_seconds_reps": [[round(c, 3) for c in p.shard_cpu_seconds] for p in passes],
        "shard_updates_reps": [p.updates for p in passes],
        "window_seconds_reps": [round(p.seconds, 4) for p in passes],
        "machine_busy_seconds_reps": [None if p.busy_seconds is None else round(p.busy_seconds, 3) for p in passes],
    }


def _measure_config(children: Children, bench: ScaleBench, width: int, shards: int, timeout: float) -> dict:
    from psbench.config import TrainingCase
    from psworker.admin import AdminClient
    from psworker.client import ClientOptions

    config = _Config(children, bench, width, shards, timeout)
    try:
        config.start_workers()
        with AdminClient.connected(config.addresses, ClientOptions(timeout=60.0, connect_timeout=60.0)) as admin:
            shard_bytes = [s.bytes_held for s in admin.status()]
            passes: dict[int, list[PassFigures]] = {n: [] for n in bench.workers}
            for rep, counts in enumerate(bench.passes()):
                for count in counts:
                    figures = config.timed_pass(admin, count)
                    passes[count].append(figures)
                    log.info("scale mlp%d, %d shard(s), rep %d: %d worker(s) %.1f steps/s, shard CPU %.2f ms/update",
                             width, shards, rep + 1, count, figures.steps_per_second,
                             1e3 * sum(figures.shard_cpu_seconds) / max(1, sum(figures.updates)))
    finally:
        config.stop()
    model_bytes = sum(shard_bytes)
    parameters = TrainingCase(width=width, local_steps=1, worker_steps=1).parameters
    if model_bytes != 4 * parameters:
        raise RuntimeError(f"the shards hold {model_bytes} bytes of a {4 * parameters}-byte model")
    return {
        "width": width, "parameters": parameters, "model_bytes": model_bytes, "shards": shards,
        "shard_bytes": shard_bytes,
        "points": [point_figures(n, passes[n], passes[1], batch=bench.batch, model_bytes=model_bytes,
                                 shard_bytes=shard_bytes) for n in sorted(bench.workers)],
    }


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b * x``: (a, b). Raises ``ValueError`` for fewer than two
    distinct ``x``."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"need two or more distinct x with a y each, got {list(xs)} and {list(ys)}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def cost_fits(runs: list[dict]) -> dict | None:
    """What a step costs, fit over every point (each count of workers, each configuration): a
    shard's CPU per update as ``a + b x MiB`` moved on that shard (pushed + pulled), and a
    worker's CPU per step as ``c x shards + d x MiB`` moved by the step (one call per shard).
    Every point rather than the one-worker ones alone: those few updates make a noisy intercept.
    None without two models or shard counts to tell the terms apart."""
    shard_x, shard_y, client_x, client_y = [], [], [], []
    for run in runs:
        moved = 2 * run["model_bytes"] / MIB
        for point in run["points"]:
            if point["shard_cpu_seconds_per_update"] is not None:
                shard_x.append(moved / run["shards"])
                shard_y.append(point["shard_cpu_seconds_per_update"])
            client_x.append((run["shards"], moved))
            client_y.append(point["client_cpu_seconds_per_step"])
    if len(set(shard_x)) < 2 or len({m for _, m in client_x}) < 2 or len({s for s, _ in client_x}) < 2:
        return None
    a, b = linear_fit(shard_x, shard_y)
    (c, d), *_ = np.linalg.lstsq(np.array(client_x, dtype=float), np.array(client_y), rcond=None)
    return {"shard_seconds_per_update": a, "shard_seconds_per_mib": b,
            "client_seconds_per_call": float(c), "client_seconds_per_mib": float(d)}


def predicted_exchange(workers: int, *, compute_seconds: float, uncontended_seconds: float, cpu_per_step: float,
                       cores: float, external_cores: float = 0.0) -> float:
    """The exchange time (``push_pull``) the sizing rule of docs/scaling.md predicts for
    ``workers`` workers that share ``cores`` with the shards and ``external_cores`` of other
    load: ``E = E0 / (1 - U)``, U the cores' utilisation at the throughput that exchange allows
    (``X = workers / (compute + E)``, ``U = (X x cpu_per_step + external) / cores``), solved for
    E. ``inf`` when the other load alone fills the cores."""
    if external_cores >= cores:
        return float("inf")

    def excess(exchange: float) -> float:
        busy = (workers / (compute_seconds + exchange) * cpu_per_step + external_cores) / cores
        return exchange - (uncontended_seconds / (1 - busy) if busy < 1 else float("inf"))

    low, high = uncontended_seconds, max(uncontended_seconds, 1e-3)
    while excess(high) <= 0:
        high *= 2
    for _ in range(100):  # excess grows with the exchange time: bisect its zero
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) <= 0 else (low, middle)
    return high


def predict(runs: list[dict], fits: dict | None, compute_seconds: float, cores: float) -> None:
    """Set each point's ``predicted_exchange_seconds`` (:func:`predicted_exchange` with the
    fitted costs and each point's other load) and ``predicted_efficiency`` (its predicted
    throughput over N x one worker's, also predicted). The uncontended exchange ``E0`` is the
    one worker's, less what its own load of the cores added."""
    if fits is None:
        return
    for run in runs:
        moved = 2 * run["model_bytes"] / MIB
        per_step = (run["shards"] * (fits["shard_seconds_per_update"] + fits["client_seconds_per_call"])
                    + moved * (fits["shard_seconds_per_mib"] + fits["client_seconds_per_mib"]))
        one = next(p for p in run["points"] if p["workers"] == 1)
        uncontended = (one["step_seconds"] - compute_seconds) * max(0.0, 1 - per_step / one["step_seconds"] / cores)

        def exchange(point: dict) -> float:
            return predicted_exchange(point["workers"], compute_seconds=compute_seconds,
                                      uncontended_seconds=uncontended, cpu_per_step=per_step, cores=cores,
                                      external_cores=point.get("external_cores") or 0.0)

        alone = compute_seconds + exchange(one)
        for point in run["points"]:
            point["predicted_exchange_seconds"] = exchange(point)
            point["predicted_efficiency"] = alone / (compute_seconds + point["predicted_exchange_seconds"])


def measure_scale(children: Children, bench: ScaleBench, *, timeout: float = 180.0) -> dict:
    """Every width of ``bench`` against every shard count (module docstring). Raises
    ``ChildError`` or ``pswire.errors.PSError``."""
    runs = [_measure_config(children, bench, width, shards, timeout)
            for width in bench.widths for shards in bench.shard_counts]
    fits = cost_fits(runs)
    cores = len(os.sched_getaffinity(0))
    predict(runs, fits, bench.compute_ms / 1e3, cores)
    return {
        "compute_ms": bench.compute_ms, "batch": bench.batch, "optimizer": "sgd",
        "warmup_seconds": bench.warmup_seconds,
        "seconds": bench.seconds, "reps": bench.reps, "workers": sorted(bench.workers), "runs": runs,
        "cores": cores, "cpu_fit": fits,
    }


if __name__ == "__main__":
    sys.exit(main())
