"""The results document as a plain-text table for the terminal (and for docs/benchmarks.md),
and as a JSON file written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from statistics import median

from pswire.files import write_atomically

__all__ = ["render", "write_json"]

MIB = 1 << 20


def _rate(bytes_per_second: float | None) -> str:
    return "-" if bytes_per_second is None else f"{bytes_per_second / MIB:,.0f} MiB/s"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us"


def _table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """Columns padded to their widest cell; ``align`` has an ``l`` or ``r`` per column (default:
    the first left, the rest right, as for a label followed by numbers)."""
    widths = [max(len(x) for x in column) for column in zip(header, *rows)]
    align = align or "l" + "r" * (len(header) - 1)

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _cpu(seconds_per_mib: float | None) -> str:
    return "-" if seconds_per_mib is None else f"{seconds_per_mib * 1e3:.2f}"


def _baselines(base: dict) -> list[str]:
    tcp, stream, echo = base["tcp"], base["grpc_stream"], base["grpc_echo"]
    chunk = stream["chunk_bytes"] // 1024
    up, down = stream["upload"], stream["download"]
    return ["Baselines (loopback, server in a child process; CPU: client + server ms per MiB moved)", *_table(
        ["figure", "value", "x TCP", "CPU ms/MiB"],
        [
            [f"raw TCP goodput, 1 stream, {tcp['bytes_per_transfer'] // MIB} MiB", _rate(tcp["bytes_per_second"]),
             "1.00", _cpu(tcp["cpu_seconds_per_mib"])],
            [f"bare gRPC stream up, {chunk} KiB messages", _rate(up["bytes_per_second"]),
             _ratio(up["bytes_per_second"] / tcp["bytes_per_second"]), _cpu(up["cpu_seconds_per_mib"])],
            [f"bare gRPC stream down, {chunk} KiB messages", _rate(down["bytes_per_second"]),
             _ratio(down["bytes_per_second"] / tcp["bytes_per_second"]), _cpu(down["cpu_seconds_per_mib"])],
            ["bare gRPC up + down round", _rate(stream["round_bytes_per_second"]),
             _ratio(stream["round_bytes_per_second"] / tcp["bytes_per_second"]), ""],
            [f"bare gRPC unary echo {echo['payload_bytes'] // 1024} KiB, p50 / p99",
             f"{_ms(echo['p50_seconds'])} / {_ms(echo['p99_seconds'])}", "", ""],
        ],
    ), f"echo CPU per call: client {_us(echo['client_cpu_seconds_per_call'])}, "
       f"server {_us(echo['server_cpu_seconds_per_call'])}"]


def _goodput(rows: list[dict]) -> list[str]:
    return ["PS goodput: (bytes pushed + bytes pulled) / time of a push + pull round; TCP: the same bytes "
            "sent just before each round; CPU: client + shards ms per MiB moved", *_table(
        ["model", "shards", "bytes via", "goodput", "push", "pull", "TCP (paired)", "x TCP", "x bare gRPC",
         "CPU ms/MiB"],
        [[f"{r['size_mib']} MiB", str(r["shards"]), r.get("transport", "lanes"), _rate(r["bytes_per_second"]), _rate(r["push_bytes_per_second"]),
          _rate(r["pull_bytes_per_second"]), _rate(r.get("paired_tcp_bytes_per_second")), _ratio(r["ratio_to_tcp"]),
          _ratio(r["ratio_to_bare_grpc"]), _cpu(r["cpu_seconds_per_mib"])]
         for r in rows],
    )]


def _latency(latency: dict) -> list[str]:
    rows = []
    for name in ("pull", "push"):
        r = latency[name]
        echo = (f"{_ms(r['paired_echo_p50_seconds'])} / {_ms(r['paired_echo_p99_seconds'])}"
                if "paired_echo_p50_seconds" in r else "-")
        rows.append([name, _ms(r["p50_seconds"]), _ms(r["p99_seconds"]), echo, _ratio(r.get("p50_ratio_to_echo")),
                     _ratio(r.get("p99_ratio_to_echo")),
                     f"{_us(r['client_cpu_seconds_per_call'])} / {_us(r['shard_cpu_seconds_per_call'])}"])
    return [f"Small operations: one {latency['variable_bytes'] // 1024} KiB variable, 1 shard; echo: a 4 KiB "
            "bare gRPC echo just before each call", *_table(
        ["call", "p50", "p99", "echo p50 / p99", "x echo p50", "x echo p99", "CPU per call: client / shard"], rows)]


def _training(rows: list[dict]) -> list[str]:
    first = rows[0]
    return [f"Training: MNIST-1D MLP 40-W-W-10, batch {first['batch_size']}, SGD; "
            f"{first['shards']} shards x {first['workers']} async workers vs local, samples/s "
            "(medians; x local: median of each cluster run over the local run just before it)", *_table(
        ["model", "parameters", "local", "cluster", "x local"],
        [[f"W={r['width']}" + (f" {r['wire_dtype']} wire" if r.get("wire_dtype", "none") != "none" else ""),
          f"{r['parameters']:,}", f"{r['local_samples_per_second']:,.0f}",
          f"{r['cluster_samples_per_second']:,.0f}", _ratio(r["ratio_to_local"])] for r in rows],
    )]


def _memory(memory: dict) -> list[str]:
    columns = [("SGD (the check)", memory)] + ([("Adam", memory["adam"])] if memory.get("adam") else [])

    def mib(key: str) -> list[str]:
        return [f"{figures[key] / MIB:,.0f} MiB" for _, figures in columns]

    return [f"Shard memory: {memory['size_mib']} MiB model on 1 shard", *_table(
        ["figure", *(name for name, _ in columns)],
        [
            ["held (variables + optimizer state)", *mib("held_bytes")],
            ["resident at start (idle)", *mib("idle_rss_bytes")],
            ["peak resident (VmHWM)", *mib("peak_rss_bytes")],
            ["peak / held", *(_ratio(figures["ratio_to_held"]) for _, figures in columns)],
            ["target: 1.5 x held + 200 MiB", *mib("target_bytes")],
        ],
    )]


def _tls(tls: dict) -> list[str]:
    rows = []
    goodput = tls.get("goodput")
    if goodput:
        plain, secure = goodput["plain"], goodput["tls"]
        what = f"{goodput['size_mib']} MiB model, {goodput['shards']} shard{'s' if goodput['shards'] > 1 else ''}"
        rows += [
            [f"push + pull goodput, {what}", _rate(plain["bytes_per_second"]), _rate(secure["bytes_per_second"]),
             _ratio(goodput["ratio"])],
            ["  push", _rate(plain["push_bytes_per_second"]), _rate(secure["push_bytes_per_second"]),
             _ratio(goodput["push_ratio"])],
            ["  pull", _rate(plain["pull_bytes_per_second"]), _rate(secure["pull_bytes_per_second"]),
             _ratio(goodput["pull_ratio"])],
            ["  CPU ms/MiB, client + shard", _cpu(plain["cpu_seconds_per_mib"]), _cpu(secure["cpu_seconds_per_mib"]),
             _ratio(goodput["cpu_ratio"])],
        ]
    training = tls.get("training")
    if training:
        rows += [
            [f"training W={training['width']} ({training['parameters']:,} parameters), {training['shards']} shards x "
             f"{training['workers']} workers, samples/s", f"{training['plain_samples_per_second']:,.0f}",
             f"{training['tls_samples_per_second']:,.0f}", _ratio(training["ratio"])],
            ["  shard CPU ms per worker step", f"{training['plain_shard_cpu_ms_per_step']:.1f}",
             f"{training['tls_shard_cpu_ms_per_step']:.1f}",
             _ratio(training["tls_shard_cpu_ms_per_step"] / training["plain_shard_cpu_ms_per_step"]
                    if training["plain_shard_cpu_ms_per_step"] else None)],
        ]
    return ["The cost of TLS: mutual TLS (gRPC and bulk lanes) against plaintext, alternated in one run; "
            "TLS / plain of goodput and training: median over repetitions of each pair", *_table(
        ["figure", "plaintext", "TLS", "TLS / plain"], rows)]


def _metrics(metrics: dict) -> list[str]:
    rows = []
    for r in metrics.get("training") or []:
        rows += [
            [f"training W={r['width']} ({r['parameters']:,} parameters), {r['shards']} shards x {r['workers']} "
             "workers, samples/s", f"{r['off_samples_per_second']:,.0f}", f"{r['on_samples_per_second']:,.0f}",
             _ratio(r["ratio"])],
            ["  shard CPU ms per worker step", f"{r['off_shard_cpu_ms_per_step']:.2f}",
             f"{r['on_shard_cpu_ms_per_step']:.2f}",
             _ratio(r["on_shard_cpu_ms_per_step"] / r["off_shard_cpu_ms_per_step"]
                    if r["off_shard_cpu_ms_per_step"] else None)],
        ]
    lines = ["The cost of metrics: shards and workers with --metrics-port 0, every endpoint scraped each second, "
             "against none, alternated in one run; on / off: median over repetitions of each pair", *_table(
        ["figure", "off", "on", "on / off"], rows)]
    if metrics.get("training"):
        first = metrics["training"][0]
        scrapes = {kind: sum(r["scrapes"].get(kind, 0) for r in metrics["training"]) for kind in ("shard", "worker")}
        rss = first["shard_idle_rss_bytes"]
        size = first.get("median_scrape_bytes")
        lines.append(f"scrapes: {scrapes['shard']} of shards, {scrapes['worker']} of workers"
                     + (f", median {first['median_scrape_seconds'] * 1e3:.1f} ms and {size / 1024:.1f} KiB (gzip)"
                        if size else "")
                     + f"; shard resident at start: {rss['off'] / MIB:.1f} MiB off, {rss['on'] / MIB:.1f} MiB on")
    return lines


def _elastic(elastic: dict) -> list[str]:
    rows = []
    throughput = elastic.get("throughput")
    if throughput:
        rows += [
            [f"training W={throughput['width']} ({throughput['parameters']:,} parameters), "
             f"{throughput['shards']} shards x {throughput['workers']} workers, steps/s side by side",
             f"{throughput['static_steps_per_second']:,.0f}",
             f"{throughput['dynamic_steps_per_second']:,.0f}", _ratio(throughput["ratio"])],
            ["  samples/s as the workers report them (whole loops, medians)",
             f"{throughput['static_samples_per_second']:,.0f}", f"{throughput['dynamic_samples_per_second']:,.0f}",
             _ratio(throughput["dynamic_samples_per_second"] / throughput["static_samples_per_second"])],
        ]
        if "cpu_ratio" in throughput:
            rows.append(["  CPU per step, shards and workers (ms, medians over the same windows)",
                         f"{median(throughput['static_cpu_ms_per_step']):.3f}",
                         f"{median(throughput['dynamic_cpu_ms_per_step']):.3f}", _ratio(throughput["cpu_ratio"])])
    accuracy = elastic.get("accuracy")
    if accuracy:
        def side(figures: dict) -> str:
            std = f" +- {figures['std']:.3f}" if figures["std"] is not None else ""
            return f"{figures['mean']:.3f}{std} ({figures['min']:.3f}-{figures['max']:.3f})"

        emulated_compute = f", {accuracy['compute_ms']:g} ms emulated compute a step" if accuracy.get("compute_ms") else ""
        rows.append([f"{accuracy['task']} test accuracy, {accuracy['shards']} shard x {accuracy['workers']} workers, "
                     f"{accuracy['job_steps']}-step job{emulated_compute}, {accuracy['runs']} run(s): "
                     "mean +- std (min-max)",
                     side(accuracy["static"]), side(accuracy["dynamic"]),
                     f"{accuracy['difference_points']:+.2f} points"
                     + (f" (+- {accuracy['difference_stderr_points']:.2f})"
                        if accuracy.get("difference_stderr_points") is not None else "")])
        if accuracy.get("static_seconds"):
            rows.append([f"  job time, first step to last, {accuracy['workers']} workers (medians)",
                         f"{accuracy['static_seconds']:.1f} s", f"{accuracy['dynamic_seconds']:.1f} s",
                         _ratio(accuracy["dynamic_seconds"] / accuracy["static_seconds"])])
    scaling = elastic.get("scaling")
    lines = ["Dynamic data (elastic workers) against the static split in one run; dynamic / static: median over "
             "repetitions of each pair (steps/s: both clusters trained at once on the same cores, each one's steps "
             "applied over the seconds from when both passed 10% of their jobs to when the first reached 90%)",
             *_table(["figure", "static", "dynamic", "dynamic / static"], rows)]
    if scaling:
        lines.append(f"scaling: {_job_times(scaling)} ({_ratio(scaling['wall_ratio'])} with start-ups and evaluation)")
    emulated = elastic.get("emulated")
    if emulated:
        lines.append(f"scaling with emulated accelerators (each step stretched x{emulated['slowdown']:g} by a sleep): "
                     f"{_job_times(emulated)}")
    return lines


def _job_times(figures: dict) -> str:
    """The elastic job's time with more and with fewer dynamic workers, and their ratio."""
    return (f"the {figures['job_steps']}-step job with {figures['workers']} dynamic workers {figures['seconds']:.1f} s, "
            f"with {figures['fewer']} {figures['fewer_seconds']:.1f} s, first step to last: {figures['workers']} / "
            f"{figures['fewer']} = {_ratio(figures['ratio'])}")


def _sparse(sparse: dict) -> list[str]:
    lines: list[str] = []
    steps = sparse.get("steps")
    if steps:
        small, large = steps["tables"][0], steps["tables"][-1]

        def pair(show) -> list[str]:
            return [show(small), show(large)]

        cpu_ratio = (large["shard_cpu_seconds_per_step"] / small["shard_cpu_seconds_per_step"]
                     if small["shard_cpu_seconds_per_step"] else None)
        lines += [f"Sparse rows, step time against table size: the same {steps['steps']} batches of {steps['batch']} x "
                  f"{steps['features']} Zipf({steps['zipf']}) ids below {steps['id_range']:,} "
                  f"({steps['rows_per_step']:.0f} distinct rows a step), pull_rows + push_pull, dim {steps['dim']}, "
                  f"{steps['optimizer']}, {steps['shards']} shards per table; passes alternated, ratio: median over "
                  "the pairs of passes", *_table(
            ["figure", f"{small['rows']:,} rows", f"{large['rows']:,} rows", "ratio"],
            [
                ["step, median", *pair(lambda t: _ms(t["step_seconds"])), _ratio(steps["ratio"])],
                ["rows pulled + pushed", *pair(lambda t: _rate(t["row_bytes_per_second"])), ""],
                ["shard CPU per step", *pair(lambda t: _ms(t["shard_cpu_seconds_per_step"])), _ratio(cpu_ratio)],
                ["shards' peak RSS (sum)", *pair(lambda t: f"{sum(t['shard_peak_rss_bytes']) / MIB:,.0f} MiB"), ""],
            ],
        )]
    dlrm = sparse.get("dlrm")
    if dlrm:
        lines += [*([""] if lines else []),
                  f"Sparse rows, cluster against local: {dlrm['task']} with {dlrm['rows']:,} rows, batch "
                  f"{dlrm['batch_size']}, {dlrm['shards']} shards x {dlrm['workers']} async workers vs psworker --local "
                  "(medians; x local: median of each cluster run over the local run just before it)", *_table(
            ["figure", "local", "cluster", "x local"],
            [
                ["samples/s", f"{dlrm['local_samples_per_second']:,.0f}", f"{dlrm['cluster_samples_per_second']:,.0f}",
                 _ratio(dlrm["ratio_to_local"])],
                [f"test AUC (teacher {dlrm['teacher_auc']:.3f}, its dense part alone {dlrm['teacher_dense_auc']:.3f})",
                 f"{dlrm['local_test_auc']:.3f}", f"{dlrm['cluster_test_auc']:.3f}", ""],
            ],
        )]
    rows = sparse.get("rows")
    if rows:
        dense = ("no dense figure" if rows["dense_bytes_per_second"] is None else
                 f"the dense path's push + pull goodput {_rate(rows['dense_bytes_per_second'])} "
                 f"({rows['dense_size_mib']} MiB model, {rows['dense_shards']} shards, {rows['dense_source']}): "
                 f"x {_ratio(rows['ratio_to_dense'])}")
        lines.append(f"cluster rows per second of training: {rows['rows_pushed_per_second']:,.0f} pushed, "
                     f"{rows['rows_pulled_per_second']:,.0f} pulled, {_rate(rows['bytes_per_second'])} of rows; "
                     + dense)
    return lines


def _scale(scale: dict) -> list[str]:
    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.2f}"

    def cores(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = []
    for run in scale["runs"]:
        for p in run["points"]:
            busy = ("-" if p.get("machine_busy_cores") is None else
                    f"{p['machine_busy_cores']:.2f} / {cores(p.get('external_cores'))}")
            rows.append([f"W={run['width']} ({run['parameters'] / 1e6:.1f}M, {run['model_bytes'] / MIB:.1f} MiB)",
                         str(run["shards"]), str(p["workers"]), f"{p['samples_per_second']:,.0f}",
                         _ratio(p["efficiency"]), _ratio(p.get("predicted_efficiency")), ms(p["step_seconds"]),
                         ms(p["exchange_seconds"]), ms(p["client_cpu_seconds_per_step"]),
                         ms(p["shard_cpu_seconds_per_update"]), cores(p["shard_cpu_cores"]),
                         _rate(p["bytes_per_second"]), busy])
    lines = [f"Scaling: workers whose step is push_pull of a real gradient, then {scale['compute_ms']:g} ms of "
             f"emulated compute (a sleep), batch {scale['batch']}, SGD, async; {scale['seconds']:g} s timed per "
             f"count after {scale['warmup_seconds']:g} s of warm-up, {scale['reps']} pass(es) over the counts; "
             "efficiency: samples/s over N x one worker's in the same pass (median of the passes); predicted: by the "
             "sizing rule of docs/scaling.md; shard CPU per update: the shards' CPU over the pushes they applied; "
             "shard busy: cores the busiest shard used; machine: cores busy, all processes / those not of this section",
             *_table(["model", "shards", "workers", "samples/s", "efficiency", "predicted", "step ms", "push_pull ms",
                      "client CPU ms/step", "shard CPU ms/update", "shard busy", "moved", "machine"], rows)]
    fit = scale.get("cpu_fit")
    if fit:
        lines.append(f"CPU, fit over every point above: a shard {fit['shard_seconds_per_update'] * 1e3:.2f} ms "
                     f"per update + {fit['shard_seconds_per_mib'] * 1e3:.3f} ms per MiB pushed + pulled; a worker "
                     f"{fit['client_seconds_per_call'] * 1e3:.2f} ms per shard called + "
                     f"{fit['client_seconds_per_mib'] * 1e3:.3f} ms per MiB")
    return lines


def _checks(checks: list[dict]) -> list[str]:
    def verdict(c: dict) -> str:
        return {True: "PASS", False: "FAIL", None: "n/a"}[c["passed"]]

    def value(c: dict) -> str:
        if c["value"] is None:
            return "-"
        if c["id"] == "5":
            return f"{c['value'] / MIB:,.0f} MiB {c['comparison']} {c['threshold'] / MIB:,.0f} MiB"
        return f"{c['value']:.2f} {c['comparison']} {c['threshold']}"

    return ["Checks (reported, not enforced)", *_table(
        ["#", "check", "measured", "result", "detail"],
        [[c["id"], c["name"], value(c), verdict(c), c["detail"]] for c in checks],
        align="llrll",
    )]


def render(doc: dict) -> str:
    """The whole results document as text: a header, one table per section measured, the
    checks, and any section errors."""
    env = doc["environment"]
    lines = [
        f"psbench {doc['started_at']}  {env['cpu_model']}, {env['usable_cores']} cores, "
        f"python {env['python']}, torch {env['torch']}, grpcio {env['grpcio']}, protobuf {env['protobuf']}",
        f"load average at start {env.get('load_average_at_start')}, at end {env.get('load_average_at_end')}; "
        f"{doc['duration_seconds']:.0f}s" + ("  (--quick)" if doc["plan"]["quick"] else ""),
    ]
    source = env.get("source") or {}
    if source.get("commit"):
        modified = source.get("modified_files") or []
        lines.append(f"code: commit {source['commit'][:12]}"
                     + (f" with {len(modified)} modified product file(s): {', '.join(modified)}" if modified else ""))
    for key, render_section in (("baselines", _baselines), ("goodput", _goodput), ("latency", _latency),
                                ("training", _training), ("memory", _memory), ("tls", _tls),
                                ("metrics", _metrics), ("elastic", _elastic), ("sparse", _sparse),
                                ("scale", _scale)):
        if doc.get(key):
            lines += ["", *render_section(doc[key])]
    lines += ["", *_checks(doc["checks"])]
    for section, message in (doc.get("errors") or {}).items():
        lines += ["", f"ERROR in section {section}: {message}"]
    return "\n".join(lines)


def write_json(doc: dict, path: str | os.PathLike) -> Path:
    """Write ``doc`` to ``path`` through a temporary file and a rename, so a reader never sees
    half a file. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return path
