"""Draw the Grafana dashboard's key panels from a real run's Prometheus data into a PNG.

    .venv/bin/python scripts/plot_dashboard.py            # writes docs/dashboard.png

Starts a real Prometheus (``prometheus`` on PATH: Debian's package) on a free loopback port,
scraping every second through file-based discovery, its storage in a temporary directory; then
``pscluster --shards 2 --workers 2 --task mnist1d-mlp --mode ssp --staleness 1 --metrics-sd-file F
--eval-every 200``, and waits for the run to finish. It then asks Prometheus' range API
(``/api/v1/query_range``, one point a second) for the queries of twelve panels of
``docker/grafana/dashboards/psgrpc.json``, taken from the dashboard itself with ``$job`` and
``$instance`` as ``.*`` and ``$__rate_interval`` as 10s (what the live tests in
``tests/observability`` use), and draws them with matplotlib under the dashboard's titles, in its
rows. Series that stay at 0 throughout are named in a note instead of drawn. Every process it
starts is stopped before it returns. Exits 1 when a panel had no data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "psgrpc.json"
GRAFANA_VARIABLES = {"$__rate_interval": "10s", "${job}": ".*", "$job": ".*", "${instance}": ".*", "$instance": ".*"}

# The panels drawn, by their dashboard titles, in rows as the dashboard groups them.
LAYOUT = [
    ("Training progress", ["Samples per second", "Loss", "Test accuracy"]),
    ("Where a step's time goes", ["Step time by phase, per worker", "Waits on the bound", "Applied staleness"]),
    ("Shards", ["Pushes by outcome", "Bytes pushed and pulled", "Shard memory"]),
    ("Shards, workers", ["RPC latency (p99) by method", "Shard CPU", "Worker CPU"]),
]
LOG_SCALE = {"Shard memory"}  # resident memory (MB) beside variables and optimizer state (KB)
FREE_MIN = {"Test accuracy"}  # the other panels' y axes start at 0


def substitute(expr: str) -> str:
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    return expr


def dashboard_panels() -> dict[str, dict]:
    def walk(panels):
        for panel in panels:
            yield panel
            yield from walk(panel.get("panels", []))

    return {p["title"]: p for p in walk(json.loads(DASHBOARD.read_text())["panels"]) if p.get("targets")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, pace: subprocess.Popen):
    """Poll ``predicate`` until it returns something truthy; each pause waits on ``pace``, so a
    process that dies ends the wait at once."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        try:
            pace.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            continue
        raise RuntimeError(f"{pace.args[0]} exited with {pace.returncode} while waiting for {what}")


class Prometheus:
    def __init__(self, directory: Path, sd_file: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (apt-get install prometheus)")
        config = {  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "pscluster",
                                "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "1s"}]}],
        }
        (directory / "prometheus.yml").write_text(json.dumps(config, indent=2))
        self.log_path = directory / "prometheus.log"
        self.popen = None
        for _attempt in range(3):  # the port may be taken between the probe and Prometheus' bind
            self.port = free_port()
            with open(self.log_path, "w") as log:
                self.popen = subprocess.Popen(
                    [binary, f"--config.file={directory / 'prometheus.yml'}",
                     f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                     "--storage.tsdb.retention.time=1h"],
                    stdout=log, stderr=subprocess.STDOUT, cwd=directory)
            try:
                wait_until(self._ready, 60, "Prometheus to be ready", self.popen)
                return
            except RuntimeError:
                self.stop()
                if "address already in use" not in self.log_path.read_text(errors="replace"):
                    raise
        raise RuntimeError("Prometheus found no free port")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def api(self, path: str, **params) -> dict | list:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def now(self) -> float:
        return float(self.api("query", query="time()")["result"][0])

    def up(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for target in self.api("targets", state="active")["activeTargets"]:
            if target["health"] == "up":
                counts[target["labels"]["job"]] = counts.get(target["labels"]["job"], 0) + 1
        return counts

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=15)


class Cluster:
    """``pscluster`` in the background, its output in a log file."""

    def __init__(self, directory: Path, args: list[str]) -> None:
        self.log_path = directory / "pscluster.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(self.log_path, "w") as log:
            self.popen = subprocess.Popen([sys.executable, "-m", "psworker.cluster", *args], stdout=log,
                                          stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def summary(self) -> dict | None:
        lines = [line for line in self.log().splitlines() if line.startswith('{"task"')]
        return json.loads(lines[-1]) if lines else None

    def stop(self) -> None:
        """Interrupt pscluster, which stops its children; should it hang, kill it and them (they
        run in sessions of their own)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=60)
                return
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=15)
        if self.popen.returncode in (0, 1, 130):
            return  # pscluster ran its own clean-up
        for pid in {int(pid) for pid in re.findall(r"started \w+, pid (\d+)", self.log())}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- drawing -------------------------------------------------------------------------------


def legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip() or "value"


def scaled(unit: str, top: float) -> tuple[float, str]:
    """A divisor and the axis label for the panel's Grafana unit, from the largest value."""
    if unit == "s":
        return (1e-3, "ms") if top < 1 else (1, "s")
    if unit in ("bytes", "Bps"):
        suffix = "/s" if unit == "Bps" else ""
        for div, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if top >= div:
                return div, name + suffix
        return 1, "B" + suffix
    if unit == "percentunit":
        return 0.01, "%"
    return (1e3, "thousands") if top >= 1e4 else (1, "")


def fetch(prom: Prometheus, panel: dict, start: float, end: float) -> list[tuple[str, list[float], list[float]]]:
    series = []
    for target in panel["targets"]:
        data = prom.api("query_range", query=substitute(target["expr"]), start=f"{start:.3f}", end=f"{end:.3f}",
                        step="1")
        for s in data["result"]:
            xs, ys = [], []
            for t, v in s["values"]:
                value = float(v)
                if math.isfinite(value):
                    xs.append(float(t))
                    ys.append(value)
            if xs:
                series.append((legend(target.get("legendFormat", ""), s["metric"]), xs, ys))
    return sorted(series, key=lambda s: s[0])


def draw(results: dict[str, list], panels: dict[str, dict], t0: float, t1: float, out: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows, cols = len(LAYOUT), max(len(titles) for _, titles in LAYOUT)
    fig, axes = plt.subplots(rows, cols, figsize=(16, 10), dpi=100, sharex=True)
    fig.patch.set_facecolor("white")
    for r, (row_title, titles) in enumerate(LAYOUT):
        axes[r][0].annotate(row_title, xy=(0, 0.5), xytext=(-52, 0), xycoords="axes fraction",
                            textcoords="offset points", rotation=90, va="center", ha="center",
                            fontsize=9, color="#555555", fontweight="bold")
        for c, title in enumerate(titles):
            ax = axes[r][c]
            unit = panels[title].get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
            ax.set_title(title, fontsize=10, loc="left", fontweight="bold")
            ax.grid(True, color="#e4e4e4", linewidth=0.6)
            ax.tick_params(labelsize=7.5)
            for side in ("top", "right"):
                ax.spines[side].set_visible(False)
            series = results[title]
            drawn = [s for s in series if any(y != 0 for y in s[2])]
            zero = [s[0] for s in series if s not in drawn]
            if not series:
                ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="red")
                continue
            top = max((max(abs(y) for y in s[2]) for s in drawn), default=1.0)
            div, label = scaled(unit, top)
            log_scale = title in LOG_SCALE
            for name, xs, ys in drawn:
                points = [(x - t0, y) for x, y in zip(xs, ys) if y > 0 or not log_scale]
                ax.plot([x for x, _ in points], [y for _, y in points], linewidth=1.1, label=name)
            if log_scale:
                ax.set_yscale("log")
                ax.set_ylim(top=top * 4)
                label = (label + ", log scale").lstrip(", ")
            elif drawn and title not in FREE_MIN and min(y for s in drawn for y in s[2]) >= 0:
                ax.set_ylim(bottom=0, top=top * 1.08)
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos, d=div: f"{v / d:g}"))
            if label:
                ax.set_ylabel(label, fontsize=8)
            if drawn:
                ax.legend(fontsize=6.5, loc="best", ncol=2 if len(drawn) > 4 else 1, framealpha=0.8,
                          handlelength=1.5, borderpad=0.3, labelspacing=0.25)
            if zero:
                note = "0 throughout: " + ", ".join(zero)
                ax.text(0.01, 0.02, note if len(note) < 80 else note[:77] + "...", transform=ax.transAxes,
                        fontsize=6.5, color="#777777", va="bottom")
            ax.set_xlim(0, t1 - t0)
        for c in range(len(titles), cols):
            axes[r][c].set_visible(False)
    for c in range(cols):
        axes[-1][c].set_xlabel("seconds into the run", fontsize=8)
    fig.suptitle("psgrpc cluster dashboard: drawn from a real 2x2 run's Prometheus data "
                 "(Grafana renders the same queries)", fontsize=13, fontweight="bold", x=0.01, ha="left", y=0.995)
    fig.text(0.01, 0.962, subtitle, fontsize=9, color="#444444", ha="left", va="top")
    fig.tight_layout(rect=(0.02, 0, 1, 0.955), h_pad=1.2, w_pad=1.5)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, pil_kwargs={"optimize": True})
    plt.close(fig)


# --- the run -------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--steps", type=int, default=8000, help="steps per worker (default: 8000, ~50 s on 2 cores)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the run may take (default: 600)")
    args = parser.parse_args()

    panels = dashboard_panels()
    missing = [t for _, titles in LAYOUT for t in titles if t not in panels]
    if missing:
        print(f"not in {DASHBOARD}: {missing}", file=sys.stderr)
        return 2

    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="plot-dashboard-") as tmp:
        directory = Path(tmp)
        (directory / "prom").mkdir()
        sd_file = directory / "targets.json"
        sd_file.write_text("[]\n")
        prom = cluster = None
        try:
            prom = Prometheus(directory / "prom", sd_file)
            start = prom.now()
            cluster = Cluster(directory, [
                "--shards", "2", "--workers", "2", "--task", "mnist1d-mlp", "--metrics-sd-file", str(sd_file),
                "--mode", "ssp", "--staleness", "1", "--eval-every", "200", "--steps", str(args.steps),
                "--progress", "none",
            ])
            print(f"prometheus on 127.0.0.1:{prom.port}; pscluster pid {cluster.popen.pid}, log {cluster.log_path}",
                  flush=True)
            wait_until(lambda: prom.up() == {"psserver": 2, "psworker": 2}, 180,
                       "Prometheus to scrape 2 shards and 2 workers", cluster.popen)
            print(f"all 4 targets up after {time.monotonic() - began:.0f}s; training", flush=True)
            try:
                returncode = cluster.popen.wait(timeout=max(1.0, args.timeout - (time.monotonic() - began)))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"pscluster did not finish within {args.timeout:.0f}s") from None
            if returncode != 0:
                raise RuntimeError(f"pscluster exited with {returncode}:\n{cluster.log()[-3000:]}")
            end = prom.now()
            summary = cluster.summary() or {}
            results = {t: fetch(prom, panels[t], start, end) for _, titles in LAYOUT for t in titles}
        except BaseException:
            if cluster is not None:
                print(cluster.log()[-3000:], file=sys.stderr)
            raise
        finally:
            if cluster is not None:
                cluster.stop()
            if prom is not None:
                prom.stop()

    points = [x for series in results.values() for _, xs, _ in series for x in xs]
    t0, t1 = min(points), max(points)
    subtitle = (f"pscluster --shards 2 --workers 2 --task mnist1d-mlp --mode ssp --staleness 1 --eval-every 200 "
                f"--steps {args.steps}, scraped every 1 s; queries from docker/grafana/dashboards/psgrpc.json "
                f"($job, $instance = .*, $__rate_interval = 10s)")
    if summary:
        accuracies = ", ".join(f"{w.get('worker')} {w.get('test_accuracy', float('nan')):.3f}"
                               for w in summary.get("per_worker", []))
        subtitle += (f"\n{summary.get('steps')} steps in {summary.get('seconds', 0):.0f} s, "
                     f"{summary.get('samples_per_second', 0):,.0f} samples/s; workers' final test accuracy: "
                     f"{accuracies}")
        print(f"pscluster: {summary.get('steps')} steps in {summary.get('seconds')} s, "
              f"{summary.get('samples_per_second')} samples/s; workers' final test accuracy {accuracies}; "
              f"its evaluation of the shards' weights: {summary.get('test_accuracy')}")
    draw(results, panels, t0, t1, args.out, subtitle)
    empty = [t for t, series in results.items() if not series]
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KB) in {time.monotonic() - began:.0f}s")
    for title, series in results.items():
        print(f"  {title}: " + ", ".join(f"{name} ({len(xs)} pts)" for name, xs, _ in series))
    if empty:
        print(f"panels without data: {empty}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
