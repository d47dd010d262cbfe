"""Files that readers in other processes watch: replaced whole, never seen half written."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Replace ``path`` with ``data`` (str is written as UTF-8) in one rename, after an fsync: a
    reader (a restore, Prometheus, a test waiting on a port file) sees the old file or the new
    one, never part of one. The temporary file, beside ``path``, has a name of its own, so two
    processes writing the same file do not mix; it is removed if the write fails. Raises
    ``OSError`` from the filesystem, with ``path`` unchanged."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
