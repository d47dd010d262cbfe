"""``psctl``: operator view of a job's shards.

    psctl status --ps HOST:PORT[,HOST:PORT...] [--json]
    psctl checkpoint --ps HOST:PORT[,HOST:PORT...] [--id N]

Both take ``--tls-ca F [--tls-cert F --tls-key F]`` for shards that serve TLS, and the token from
``--token-file F`` or the ``PSGRPC_TOKEN`` environment variable for shards that check tokens
(status needs the reader role, checkpoint the admin role). This module is psctl's configuration
too: it alone reads its flags and environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence

from pswire.data import DataPlan
from pswire.errors import PSError
from pswire.security import TOKEN_ENV, ClientSecurity, client_security
from psworker.client import ClientOptions, PSClient

__all__ = ["default_checkpoint_id", "main"]


def default_checkpoint_id(now: float, last_ids: Iterable[int]) -> int:
    """The id of a checkpoint asked for without ``--id``: the wall clock in whole seconds, or
    one past the newest id any shard reports if that is later (shards require increasing ids,
    and ones at most about an hour ahead of their clock in seconds)."""
    return max(int(now), 1 + max(last_ids, default=0))


def _status(ps: str, timeout: float, security: ClientSecurity | None) -> list[dict]:
    with PSClient(ps, ClientOptions(timeout=timeout, connect_timeout=timeout, security=security)) as client:
        client.wait_connected()
        return [_plain(s) for s in client.status()]


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
            f"{s['address']}: mode {mode}; optimizer {opt.get('name', '-')} lr {opt.get('lr', '-')}; "
            f"staleness histogram {hist or '-'}; pulls waited {s['pull_wait_seconds']:.1f}s; "
            f"lease {s['lease_seconds']:g}s, {s['workers_evicted']} evicted; "
            f"push bytes in flight {s['push_bytes_in_flight']} (peak {s['push_bytes_in_flight_peak']}, "
            f"limit {s['max_inflight_bytes'] or 'none'}); "
            f"last checkpoint {s['last_checkpoint_id'] or 'none'}; "
            f"workers: {names or 'none'}"
        )
        if s.get("data") and s["data"]["active"]:
            lines.append(f"{s['address']}: {_data_line(s['data'])}")
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


def _add_security(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--tls-ca", help="PEM bundle of the CA that signed the shards' certificates (TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate, for shards that require one (mutual TLS)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    roles = "the admin role" if role == "admin" else f"the {role} role or above"
    parser.add_argument("--token-file", help=f"file holding a token of {roles}, for shards that check tokens; "
                        f"default: the {TOKEN_ENV} environment variable")


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog="psctl", description="Inspect parameter-server shards.")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="per shard: variables, bytes, version, workers, pushes; the data "
                            "queue of a job with dynamic data")
    status.add_argument("--ps", required=True, help="HOST:PORT[,HOST:PORT...]")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default: 10)")
    _add_security(status, "reader")
    ckpt = sub.add_parser("checkpoint", help="write a checkpoint on every shard now")
    ckpt.add_argument("--ps", required=True, help="HOST:PORT[,HOST:PORT...]")
    ckpt.add_argument("--id", type=int, default=None,
                      help="checkpoint id, larger than every earlier one (default: the current time in seconds, "
                      "or one past the newest id the shards report if that is later)")
    ckpt.add_argument("--timeout", type=float, default=300.0, help="seconds per call (default: 300)")
    _add_security(ckpt, "admin")
    args = parser.parse_args(argv)
    try:
        security = client_security(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                                   token_file=args.token_file, env_token=env.get(TOKEN_ENV))
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "checkpoint":
        if args.id is not None and args.id < 1:
            parser.error(f"--id must be >= 1, got {args.id}")
        checkpoint_id = args.id
        try:
            options = ClientOptions(timeout=args.timeout, connect_timeout=10, security=security)
            with PSClient(args.ps, options) as client:
                client.wait_connected()
                if checkpoint_id is None:
                    checkpoint_id = default_checkpoint_id(time.time(), (s.last_checkpoint_id for s in client.status()))
                replies = client.checkpoint(checkpoint_id)
        except (PSError, ValueError) as exc:
            print(f"psctl: {exc}", file=sys.stderr)
            return 1
        for r in replies:
            print(f"checkpoint {r.checkpoint_id}: {r.path} (version {r.version})")
        complete = any(r.complete for r in replies)
        print(f"checkpoint {checkpoint_id} {'complete' if complete else 'INCOMPLETE'} on {len(replies)} shard(s)")
        return 0 if complete else 1
    try:
        shards = _status(args.ps, args.timeout, security)
    except (PSError, ValueError) as exc:
        print(f"psctl: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(shards, indent=2) if args.json else _table(shards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
