"""Measure the consistency settings side by side on one task and print a markdown table.

    .venv/bin/python scripts/consistency_table.py --task mnist1d-cnn --workers 4 --shards 2

Runs local single-process training, then pscluster once per setting (async, SSP S=1 and S=4,
sync), each with --eval-every so the time to the target accuracy can be read off worker 0.
Writes the raw results as JSON next to the table (--out).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

SETTINGS = [
    ("local (1 process)", None),
    ("async", ["--mode", "async"]),
    ("ssp S=1", ["--mode", "ssp", "--staleness", "1"]),
    ("ssp S=4", ["--mode", "ssp", "--staleness", "4"]),
    ("sync", ["--mode", "sync"]),
]


def _last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def _time_to(evals: list[dict], target: float) -> float | None:
    return next((e["seconds"] for e in evals if e.get("test_accuracy", 0) >= target), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="mnist1d-cnn")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.90)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per distributed worker (default: the task's job steps / workers)")
    parser.add_argument("--out", default="consistency-results.json")
    args = parser.parse_args()
    rows, raw = [], {}
    for label, flags in SETTINGS:
        common = ["--task", args.task, "--eval-every", str(args.eval_every), "--progress", "none"]
        if flags is None:
            cmd = [sys.executable, "-m", "psworker", "--local", "--threads", "1", *common]
        else:
            cmd = [sys.executable, "-m", "psworker.cluster", "--shards", str(args.shards),
                   "--workers", str(args.workers), *common, *flags]
            if args.steps:
                cmd += ["--steps", str(args.steps)]
        print(f"running {label}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        result = _last_json(proc.stdout)
        raw[label] = result
        first = result["per_worker"][0] if flags else result
        seconds = result["seconds"]
        rows.append((label, result["test_accuracy"], _time_to(first["evals"], args.target), seconds,
                     result["steps"], result["samples_per_second"]))
    with open(args.out, "w") as f:
        json.dump(raw, f, indent=1)
    print(f"| setting | test accuracy | time to {args.target:.2f} (s) | wall time (s) | steps (all workers) | samples/s |")
    print("|---|---|---|---|---|---|")
    for label, acc, t, wall, steps, sps in rows:
        print(f"| {label} | {acc:.3f} | {'not reached' if t is None else f'{t:.1f}'} | {wall:.1f} | {steps} | {sps:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
