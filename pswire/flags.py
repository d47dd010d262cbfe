"""Command-line flags from a config dataclass, the way every CLI here reads its settings: flags,
then ``<PREFIX>_<FIELD>`` environment variables, then the dataclass defaults (flags win).

Fields carry ``metadata={"help": ..., "choices": ..., "const": ...}``; bool fields become ``--flag``
switches. ``choices`` bounds a flag's values and a variable's alike (a value outside them ends in
a usage error naming the flag, or the variable, and the allowed values). ``const`` makes a switch
that may take a value: ``--flag`` alone gives ``const``, ``--flag VALUE`` gives VALUE, and the
variable takes VALUE or, as for a bool switch, 1/true/yes/on (``const``) and 0/false/no/off or
empty (the field's default); e.g. ``--restore`` is ``--restore always``, ``PSSERVER_RESTORE=1``
is ``always`` and ``PSSERVER_RESTORE=0`` is ``never``.
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
_FALSE = ("0", "false", "no", "off", "")


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
            continue
        optional = {"nargs": "?", "const": f.metadata["const"]} if "const" in f.metadata else {}
        parser.add_argument(flag, type=_kind(f), default=None, choices=f.metadata.get("choices"),
                            help=_with_default(help_text, f.default), **optional)


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
            values[f.name] = _from_env(parser, f, env_name, env_value)
    try:
        return cls(**values)
    except ValueError as exc:
        parser.error(str(exc))


def _from_env(parser: argparse.ArgumentParser, f: dataclasses.Field, name: str, text: str) -> object:
    kind, spelling, choices = _kind(f), text.strip().lower(), f.metadata.get("choices")
    if kind is bool:
        return spelling in _TRUE
    switch = "const" in f.metadata  # a switch that may take a value: the bool spellings work too
    if switch and spelling in _TRUE + _FALSE:
        return f.metadata["const"] if spelling in _TRUE else f.default
    try:
        value = kind(text.strip() if choices is not None else text)
    except ValueError:
        parser.error(f"{name}={text!r} is not a valid {kind.__name__}")
    if choices is not None and value not in choices:
        also = f", or {'/'.join(_TRUE)} ({f.metadata['const']}) or {'/'.join(_FALSE[:-1])} ({f.default})" \
            if switch else ""
        parser.error(f"{name}={text!r} (--{f.name.replace('_', '-')}) must be one of "
                     + ", ".join(str(c) for c in choices) + also)
    return value


def parse(cls: type[T], parser: argparse.ArgumentParser, argv: Sequence[str] | None,
          env: Mapping[str, str], prefix: str) -> T:
    return values_from(cls, parser, parser.parse_args(argv), env, prefix)
