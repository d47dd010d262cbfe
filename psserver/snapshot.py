"""A shard's state as checkpoint content (tensors + JSON metadata) and back.

``encode`` runs under the store's lock, so a snapshot never holds half of a push. ``decode``
verifies everything (every part present with its dtype and shape, every optimizer state, the
job's settings) and returns plain values; the store swaps them in only once all is verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pswire.codec import Part, dtype_name
from pswire.consistency import Consistency
from pswire.optim import OptimizerConfig
from psserver.job import Registration

__all__ = ["FORMAT", "Decoded", "decode", "encode_job"]

FORMAT = 1
_DTYPES = {dtype_name(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                      torch.int64, torch.int32, torch.int8, torch.uint8)}


def encode_job(job: Registration) -> dict[str, Any]:
    return {
        "shard_index": job.shard_index,
        "num_shards": job.num_shards,
        "placement_digest": job.placement_digest,
        "job_fingerprint": job.job_fingerprint,
        "optimizer": job.optimizer.to_dict(),
        "consistency": {
            "mode": job.consistency.mode.value, "staleness": job.consistency.staleness,
            "backup_workers": job.consistency.backup_workers,
            "stale_policy": job.consistency.stale_policy.value,
        },
        "parts": [[p.name, list(p.full_shape), dtype_name(p.dtype), p.row_start, p.row_end] for p in job.parts],
    }


def _decode_job(doc: dict[str, Any]) -> Registration:
    parts = []
    for name, shape, dtype, start, end in doc["parts"]:
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} for {name!r}")
        parts.append(Part(name, tuple(int(d) for d in shape), _DTYPES[dtype], int(start), int(end)))
    return Registration(
        worker_name="(checkpoint)",
        shard_index=int(doc["shard_index"]),
        num_shards=int(doc["num_shards"]),
        placement_digest=str(doc["placement_digest"]),
        parts=tuple(parts),
        optimizer=OptimizerConfig.from_dict(doc["optimizer"]),
        job_fingerprint=str(doc["job_fingerprint"]),
        consistency=Consistency(**doc["consistency"]),
    )


@dataclass
class Decoded:
    job: Registration
    values: dict[str, torch.Tensor]
    states: dict[str, dict[str, torch.Tensor]]
    sums: dict[str, torch.Tensor]
    metadata: dict[str, Any]


def decode(tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> Decoded:
    """Check a checkpoint part for completeness and consistency (the store checks optimizer state
    against its update rule). Raises ``ValueError`` naming the first problem; returns the pieces
    the store needs to resume."""
    if metadata.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {metadata.get('format')!r}, this shard reads format {FORMAT}")
    job = _decode_job(metadata["job"])
    values, states, sums = {}, {}, {}
    for part in job.parts:
        value = tensors.get(f"var/{part.key}")
        if value is None:
            raise ValueError(f"variable {part.key!r} is missing")
        if value.dtype != part.dtype or tuple(value.shape) != part.shape:
            raise ValueError(
                f"variable {part.key!r} is {value.dtype}{list(value.shape)}, expected {part.dtype}{list(part.shape)}"
            )
        values[part.key] = value
        prefix = f"opt/{part.key}/"
        states[part.key] = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
        if f"sum/{part.key}" in tensors:
            sums[part.key] = tensors[f"sum/{part.key}"]
    for key in ("version", "clock_floor", "open_clock", "received", "workers", "slot_versions", "next_worker_id"):
        if key not in metadata:
            raise ValueError(f"metadata lacks {key!r}")
    if set(metadata["slot_versions"]) != set(values):
        raise ValueError("metadata's part versions do not match the variables")
    return Decoded(job, values, states, sums, metadata)
