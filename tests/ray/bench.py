"""Does Ray add overhead? The same 2 shards x 2 workers job, run alternately under pscluster
(processes on loopback) and under ``pscluster --ray`` (actors on a one-node Ray cluster in a
network namespace, shards on the node's address), on this machine.

    sudo .venv/bin/python -m tests.ray.bench [--reps 3] [--task mnist1d-cnn] [worker flags...]

Prints one JSON line: every run's job rate (examples over the job's wall time, start-up
included) and training rate (the sum of the workers' own samples/s), their medians, and the
ratios Ray / pscluster (docs/benchmarks.md). Needs root (network namespaces) and ray.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from tests.conftest import ROOT
from tests.ray import netcluster


def _job(cluster: netcluster.NetCluster, argv: list[str]) -> dict:
    proc = cluster.run(cluster.head, [sys.executable, "-m", "psworker.cluster", *argv], timeout=900, cwd=ROOT)
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    return {"job": summary["samples_per_second"],
            "training": round(sum(w["samples_per_second"] for w in summary["per_worker"]), 1),
            "seconds": summary["seconds"], "accuracy": summary.get("test_accuracy")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.ray.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--task", default="mnist1d-cnn")
    args, worker_args = parser.parse_known_args(argv)
    cluster = netcluster.start([(4, {})])
    runs: dict[str, list[dict]] = {"pscluster": [], "ray": []}
    try:
        common = ["--task", args.task, "--shards", "2", "--workers", "2", *worker_args]
        for rep in range(args.reps):
            runs["pscluster"].append(_job(cluster, [*common, "--elastic"]))
            runs["ray"].append(_job(cluster, [*common, "--ray", cluster.gcs]))
            print(f"rep {rep + 1}: pscluster {runs['pscluster'][-1]}, ray {runs['ray'][-1]}", file=sys.stderr,
                  flush=True)
    finally:
        cluster.close()
    medians = {how: {key: statistics.median(r[key] for r in rs) for key in ("job", "training")}
               for how, rs in runs.items()}
    print(json.dumps({
        "task": args.task, "reps": args.reps, "runs": runs, "medians": medians,
        "ratio_training": round(medians["ray"]["training"] / medians["pscluster"]["training"], 3),
        "ratio_job": round(medians["ray"]["job"] / medians["pscluster"]["job"], 3),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
