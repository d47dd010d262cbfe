"""Regenerate the protobuf and gRPC modules in ``pswire/v1`` from ``proto/``.

Run ``python -m pswire.gen`` after editing a ``.proto`` file; ``--check`` exits non-zero when the
committed modules differ from what ``proto/`` generates (a test runs it). Needs ``grpcio-tools``
(a test dependency): generated code is never edited by hand.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTO_FILES = ("pswire/v1/ps.proto",)
GENERATED = ("pswire/v1/ps_pb2.py", "pswire/v1/ps_pb2.pyi", "pswire/v1/ps_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Write the generated modules under ``out_dir``; raises ``RuntimeError`` if protoc fails."""
    from grpc_tools import protoc  # imported here: only developers and tests need grpcio-tools

    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def check() -> list[str]:
    """Return the generated files that differ from a fresh generation (empty when in sync)."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [
            rel
            for rel in GENERATED
            if not (ROOT / rel).exists() or not filecmp.cmp(Path(tmp) / rel, ROOT / rel, shallow=False)
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    args = parser.parse_args(argv)
    if args.check:
        stale = check()
        for rel in stale:
            print(f"out of date: {rel} (run python -m pswire.gen)", file=sys.stderr)
        return 1 if stale else 0
    generate(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
