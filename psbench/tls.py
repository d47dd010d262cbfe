"""The cost of TLS: the same push + pull rounds and the same cluster training with mutual TLS
and in plaintext, alternated in one run so that a change in the machine's load touches both.

A throwaway PKI (``pswire.security.make_dev_pki``, written into the run's work directory) gives
the TLS shards their certificate and the CA whose client certificates they require
(``--tls-cert/--tls-key/--tls-client-ca``); psbench's client and the workers present the client
certificate (``ClientSecurity``, ``--tls-ca/--tls-cert/--tls-key``). TLS covers the gRPC port
and the bulk lanes alike, so both setups keep the lanes on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from psbench.config import TrainingCase
from psbench.procs import Children
from psbench.ps import GoodputResult, Setup, measure_goodput_alternated, start_shards
from psbench.stats import median, median_ratio
from psbench.training import BATCH_SIZE, cluster_fields, run_cluster
from pswire.security import DevPKI, make_dev_pki

__all__ = ["TlsTrainingResult", "goodput_comparison", "make_pki", "measure_tls_goodput", "measure_tls_training"]

log = logging.getLogger(__name__)

MIB = 1 << 20


def make_pki(workdir: Path) -> DevPKI:
    """A new CA, shard and client certificates for ``127.0.0.1`` in ``workdir/tls``."""
    return make_dev_pki(workdir / "tls", ("127.0.0.1", "localhost"))


def goodput_comparison(plain: GoodputResult, tls: GoodputResult) -> dict:
    """Both results, and TLS / plaintext: the goodput as the median over repetitions of each
    TLS round against the plaintext round of the same repetition; push, pull and CPU per MiB as
    ratios of the medians (of the per-round figures). Raises ``ValueError`` if the two did not
    run the same number of rounds."""
    return {
        "size_mib": plain.size_mib,
        "shards": plain.shards,
        "plain": plain.to_dict(),
        "tls": tls.to_dict(),
        "ratio": median_ratio(plain.round_seconds, tls.round_seconds),
        "push_ratio": tls.push_bytes_per_second / plain.push_bytes_per_second,
        "pull_ratio": tls.pull_bytes_per_second / plain.pull_bytes_per_second,
        "cpu_ratio": (tls.cpu_seconds_per_mib / plain.cpu_seconds_per_mib if plain.cpu_seconds_per_mib else None),
    }


def measure_tls_goodput(children: Children, pki: DevPKI, size_mib: int, *, reps: int, warmup: int,
                        shards: int = 1) -> dict:
    """Push + pull rounds of a ``size_mib`` model on plaintext shards and on mutual-TLS shards,
    bulk lanes on in both, rounds alternated (:func:`psbench.ps.measure_goodput_alternated`);
    returns :func:`goodput_comparison`. Raises ``pswire.errors.PSError`` or ``ChildError``."""
    plain, tls = measure_goodput_alternated(
        children, size_mib, shards,
        (Setup(), Setup(shard_flags=tuple(pki.shard_flags()), security=pki.client())),
        reps=reps, warmup=warmup,
    )
    log.info("goodput %d MiB, %d shard(s): plaintext %.0f MiB/s, TLS %.0f MiB/s", size_mib, shards,
             plain.bytes_per_second / MIB, tls.bytes_per_second / MIB)
    return goodput_comparison(plain, tls)


@dataclass(frozen=True)
class TlsTrainingResult:
    """Cluster runs of one model in plaintext and with mutual TLS, one of each per repetition."""

    case: TrainingCase
    plain: list[list[dict]]
    """Per repetition, every plaintext worker's result line."""
    tls: list[list[dict]]
    """Per repetition, every TLS worker's result line."""
    plain_shard_cpu_seconds: list[float]
    """Per repetition, CPU seconds of the plaintext shards during the run."""
    tls_shard_cpu_seconds: list[float]
    workers: int
    shards: int

    @property
    def plain_samples_per_second(self) -> float:
        return median(_rates(self.plain))

    @property
    def tls_samples_per_second(self) -> float:
        return median(_rates(self.tls))

    @property
    def ratio(self) -> float:
        """The median over repetitions of the TLS run against the plaintext run of the same
        repetition (run back to back)."""
        return median_ratio(_rates(self.tls), _rates(self.plain))

    def to_dict(self) -> dict:
        return {
            **cluster_fields(self.case, self.shards, self.workers),
            "plain_samples_per_second": self.plain_samples_per_second,
            "tls_samples_per_second": self.tls_samples_per_second,
            "ratio": self.ratio,
            "plain_reps": _rates(self.plain),
            "tls_reps": _rates(self.tls),
            # Shard CPU per step of one worker: what the encryption adds on the shards' side.
            "plain_shard_cpu_ms_per_step": _per_step(self.plain_shard_cpu_seconds, self.plain),
            "tls_shard_cpu_ms_per_step": _per_step(self.tls_shard_cpu_seconds, self.tls),
        }


def _rates(reps: list[list[dict]]) -> list[float]:
    return [sum(w["samples_per_second"] for w in rep) for rep in reps]


def _per_step(cpu_seconds: list[float], reps: list[list[dict]]) -> float:
    steps = [sum(w["samples"] for w in rep) / BATCH_SIZE for rep in reps]
    return median([1e3 * cpu / n for cpu, n in zip(cpu_seconds, steps)])


def measure_tls_training(
    children: Children, case: TrainingCase, pki: DevPKI, *, reps: int, shards: int = 2, workers: int = 2,
    timeout: float = 600.0,
) -> TlsTrainingResult:
    """``reps`` plaintext and ``reps`` mutual-TLS cluster runs of ``case`` (``shards`` shards,
    ``workers`` async workers), back to back, the first of each pair alternating. Each setup
    has its own shards, all started before the first run. Raises ``ChildError``."""
    plain_shards, tls_shards = [], []
    runs: dict[bool, list[list[dict]]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    try:
        plain_shards = start_shards(children, shards)
        tls_shards = start_shards(children, shards, *pki.shard_flags())
        sides = {False: (plain_shards, ()), True: (tls_shards, tuple(pki.client_flags()))}
        for rep in range(reps):
            for tls in ((False, True) if rep % 2 == 0 else (True, False)):
                started, flags = sides[tls]
                ps = ",".join(address for _, address in started)
                before = sum(child.cpu_seconds() for child, _ in started)
                runs[tls].append(run_cluster(children, case, ps, workers=workers, timeout=timeout, run=rep,
                                             extra=flags))
                cpu[tls].append(sum(child.cpu_seconds() for child, _ in started) - before)
            log.info("mlp%d rep %d: plaintext %.0f samples/s, TLS %.0f samples/s", case.width, rep + 1,
                     _rates(runs[False][-1:])[0], _rates(runs[True][-1:])[0])
    finally:
        for child, _ in plain_shards + tls_shards:
            children.stop(child)
    return TlsTrainingResult(case, runs[False], runs[True], cpu[False], cpu[True], workers, shards)
