"""Command-line flags from a config dataclass, the way every CLI here reads its settings: flags,
then ``<PREFIX>_<FIELD>`` environment variables, then the dataclass defaults (flags win).

Fields carry ``metadata={"help": ..., "choices": ...}``; bool fields become ``--flag`` switches.
A help text that states its own default (``default: ...``, e.g. "(default: the task's)") is shown
as written; any other gets "(default: VALUE)" appended, except where there is no value to show
(None or "": the help says what unset means).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
from collections.abc import Mapping, Sequence
from typing import TypeVar

__all__ = ["add_fields", "add_version", "parse", "values_from", "version"]

T = TypeVar("T")
_TRUE = ("1", "true", "yes", "on")


def _kind(f: dataclasses.Field) -> type:
    # Annotations are strings under `from __future__ import annotations`: "int | None" -> int.
    return {"int": int, "float": float, "bool": bool}.get(str(f.type).split(" ")[0], str)


def add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of ``cls``, all defaulting to None so that unset flags are visible."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if _kind(f) is bool:
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        else:
            parser.add_argument(flag, type=_kind(f), default=None, choices=f.metadata.get("choices"),
                                help=_with_default(help_text, f.default))


def _with_default(help_text: str, default: object) -> str:
    # argparse's defaults are all None (values_from must see which flags were given), so the
    # field's default is written into the text instead, at most once.
    if "default:" in help_text.lower() or default in (None, "", dataclasses.MISSING):
        return help_text
    return f"{help_text} (default: {default})"


def version() -> str:
    """The installed psgrpc's version, or "unknown" when it is not installed (run from a
    source tree without ``pip install``)."""
    try:
        return importlib.metadata.version("psgrpc")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: print "PROG VERSION" (``parser.prog``, :func:`version`) and exit 0."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="Print the version and exit.")


def values_from(cls: type[T], parser: argparse.ArgumentParser, args: argparse.Namespace,
                env: Mapping[str, str], prefix: str) -> T:
    """Build ``cls`` from parsed flags, then environment variables, then defaults. Invalid
    values end in ``parser.error`` naming the flag or variable (exit status 2)."""
    values = {}
    for f in dataclasses.fields(cls):
        flag_value = getattr(args, f.name)
        env_name = f"{prefix}_{f.name.upper()}"
        env_value = env.get(env_name)
        if flag_value is not None:
            values[f.name] = flag_value
        elif env_value is not None:
            kind = _kind(f)
            if kind is bool:
                values[f.name] = env_value.strip().lower() in _TRUE
                continue
            try:
                values[f.name] = kind(env_value)
            except ValueError:
                parser.error(f"{env_name}={env_value!r} is not a valid {kind.__name__}")
    try:
        return cls(**values)
    except ValueError as exc:
        parser.error(str(exc))


def parse(cls: type[T], parser: argparse.ArgumentParser, argv: Sequence[str] | None,
          env: Mapping[str, str], prefix: str) -> T:
    return values_from(cls, parser, parser.parse_args(argv), env, prefix)
