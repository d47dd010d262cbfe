"""``psctl``: operator view of a job's shards.

    psctl status --ps HOST:PORT[,HOST:PORT...] [--json]
    psctl checkpoint --ps HOST:PORT[,HOST:PORT...] [--id N]
    psctl export (--ps HOST:PORT[,HOST:PORT...] | --checkpoint DIR [--id N]) --out FILE
    psctl end-job --ps HOST:PORT[,HOST:PORT...] [--checkpoint [--id N]]
    psctl status --ps ... --watch [SECONDS]
    psctl health --ps HOST:PORT[,HOST:PORT...] [--timeout SECONDS] [--json]
    psctl tokens --out DIR [--keep]

They take ``--tls-ca F [--tls-cert F --tls-key F]`` for shards that serve TLS, and the token from
``--token-file F`` or the ``PSGRPC_TOKEN`` environment variable for shards that check tokens
(status and export need the reader role, checkpoint and end-job the admin role; health needs no
token, as the shards' health service is open). This module is psctl's configuration too: it alone
reads its flags and environment.

Every command but export runs without torch (``psworker.admin``), so psctl works in an image
that holds psserver alone: ``psctl health --ps 127.0.0.1:7000`` is its health check (exit 0 when
every shard says SERVING).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence

from pswire.data import DataPlan
from pswire.errors import PreconditionError, PSError
from pswire.flags import add_version
from pswire.optim import OptimizerConfig
from pswire.security import TOKEN_ENV, ClientSecurity, client_security, host_of, write_token_files
from psworker.admin import AdminClient
from psworker.options import ClientOptions

__all__ = ["default_checkpoint_id", "main"]


def default_checkpoint_id(now: float, last_ids: Iterable[int]) -> int:
    """The id of a checkpoint asked for without ``--id``: the wall clock in whole seconds, or
    one past the newest id any shard reports if that is later (shards require increasing ids,
    and ones at most about an hour ahead of their clock in seconds)."""
    return max(int(now), 1 + max(last_ids, default=0))


def _status(ps: str, timeout: float, security: ClientSecurity | None) -> list[dict]:
    options = ClientOptions(timeout=timeout, connect_timeout=timeout, security=security)
    with AdminClient.connected(ps, options) as client:
        return _shards(client)


def _shards(client: AdminClient) -> list[dict]:
    """Every shard's status as plain values. A shard reports the address it bound; one bound to
    every interface (a container's 0.0.0.0) is named by the address it was reached at instead, so
    that two shards can be told apart."""
    shards = [_plain(s) for s in client.status()]
    for shard, reached in zip(shards, client.addresses):
        if host_of(shard["address"]) in _ANY_INTERFACE:
            shard["address"] = reached
    return shards


_ANY_INTERFACE = ("0.0.0.0", "::", "")


def _plain(message) -> dict:
    """A message as plain JSON values (protobuf's JSON mapping writes int64 as strings)."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.type == field.TYPE_MESSAGE:
            if field.is_repeated:
                value = [_plain(v) for v in value]
            else:
                value = _plain(value) if message.HasField(field.name) else None
        elif field.type == field.TYPE_ENUM:
            names = field.enum_type.values_by_number
            value = [names[v].name for v in value] if field.is_repeated else names[value].name
        elif field.is_repeated:
            value = list(value)
        out[field.name] = value
    return out


def _rate(optimizer: dict, version: int) -> str:
    """``lr 0.01``, and with a schedule where it stands: the rate the shard's next update runs at."""
    text = f"lr {optimizer.get('lr', '-')}"
    if optimizer.get("warmup_steps") or optimizer.get("decay_steps"):
        try:
            config = OptimizerConfig.from_dict(optimizer)
        except (TypeError, ValueError):  # a shard of another version: its settings as given
            return text
        update = version + 1
        text += f" ({config.describe_schedule()}; update {update} at {config.lr * config.lr_factor(update):.3g})"
    return text


def _table(shards: list[dict]) -> str:
    cols = ("shard", "address", "state", "variables", "bytes", "opt_bytes", "version", "clock",
            "workers", "applied", "dropped", "scaled", "rejected", "max_stale")
    rows = [cols]
    for i, s in enumerate(shards):
        rows.append((
            f"{s['shard_index']}/{s['num_shards']}" if s["num_shards"] else f"?{i}",
            s["address"], s["state"], str(s["num_variables"]), str(s["bytes_held"]),
            str(s["optimizer_state_bytes"]), str(s["version"]), str(s["clock"]),
            str(sum(w["live"] for w in s["workers"])), str(s["pushes_applied"]), str(s["pushes_dropped"]),
            str(s["pushes_scaled"]), str(s["pushes_rejected"]), str(s["max_staleness"]),
        ))
    widths = [max(len(r[c]) for r in rows) for c in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    for s in shards:
        opt = s.get("optimizer") or {}
        c = s.get("consistency") or {}
        mode = c.get("mode") or "-"
        if mode == "ssp":
            mode += f" S={c['staleness']} ({c['stale_policy']} stale pushes)"
        elif mode == "sync":
            mode += f" backup={c['backup_workers']}"
        names = ", ".join(
            f"{w['worker_name']}(gen {w['generation']}, clock {w['clock']}, {w['pushes']} pushes"
            f"{'' if w['live'] else (', evicted' if w['evicted'] else ', left')})" for w in s["workers"]
        )
        hist = " ".join(
            f"{b['staleness']}{'+' if i == len(s['staleness_histogram']) - 1 else ''}:{b['count']}"
            for i, b in enumerate(s["staleness_histogram"]) if b["count"]
        )
        lines.append(
            f"{s['address']}: mode {mode}; optimizer {opt.get('name', '-')} {_rate(opt, s['version'])}; "
            f"staleness histogram {hist or '-'}; pulls waited {s['pull_wait_seconds']:.1f}s; "
            f"lease {s['lease_seconds']:g}s, {s['workers_evicted']} evicted; "
            f"push bytes in flight {s['push_bytes_in_flight']} (peak {s['push_bytes_in_flight_peak']}, "
            f"limit {s['max_inflight_bytes'] or 'none'}); "
            f"last checkpoint {s['last_checkpoint_id'] or 'none'}; "
            f"workers: {names or 'none'}"
        )
        if s.get("data") and s["data"]["active"]:
            lines.append(f"{s['address']}: {_data_line(s['data'])}")
        for t in s.get("tables") or []:
            spec = t["spec"]
            lines.append(
                f"{s['address']}: table {spec['name']!r} ({spec['num_rows']} x {spec['dim']}, "
                f"{spec['optimizer']['name']} lr {spec['optimizer']['lr']:g}): {t['rows_held']} rows here, "
                f"{t['rows_written']} written ({t['bytes_resident'] / 2**20:.1f} MiB with state), "
                f"{t['rows_pushed']} pushed, {t['rows_pulled']} pulled, step {t['step']}"
            )
    return "\n".join(lines)


def _data_line(q: dict) -> str:
    """The job's data queue (shard 0 of a job with dynamic data): progress, and who holds what."""
    plan = q.get("plan") or {}
    held: dict[tuple[str, int], list[str]] = {}
    for h in q["holders"]:
        t = h["task"]
        task = f"epoch {t['epoch']} [{t['start']}, {t['end']})"
        held.setdefault((h["worker_name"], h["generation"]), []).append(task)
    holders = "; ".join(f"{name} (gen {gen}): {', '.join(tasks)}" for (name, gen), tasks in held.items())
    described = DataPlan(**plan).describe() if plan else "-"
    return (
        f"dynamic data: epoch {q['epoch']}; tasks {q['tasks_done']} done, {q['tasks_leased']} leased, "
        f"{q['tasks_queued']} queued ({q['tasks_requeued']} requeued); "
        f"examples {q['examples_done']}/{q['examples_total']} done; finished {'yes' if q['finished'] else 'no'}; "
        f"plan {described}; held by {holders or 'nobody'}"
    )


def _add_tls(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", help="PEM bundle of the CA that signed the shards' certificates (TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate, for shards that require one (mutual TLS)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")


def _add_security(parser: argparse.ArgumentParser, role: str) -> None:
    _add_tls(parser)
    roles = "the admin role" if role == "admin" else f"the {role} role or above"
    parser.add_argument("--token-file", help=f"file holding a token of {roles}, for shards that check tokens; "
                        f"default: the {TOKEN_ENV} environment variable")


def _client(args: argparse.Namespace, security: ClientSecurity | None) -> AdminClient:
    options = ClientOptions(timeout=args.timeout, connect_timeout=min(args.timeout, 10.0), security=security)
    return AdminClient.connected(args.ps, options)


def _checkpoint(args: argparse.Namespace, security: ClientSecurity | None) -> int:
    with _client(args, security) as client:
        checkpoint_id = args.id
        if checkpoint_id is None:
            checkpoint_id = default_checkpoint_id(time.time(), (s.last_checkpoint_id for s in client.status()))
        replies = client.checkpoint(checkpoint_id)
    for r in replies:
        print(f"checkpoint {r.checkpoint_id}: {r.path} (version {r.version})")
    complete = any(r.complete for r in replies)
    print(f"checkpoint {checkpoint_id} {'complete' if complete else 'INCOMPLETE'} on {len(replies)} shard(s)")
    return 0 if complete else 1


def _end_job(args: argparse.Namespace, security: ClientSecurity | None) -> int:
    with _client(args, security) as client:
        statuses = client.status()
        jobs = {s.job_fingerprint for s in statuses if s.state != "empty"}
        if not jobs:
            print(f"no job to end: every shard of {args.ps} is empty")
            return 0
        if len(jobs) > 1:
            raise PreconditionError(f"the shards hold different jobs ({', '.join(map(repr, sorted(jobs)))}): "
                                    "end each shard's job with its own psctl end-job")
        (fingerprint,) = jobs
        checkpoint_id = 0
        if args.checkpoint:
            checkpoint_id = args.id or default_checkpoint_id(time.time(), (s.last_checkpoint_id for s in statuses))
        try:
            replies = client.end_job(checkpoint_id, fingerprint)
        except PSError as exc:
            # One shard refused (its final checkpoint failed, say); the others may have ended.
            after = client.status()
            left = [s.address for s in after if s.state != "empty"]
            raise PSError(f"{exc}; still holding the job: {', '.join(left) or 'none'} "
                          "(run psctl end-job again once the cause is fixed)") from exc
    for shard, reply in zip(statuses, replies):
        if not reply.ended:
            print(f"{shard.address}: held no job")
            continue
        line = (f"{shard.address}: ended job {reply.job_fingerprint!r} at version {reply.version}, "
                f"{reply.workers_live} worker(s) live")
        print(line + (f"; final checkpoint part {reply.checkpoint_path}" if reply.checkpoint_path else ""))
    if checkpoint_id:
        complete = any(r.checkpoint_complete for r in replies)
        print(f"final checkpoint {checkpoint_id} {'complete' if complete else 'INCOMPLETE'}")
        if not complete:
            return 1
    print(f"job {fingerprint!r} ended on {sum(r.ended for r in replies)} shard(s); they accept a new job")
    return 0


def _rates(before: list[dict] | None, after: list[dict], seconds: float) -> str:
    """Pushes applied and version steps per second across the shards since the last refresh."""
    if not before or seconds <= 0 or len(before) != len(after):
        return "rates: - (first sample)"
    pushes = sum(a["pushes_applied"] - b["pushes_applied"] for a, b in zip(after, before)) / seconds
    versions = sum(a["version"] - b["version"] for a, b in zip(after, before)) / seconds

    def rows(key: str) -> float:
        return sum(sum(t[key] for t in a.get("tables") or []) - sum(t[key] for t in b.get("tables") or [])
                   for a, b in zip(after, before)) / seconds

    tables = (f", table rows {rows('rows_pushed'):.0f} touched/s and {rows('rows_pulled'):.0f} pulled/s"
              if any(a.get("tables") for a in after) else "")
    return (f"rates: {pushes:.1f} pushes applied/s, {versions:.1f} versions/s{tables} (all shards, last "
            f"{seconds:.1f}s)")


def _watch(args: argparse.Namespace, security: ClientSecurity | None, out=sys.stdout) -> int:
    """``status --watch``: the status every ``args.watch`` seconds until Ctrl-C, redrawn in place
    on a terminal, one block (or one JSON line with ``--json``) per refresh otherwise."""
    clear = "\x1b[H\x1b[2J" if out.isatty() and not args.json else ""
    with AdminClient(args.ps, ClientOptions(timeout=args.timeout, connect_timeout=args.timeout,
                                            security=security)) as client:
        before: list[dict] | None = None
        last = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                stamp = time.strftime("%H:%M:%S")
                try:
                    shards = _shards(client)
                except PSError as exc:
                    shards, problem = None, str(exc)
                if args.json:
                    record = {"time": time.time(), "shards": shards} if shards is not None else \
                        {"time": time.time(), "error": problem}
                    out.write(json.dumps(record) + "\n")
                elif shards is not None:
                    out.write(f"{clear}psctl status {args.ps} at {stamp}, every {args.watch:g}s (Ctrl-C to stop)\n"
                              f"{_table(shards)}\n{_rates(before, shards, now - last)}\n\n")
                else:
                    out.write(f"{clear}psctl status {args.ps} at {stamp}: {problem}; trying again in "
                              f"{args.watch:g}s\n\n")
                out.flush()
                if shards is not None:
                    before, last = shards, now
                time.sleep(max(args.watch - (time.monotonic() - now), 0.0))
        except KeyboardInterrupt:
            return 0


def _export(args: argparse.Namespace, security: ClientSecurity | None) -> int:
    # The one command that needs torch (the model leaves as torch tensors): imported here, not at
    # the top, so that every other command runs where torch is not installed (the server image).
    try:
        from psworker.export import export
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "torch":
            raise
        print("psctl: export needs torch, which is not installed here: run it where the worker is installed "
              "(the worker image, or a full install: pip install torch)", file=sys.stderr)
        return 1

    options = ClientOptions(timeout=args.timeout, connect_timeout=args.timeout, security=security)
    print(export(args.out, ps=args.ps, checkpoint=args.checkpoint, checkpoint_id=args.id, options=options))
    return 0


def _health(args: argparse.Namespace, security: ClientSecurity | None) -> int:
    """One health check per shard, side by side, within ``--timeout``: exit 0 when every shard
    says SERVING. Never retried: a container runtime's HEALTHCHECK does the retrying."""
    options = ClientOptions(timeout=args.timeout, connect_timeout=args.timeout, security=security)
    with AdminClient(args.ps, options) as client:
        reports = client.health(args.timeout)
    if args.json:
        print(json.dumps([{"address": r.address, "status": r.status, "serving": r.serving, "reason": r.reason}
                          for r in reports], indent=2))
    else:
        for r in reports:
            print(f"{r.address}: {r.status}" + (f": {r.reason}" if r.reason else ""))
    return 0 if all(r.serving for r in reports) else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="psctl", description="Inspect and operate a job's parameter-server shards.",
        epilog="Each command's flags: psctl COMMAND --help.",
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    status = sub.add_parser("status", help="per shard: variables, bytes, version, workers, pushes; the data "
                            "queue of a job with dynamic data (--watch: live)")
    status.add_argument("--ps", required=True, help="HOST:PORT[,HOST:PORT...]")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (2 when not given) until Ctrl-C, with the push rate since "
                        "the last refresh; with --json one JSON line per refresh")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default: 10)")
    _add_security(status, "reader")
    ckpt = sub.add_parser("checkpoint", help="write a checkpoint on every shard now")
    ckpt.add_argument("--ps", required=True, help="HOST:PORT[,HOST:PORT...]")
    ckpt.add_argument("--id", type=int, default=None,
                      help="checkpoint id, larger than every earlier one (default: the current time in seconds, "
                      "or one past the newest id the shards report if that is later)")
    ckpt.add_argument("--timeout", type=float, default=300.0, help="seconds per call (default: 300)")
    _add_security(ckpt, "admin")
    export = sub.add_parser("export", help="write the job's model to a safetensors file, from the running shards "
                            "(--ps) or from a checkpoint directory with no shard running (--checkpoint); each "
                            "embedding table as TABLE.weight, written in chunks")
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--ps", help="HOST:PORT[,HOST:PORT...], every shard of the job in shard order")
    source.add_argument("--checkpoint", metavar="DIR", help="a checkpoint root (psserver --checkpoint-dir; the "
                        "newest complete checkpoint) or one checkpoint's ckpt-N directory")
    export.add_argument("--id", type=int, default=None,
                        help="with --checkpoint: read checkpoint N (default: the newest complete one)")
    export.add_argument("--out", required=True, help="the file to write (atomically)")
    export.add_argument("--timeout", type=float, default=60.0, help="seconds per call (default: 60)")
    _add_security(export, "reader")
    end = sub.add_parser("end-job", help="end the job on every shard (optionally after a final checkpoint); the "
                         "shards then accept a new job, and the ended job's workers are refused for good")
    end.add_argument("--ps", required=True, help="HOST:PORT[,HOST:PORT...], every shard of the job")
    end.add_argument("--checkpoint", action="store_true",
                     help="first write a final checkpoint of the job (shards need --checkpoint-dir); if it "
                     "fails the job goes on")
    end.add_argument("--id", type=int, default=None, help="with --checkpoint: its id (default as psctl checkpoint)")
    end.add_argument("--timeout", type=float, default=300.0, help="seconds per call (default: 300)")
    _add_security(end, "admin")
    health = sub.add_parser("health", help="ask each shard's standard gRPC health service whether it is serving "
                            "(exit 0 when every shard is; no token needed): a container health check")
    health.add_argument("--ps", required=True, help="HOST:PORT[,HOST:PORT...]")
    health.add_argument("--timeout", type=float, default=3.0,
                        help="seconds to wait for each shard's answer, shards checked side by side (default: 3)")
    health.add_argument("--json", action="store_true", help="print JSON instead of a line per shard")
    _add_tls(health)
    tokens = sub.add_parser("tokens", help="write fresh tokens for psserver --auth-token-file and the clients "
                            "(no shard needed)")
    tokens.add_argument("--out", required=True, metavar="DIR",
                        help="directory to write into (created): tokens (the shards' file, one ROLE TOKEN line "
                        "per role) and reader.token, worker.token, admin.token (each client's --token-file), "
                        "all mode 600")
    tokens.add_argument("--keep", action="store_true",
                        help="leave DIR as it is when it already holds every file (a container that runs this "
                        "at each start keeps its tokens)")
    return parser


def _tokens(args: argparse.Namespace) -> int:
    paths = write_token_files(args.out, keep=args.keep)
    print(f"tokens in {paths['tokens'].parent}: psserver --auth-token-file {paths['tokens']}; clients "
          f"--token-file {paths['reader']} (status, export), {paths['worker']} (workers), "
          f"{paths['admin']} (checkpoint, end-job)")
    return 0


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "tokens":  # local files only: no shard, timeout or credentials
        try:
            return _tokens(args)
        except OSError as exc:
            print(f"psctl: tokens: {exc}", file=sys.stderr)
            return 1
    if getattr(args, "id", None) is not None and args.id < 1:
        parser.error(f"--id must be >= 1, got {args.id}")
    if getattr(args, "watch", None) is not None and args.watch <= 0:
        parser.error(f"--watch must be a positive number of seconds, got {args.watch:g}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    # health carries no token (the health service is open): neither asks for one nor fails on a bad one.
    with_token = args.command != "health"
    try:
        security = client_security(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                                   token_file=args.token_file if with_token else None,
                                   env_token=env.get(TOKEN_ENV) if with_token else None)
    except ValueError as exc:
        parser.error(str(exc))
    command = {"checkpoint": _checkpoint, "end-job": _end_job, "export": _export, "health": _health}.get(args.command)
    if command is None:
        command = _watch if args.watch is not None else _show
    try:
        return command(args, security)
    except (PSError, ValueError, OSError) as exc:
        print(f"psctl: {exc}", file=sys.stderr)
        return 1


def _show(args: argparse.Namespace, security: ClientSecurity | None) -> int:
    shards = _status(args.ps, args.timeout, security)
    print(json.dumps(shards, indent=2) if args.json else _table(shards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
