"""The on-disk format of shard checkpoints (DESIGN §5), in a directory that may be shared storage.

    root/LATEST                             {"id": ..., "num_shards": ...}: newest committed checkpoint
    root/.lock                              flock'd around moving LATEST and pruning
    root/ENDED                              {"after": id, "job": ...}: checkpoints <= id belong to ended jobs
    root/ckpt-{id:012d}/shard-{i}-of-{n}/   tensors.safetensors, metadata.json, MANIFEST.json,
                                            and rows-{k:05d}.safetensors per piece k (if any)

Every file is written to a temp name, fsynced, renamed, and its directory fsynced. MANIFEST (sizes
and sha256 of the other files) is written last, so a part without a valid one is incomplete.
A checkpoint counts only when all n parts verify; LATEST is the commit point and never moves back.
Tensors are safetensors and metadata JSON: nothing is ever unpickled. No gRPC, no store: plain values.

Pieces keep a large state (embedding tables) out of one giant buffer: a tensor named
``rows/{k:05d}/{name}`` (``name`` may contain '/') goes to the file of piece ``k`` as ``name``,
and comes back under the same key. Piece files are encoded, hashed and written one at a time, and
read, hashed and decoded one at a time, so at most one piece's bytes exist at once besides the
arrays. A part's MANIFEST lists exactly its files: a piece file it does not list makes the part
unusable. A part without pieces is byte-for-byte the format from before pieces existed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, TensorSpec, deserialize, serialize

from pswire.dtypes import dtype_from_safetensors, dtype_of
from pswire.errors import InvalidArgumentError, PSError
from pswire.files import write_atomically

__all__ = ["CheckpointError", "CheckpointStore", "JobEndedError", "ShardPart"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
TENSORS, METADATA, MANIFEST, LATEST = "tensors.safetensors", "metadata.json", "MANIFEST.json", "LATEST"
ENDED = "ENDED"
_CKPT_RE = re.compile(r"ckpt-(\d{12})")
ROWS = "rows/"
_ROWS_RE = re.compile(r"rows/([0-9]{5})/(.+)", re.DOTALL)  # a piece's tensor, as named in a ShardPart
_PIECE_RE = re.compile(r"rows-([0-9]{5})\.safetensors")  # a piece's file in a part directory
_PART_RE = re.compile(r"shard-(\d+)-of-(\d+)")


class CheckpointError(PSError):
    """A checkpoint cannot be written or restored as asked; the message names it and the problem."""


class JobEndedError(CheckpointError):
    """Every checkpoint to restore belongs to a job ended by ``psctl end-job`` (the ENDED mark)."""

    def __init__(self, message: str, *, job: str, after: int) -> None:
        super().__init__(message)
        self.job, self.after = job, after


class _Unfinished(CheckpointError):
    """A part has no MANIFEST: its writer has not finished (or crashed), or the manifest was lost."""


@dataclass(frozen=True)
class ShardPart:
    tensors: dict[str, np.ndarray]
    """Arrays by name, e.g. ``var/fc.weight``, ``opt/fc.weight/exp_avg``. Names starting with
    ``rows/`` must be ``rows/{k:05d}/{name}`` (a 5-digit piece number): each piece is stored in
    its own file, so a large state is never encoded as one buffer."""
    metadata: dict[str, Any]
    """JSON-serialisable; comes back as JSON gives it (tuples as lists, keys as strings)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some network/FUSE filesystems cannot fsync a directory at all
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    """``path`` replaced whole (pswire.files), and the rename itself made durable."""
    write_atomically(path, data)
    _fsync_dir(path.parent)


def _split(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[int, dict[str, np.ndarray]]]:
    """``(plain, {k: {name: array}})`` from a part's flat tensors; raises ValueError for a bad name,
    a value that is not an array or a dtype the shard does not hold (before anything is encoded)."""
    plain: dict[str, np.ndarray] = {}
    pieces: dict[int, dict[str, np.ndarray]] = {}
    for key, array in tensors.items():
        if not isinstance(key, str) or not isinstance(array, np.ndarray):
            raise ValueError(f"tensor names must be strings and values arrays: {key!r}")
        name, into = key, plain
        if key.startswith(ROWS):
            if not (m := _ROWS_RE.fullmatch(key)):
                raise ValueError(f"tensor {key!r}: a name starting with {ROWS!r} must be 'rows/NNNNN/name' "
                                 "with a 5-digit piece number")
            name, into = m[2], pieces.setdefault(int(m[1]), {})
        if name == "__metadata__":
            raise ValueError(f"tensor names must not be __metadata__: {key!r}")
        try:
            dtype_of(array.dtype)
        except InvalidArgumentError as exc:
            raise ValueError(f"cannot encode checkpoint part: {key!r}: {exc}") from None
        into[name] = array
    return plain, dict(sorted(pieces.items()))


def _encode(tensors: dict[str, np.ndarray]) -> bytes:
    """One safetensors file of already-checked arrays (see _split)."""
    specs, keep = {}, []
    for name, array in tensors.items():
        if not array.flags.c_contiguous:  # (not ascontiguousarray: it makes a 0-d array 1-d)
            array = array.copy(order="C")
        keep.append(array)  # serialize reads the memory by address: keep it alive until then
        specs[name] = TensorSpec(dtype=dtype_of(array.dtype).name, shape=list(array.shape),
                                 data_ptr=array.ctypes.data, data_len=array.nbytes)
    try:
        return bytes(serialize(specs))
    except (TypeError, ValueError, RuntimeError, SafetensorError) as exc:
        raise ValueError(f"cannot encode checkpoint part: {exc}") from exc


def _encode_metadata(metadata: dict[str, Any]) -> bytes:
    try:
        return json.dumps(metadata, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"cannot encode checkpoint part: {exc}") from exc


def _decode(data: bytes) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file (writable, each in its own memory); raises
    ``SafetensorError`` or ``ValueError`` for content that does not parse."""
    arrays = {}
    for name, view in deserialize(data):
        try:
            dtype = dtype_from_safetensors(view["dtype"])
        except InvalidArgumentError as exc:
            raise ValueError(f"{name!r}: {exc}") from None
        arrays[name] = np.frombuffer(view["data"], dtype=dtype.numpy).reshape(view["shape"])
    return arrays


def _entry(data: bytes) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def _manifest(cid: int, index: int, n: int, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"format": FORMAT_VERSION, "checkpoint_id": cid, "shard_index": index, "num_shards": n, "files": files}


def _piece_file(k: int) -> str:
    return f"rows-{k:05d}.safetensors"


def _stray_pieces(pdir: Path, listed: Any) -> list[str]:
    """Piece files in ``pdir`` that ``listed`` does not name (temp files are not pieces)."""
    return sorted(e.name for e in os.scandir(pdir) if _PIECE_RE.fullmatch(e.name) and e.name not in listed)


class CheckpointStore:
    """Shard checkpoints under ``root``. Holds no open files; several processes may share ``root``."""

    def __init__(self, root: str | Path, *, keep: int = 3, failpoint: Callable[[str], None] | None = None) -> None:
        """Raises ValueError if ``keep < 1``. ``failpoint(phase)`` is called at each write phase
        (tests raise from it to simulate a crash)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root, self.keep = Path(root), keep
        self._failpoint = failpoint or (lambda phase: None)

    def write(self, checkpoint_id: int, shard_index: int, num_shards: int, part: ShardPart) -> Path:
        """Write this shard's part; commit (move LATEST) if all parts are now complete; prune.

        Returns the part's directory. Raises ValueError on bad arguments or a part that cannot be
        encoded; CheckpointError if a complete, verified part with different content exists, or if
        another writer pruned this checkpoint meanwhile (only possible once a newer one is complete);
        OSError if the storage fails. Re-writing identical content is a no-op apart from the commit.
        """
        _check_args(shard_index, num_shards)
        if not 0 <= checkpoint_id < 10**12:
            raise ValueError(f"checkpoint_id must be in [0, 1e12), got {checkpoint_id}")
        plain, pieces = _split(part.tensors)
        meta = _encode_metadata(part.metadata)
        tensors = _encode(plain)
        files = {TENSORS: _entry(tensors), METADATA: _entry(meta)}
        ckpt = self._ckpt_dir(checkpoint_id)
        pdir = ckpt / f"shard-{shard_index}-of-{num_shards}"
        try:
            existing = self._verify_part(checkpoint_id, shard_index, num_shards, deep=True, keep=False)[0]
        except CheckpointError:
            existing = None  # absent, unfinished or damaged: (re)write it
        if existing is not None:
            if not self._same(existing["files"], files, pieces):
                raise CheckpointError(f"checkpoint {checkpoint_id} shard {shard_index}/{num_shards} in {self.root} "
                                      "already exists with different content")
        else:
            for d in (self.root, ckpt, pdir):  # fsync each parent so the new entries survive a crash
                if not d.is_dir():
                    d.mkdir(parents=True, exist_ok=True)
                    _fsync_dir(d.parent)
            # A stale MANIFEST from a damaged earlier attempt must not outlive the files it described,
            # nor its pieces that this part does not have (an unlisted piece file makes a part unusable).
            stale = [MANIFEST] if (pdir / MANIFEST).exists() else []
            stale += _stray_pieces(pdir, {_piece_file(k) for k in pieces})
            for name in stale:
                (pdir / name).unlink(missing_ok=True)
            if stale:
                _fsync_dir(pdir)
            try:
                self._failpoint("before_tensors")
                _write_durably(pdir / TENSORS, tensors)
                self._failpoint("tensors_written")
                del tensors
                for k, arrays in pieces.items():  # one piece's bytes at a time
                    self._failpoint("before_piece")
                    data = _encode(arrays)
                    files[_piece_file(k)] = _entry(data)
                    _write_durably(pdir / _piece_file(k), data)
                    del data
                    self._failpoint("piece_written")
                manifest = json.dumps(_manifest(checkpoint_id, shard_index, num_shards, files), sort_keys=True)
                for phase, name, blob in (("metadata", METADATA, meta), ("manifest", MANIFEST, manifest.encode())):
                    self._failpoint(f"before_{phase}")
                    _write_durably(pdir / name, blob)
                    self._failpoint(f"{phase}_written")
            except FileNotFoundError as exc:
                if pdir.is_dir():
                    raise
                # Another writer pruned it: a newer checkpoint is complete, so this one is obsolete.
                raise CheckpointError(f"checkpoint {checkpoint_id} in {self.root} was pruned while being "
                                      "written (a newer checkpoint is complete)") from exc
        self._commit_and_prune(checkpoint_id, num_shards)
        return pdir

    @staticmethod
    def _same(have: dict[str, Any], files: dict[str, Any], pieces: dict[int, dict[str, np.ndarray]]) -> bool:
        """Whether an existing part's manifest entries ``have`` describe this content: the plain
        files' ``files`` entries, and ``pieces`` encoded (and dropped) one at a time to hash them."""
        if set(have) != set(files) | {_piece_file(k) for k in pieces}:
            return False
        if any(have[name] != entry for name, entry in files.items()):
            return False
        return all(have[_piece_file(k)] == _entry(_encode(arrays)) for k, arrays in pieces.items())

    def load(self, shard_index: int, num_shards: int) -> tuple[int, ShardPart] | None:
        """Return ``(id, part)`` from the newest checkpoint whose every part verifies: LATEST's first,
        then the others newest first, each skipped one logged as a warning with its problem. (A
        complete checkpoint newer than LATEST, whose writer crashed before committing, is used only
        if LATEST's checkpoint is unusable.)

        Returns None when nothing was ever committed (no LATEST, or one that points into an ended
        job's checkpoints, and every checkpoint for this shard count since the end is unfinished).
        Raises JobEndedError when every checkpoint here belongs to an ended job (``mark_ended``);
        CheckpointError naming the problems when checkpoints exist but none is usable, including
        ones made for a different shard count; ValueError on bad arguments.
        """
        _check_args(shard_index, num_shards)
        problems: list[str] = []
        pointer = self._read_pointer(problems)
        scan = self._scan()
        ended = self.ended()
        after = ended["after"] if ended is not None else -1
        newest = max([*scan, pointer[0] if pointer else -1])
        if ended is not None and newest <= after:
            what = f"the newest checkpoint in {self.root} ({newest})" if newest >= 0 else \
                f"every checkpoint in {self.root} (up to {after})"
            raise JobEndedError(
                f"{what} belongs to job {ended['job']!r}, ended by psctl end-job: nothing of a running job to "
                "restore; start the shard without --restore (or with --restore auto) for a new job (psctl export "
                "--checkpoint still reads the ended job's model)", job=ended["job"], after=after,
            )
        # Only a later job's checkpoints count: the ended job's never come back.
        order = [pointer[0]] if pointer and pointer[1] == num_shards and pointer[0] > after else []
        order += sorted((c for c, ns in scan.items() if num_shards in ns and c not in order and c > after),
                        reverse=True)
        only_unfinished = True
        for cid in order:
            try:
                return cid, self._verify_checkpoint(cid, num_shards, want=shard_index)
            except CheckpointError as exc:
                only_unfinished &= isinstance(exc, _Unfinished)
                log.warning("checkpoint %d in %s is not usable, skipping it: %s", cid, self.root, exc)
                problems.append(str(exc))
        foreign = {c: n for c, ns in scan.items() for n in ns if n != num_shards and c > after}
        if pointer and pointer[1] != num_shards and pointer[0] > after:
            foreign[pointer[0]] = pointer[1]
        for cid in sorted(foreign, reverse=True)[:1]:
            problems.append(f"checkpoint {cid} in {self.root} was made for {foreign[cid]} shards, "
                            f"this job has {num_shards}")
        # LATEST is the commit point: without it (or with it on an ended job's checkpoint), no
        # complete checkpoint of this job was ever made, only ones whose writers crashed.
        committed = (self.root / LATEST).exists() and not (pointer is not None and pointer[0] <= after)
        if not foreign and only_unfinished and not committed:
            return None  # a crash during the very first checkpoint: there is nothing to restore
        raise CheckpointError(f"no usable checkpoint for shard {shard_index} of {num_shards} in {self.root}: "
                              + "; ".join(problems))

    def unfinished(self, num_shards: int) -> list[int]:
        """Ids of the checkpoints for ``num_shards`` shards that some part is missing from (or
        damaged in), newest first: e.g. what :meth:`load` skipped before returning None. Checks
        manifests and sizes only (no hashing)."""
        return sorted((c for c, ns in self._scan().items() if num_shards in ns and not self._complete(c, num_shards)),
                      reverse=True)

    def load_all(self, checkpoint_id: int | None = None) -> tuple[int, list[ShardPart]]:
        """Every part of one checkpoint, in shard order, for a reader of the whole job (the model
        with no shard running, ``psserver.model``): checkpoint ``checkpoint_id``, or else the newest
        usable one in :meth:`load`'s order, whatever its shard count. Every part is verified
        (sizes, sha256, parsing) before any is returned; each skipped checkpoint is logged.

        Raises CheckpointError naming the problems when there is no such checkpoint, or none usable.
        """
        problems: list[str] = []
        pointer = self._read_pointer(problems)
        scan = self._scan()
        if checkpoint_id is not None:
            order = [(checkpoint_id, n) for n in sorted(scan.get(checkpoint_id, ()))]
            if not order:
                have = ", ".join(str(c) for c in sorted(scan, reverse=True)[:5]) or "none"
                raise CheckpointError(f"checkpoint {checkpoint_id} is not in {self.root} (newest there: {have})")
        else:
            order = [pointer] if pointer else []
            order += [(c, n) for c, ns in sorted(scan.items(), reverse=True) for n in sorted(ns) if (c, n) != pointer]
        for cid, n in order:
            try:
                for i in range(n):  # cheap pass first, as _verify_checkpoint
                    self._verify_part(cid, i, n, deep=False)
                return cid, [self._verify_part(cid, i, n, deep=True)[1] for i in range(n)]
            except CheckpointError as exc:
                what = " (unfinished: a shard's part has no manifest)" if isinstance(exc, _Unfinished) else ""
                log.warning("checkpoint %d in %s is not usable, skipping it: %s%s", cid, self.root, exc, what)
                problems.append(f"{exc}{what}")
        raise CheckpointError(f"no usable checkpoint in {self.root}: " + ("; ".join(problems) or "there is none"))

    def mark_ended(self, job: str) -> int:
        """Record that every checkpoint here so far belongs to a job that was ended (``psctl
        end-job``), so that :meth:`load` (a restore) never brings it back; :meth:`load_all`
        still reads them. Returns the id marked. Idempotent; the mark only moves forward."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            pointer = self._read_pointer()
            after = max([*self._scan(), pointer[0] if pointer else 0, 0])
            previous = self.ended()
            if previous is None or previous["after"] < after:
                _write_durably(self.root / ENDED, json.dumps({"after": after, "job": job}).encode())
            return max(after, previous["after"] if previous else 0)
        finally:
            os.close(fd)

    def ended(self) -> dict | None:
        """The mark :meth:`mark_ended` left (``{"after": id, "job": name}``), None without one."""
        try:
            raw = json.loads((self.root / ENDED).read_bytes())
            if type(raw.get("after")) is not int:
                raise ValueError(f"bad values {raw!r}")
            return {"after": raw["after"], "job": str(raw.get("job", ""))}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{self.root / ENDED} is damaged ({exc}): remove it to restore from "
                                  f"{self.root}") from exc

    # --- internals -------------------------------------------------------------------------------

    def _ckpt_dir(self, cid: int) -> Path:
        return self.root / f"ckpt-{cid:012d}"

    def _scan(self) -> dict[int, dict[int, set[int]]]:
        """{checkpoint id: {num_shards: {shard indices with a directory}}}."""
        out: dict[int, dict[int, set[int]]] = {}
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return out
        for e in entries:
            m = _CKPT_RE.fullmatch(e.name)
            if not m or not e.is_dir():
                continue
            parts = out.setdefault(int(m[1]), {})
            try:
                for p in os.scandir(e.path):
                    if (pm := _PART_RE.fullmatch(p.name)) and p.is_dir():
                        parts.setdefault(int(pm[2]), set()).add(int(pm[1]))
            except FileNotFoundError:  # pruned by another process since the listing
                del out[int(m[1])]
        return out

    def _read_pointer(self, problems: list[str] | None = None) -> tuple[int, int] | None:
        try:
            raw = json.loads((self.root / LATEST).read_bytes())
            cid, n = raw["id"], raw["num_shards"]
            if type(cid) is not int or type(n) is not int or cid < 0 or n < 1:
                raise ValueError(f"bad values {raw!r}")
            return cid, n
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            msg = f"pointer {self.root / LATEST} is damaged ({exc}); scanning checkpoints instead"
            log.warning("%s", msg)
            if problems is not None:
                problems.append(msg)
            return None

    def _verify_part(self, cid: int, i: int, n: int, *, deep: bool, keep: bool = True) -> tuple[dict, ShardPart | None]:
        """Check one part against its MANIFEST: sizes only, or (``deep``) also sha256 and parsing,
        returning the part (unless not ``keep``: then each file is checked and dropped in turn).
        Raises _Unfinished without a MANIFEST, CheckpointError for other damage."""
        pdir, where = self._ckpt_dir(cid) / f"shard-{i}-of-{n}", f"checkpoint {cid} part {i}/{n}"
        try:
            manifest = json.loads((pdir / MANIFEST).read_bytes())
            files = manifest["files"]
            ok = (manifest["format"] == FORMAT_VERSION and isinstance(files, dict) and {TENSORS, METADATA} <= set(files)
                  and (manifest["checkpoint_id"], manifest["shard_index"], manifest["num_shards"]) == (cid, i, n))
            extra = sorted(name for name in files if name not in (TENSORS, METADATA) and not _PIECE_RE.fullmatch(name))
            if not all(isinstance(e, dict) and type(e["size"]) is int and isinstance(e["sha256"], str)
                       for e in files.values()):
                raise ValueError("a file's entry is not {size, sha256}")
            sizes = {name: (pdir / name).stat().st_size for name in files} if ok and not extra else {}
            stray = _stray_pieces(pdir, files) if ok and not extra else []
        except FileNotFoundError as exc:
            cls = _Unfinished if exc.filename == str(pdir / MANIFEST) else CheckpointError
            raise cls(f"{where}: {Path(exc.filename).name} is missing") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{where}: {MANIFEST} is damaged or unreadable: {exc!r}") from exc
        if not ok:
            raise CheckpointError(f"{where}: {MANIFEST} does not describe this part")
        if extra:
            raise CheckpointError(f"{where}: {MANIFEST} lists files that are not part of a checkpoint: {extra}")
        if stray:
            raise CheckpointError(f"{where}: piece files {stray} are not in {MANIFEST}")
        for name, size in sizes.items():  # stat first: catches truncation without reading anything
            if size != files[name]["size"]:
                raise CheckpointError(f"{where}: {name} has {size} bytes, {MANIFEST} says {files[name]['size']}")
        if not deep:
            return manifest, None
        tensors: dict[str, np.ndarray] = {}
        names: set[str] = set()  # kept even when the arrays are not, so every check is the same
        metadata = None
        # Plain tensors first, then the pieces in order: one file's bytes in memory at a time.
        for name in sorted(files, key=lambda f: (f != TENSORS, f)):
            try:
                blob = (pdir / name).read_bytes()
            except OSError as exc:
                raise CheckpointError(f"{where}: cannot read {exc.filename}: {exc}") from exc
            if hashlib.sha256(blob).hexdigest() != files[name]["sha256"]:
                raise CheckpointError(f"{where}: {name} does not match its sha256")
            try:
                if name == METADATA:
                    metadata = json.loads(blob)
                    continue
                arrays = _decode(blob)
            except (SafetensorError, ValueError) as exc:
                raise CheckpointError(f"{where}: {name} does not parse: {exc}") from exc
            del blob
            if (m := _PIECE_RE.fullmatch(name)) is not None:
                arrays = {f"rows/{m[1]}/{t}": a for t, a in arrays.items()}
                # Every name must come back as written: a non-empty name, no clash with another file's.
                bad = [t for t in arrays if not _ROWS_RE.fullmatch(t) or t in names]
                if bad:
                    raise CheckpointError(f"{where}: {name} has tensors whose names do not map back: {bad[:3]}")
            names.update(arrays)
            if keep:
                tensors.update(arrays)
            del arrays
        if not isinstance(metadata, dict):
            raise CheckpointError(f"{where}: {METADATA} is not a JSON object")
        return manifest, ShardPart(tensors, metadata) if keep else None

    def _verify_checkpoint(self, cid: int, n: int, *, want: int | None = None, deep: bool = True) -> ShardPart | None:
        """Verify every part 0..n-1 (all before returning anything); return part ``want``."""
        for i in range(n):  # cheap pass first: an unfinished checkpoint fails before any hashing
            self._verify_part(cid, i, n, deep=False)
        result = None
        for i in range(n if deep else 0):
            part = self._verify_part(cid, i, n, deep=True, keep=i == want)[1]  # others: parsed, dropped
            result = part if i == want else result
        return result

    def is_complete(self, checkpoint_id: int, num_shards: int) -> bool:
        """Whether every part of a checkpoint is present (manifests and sizes checked, no hashing)."""
        return self._complete(checkpoint_id, num_shards)

    def _complete(self, cid: int, n: int) -> bool:
        # Pruning checks sizes only (no hashing), so a write does not re-read the whole history.
        try:
            self._verify_checkpoint(cid, n, deep=False)
            return True
        except CheckpointError:
            return False

    def _commit_and_prune(self, cid: int, n: int) -> None:
        pointer = self._read_pointer()
        committed = False
        if pointer is None or pointer[0] < cid:
            try:
                self._verify_checkpoint(cid, n)
                committed = True
            except CheckpointError:
                pass  # other parts still missing (or damaged): a later writer commits
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # Other processes commit and prune too: re-read LATEST under the lock, so it never moves back.
            fcntl.flock(fd, fcntl.LOCK_EX)
            pointer = self._read_pointer()
            # Re-check cheaply too: a concurrent prune may have removed it since it was verified.
            if committed and (pointer is None or pointer[0] < cid) and self._complete(cid, n):
                self._failpoint("before_pointer")
                _write_durably(self.root / LATEST, json.dumps({"id": cid, "num_shards": n}).encode())
                self._failpoint("pointer_written")
                pointer = (cid, n)
            self._prune(n, just_written=cid, pinned=pointer[0] if pointer else None)
        finally:
            os.close(fd)  # closing releases the flock

    def _prune(self, n: int, *, just_written: int, pinned: int | None) -> None:
        for stale in self.root.glob(".deleting-*"):  # left behind by a crash in the middle of a delete
            shutil.rmtree(stale, ignore_errors=True)
        # Only checkpoint directories made entirely for this shard count are ours to prune.
        ours = sorted((c for c, ns in self._scan().items() if set(ns) == {n}), reverse=True)
        complete = [c for c in ours if self._complete(c, n)]
        doomed = complete[self.keep:]
        if complete:  # the writer of just_written may still be adding its other parts
            doomed += [c for c in ours if c < complete[0] and c not in complete and c != just_written]
        for cid in doomed:
            if cid == pinned:
                continue
            # Rename first (atomic) so a half-deleted checkpoint is never seen under its real name.
            trash = self.root / f".deleting-{cid:012d}-{secrets.token_hex(4)}"
            try:
                os.replace(self._ckpt_dir(cid), trash)
            except FileNotFoundError:
                continue
            log.info("pruned checkpoint %d in %s", cid, self.root)
            shutil.rmtree(trash, ignore_errors=True)
        _fsync_dir(self.root)

    def list(self) -> list[dict]:
        """For an operator tool: ``[{"id", "num_shards", "complete", "latest", "parts": [{"shard_index",
        "problem"}]}]``, newest first, ``problem`` None for a verified part. Fully verifies every part
        (reads everything). Raises OSError only if ``root`` cannot be listed."""
        pointer, out = self._read_pointer(), []
        for cid, ns in sorted(self._scan().items(), reverse=True):
            for n in sorted(ns):
                parts = [{"shard_index": i, "problem": self._problem(cid, i, n)} for i in range(n)]
                out.append({"id": cid, "num_shards": n, "complete": all(p["problem"] is None for p in parts),
                            "latest": pointer == (cid, n), "parts": parts})
        return out

    def _problem(self, cid: int, i: int, n: int) -> str | None:
        try:
            self._verify_part(cid, i, n, deep=True, keep=False)
            return None
        except CheckpointError as exc:
            return str(exc)


def _check_args(shard_index: int, num_shards: int) -> None:
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"need 0 <= shard_index < num_shards, got {shard_index} of {num_shards}")
