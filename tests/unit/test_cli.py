"""What every console script says about itself: ``--help`` gives each flag's default once and
never as "None", and ``--version`` prints "PROG VERSION". The scripts are called in-process
through the entry points ``pyproject.toml`` declares, so the test follows the real targets.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from dataclasses import dataclass

import pytest

from pswire import flags

pytestmark = pytest.mark.timeout(60)

SCRIPTS = ("psserver", "psworker", "pscluster", "psctl", "psbench")
def _main(script: str):
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name=script)
    return entry.load()


def _run(script: str, argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.setenv("COLUMNS", "100")  # one wrapping, whatever the terminal
    with pytest.raises(SystemExit) as info:
        _main(script)(argv)
    out, err = capsys.readouterr()
    return info.value.code or 0, out + err


def _flag_helps(help_text: str) -> dict[str, str]:
    """Each option's help from a ``--help`` page, its wrapped lines joined."""
    helps: dict[str, str] = {}
    flag = None
    for line in help_text.splitlines():
        if re.match(r"  -", line):
            flag = line.split()[0].rstrip(",")
            helps[flag] = line
        elif flag is not None and line.startswith("   "):
            helps[flag] += " " + line
        else:
            flag = None
    return {f: " ".join(h.split()) for f, h in helps.items()}


def _subcommands(help_text: str) -> dict[str, str]:
    """Each subcommand argparse lists (indented by four) with its one-line help, wrapped or not."""
    found = re.findall(r"^    ([a-z][\w-]*)(?: +|\n {6,})(\S[^\n]*)", help_text, re.MULTILINE)
    return dict(found)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_gives_each_default_once_and_never_none(script, capsys, monkeypatch):
    code, text = _run(script, ["--help"], capsys, monkeypatch)
    assert code == 0
    pages = {script: text}
    for command in _subcommands(text):  # psctl's
        code, pages[f"{script} {command}"] = _run(script, [command, "--help"], capsys, monkeypatch)
        assert code == 0
    for page, page_text in pages.items():
        helps = _flag_helps(page_text)
        assert "--help" in helps or "-h" in helps, page
        for help_line in helps.values():
            assert "(default: None)" not in help_line, (page, help_line)
            assert "(default: )" not in help_line, (page, help_line)
            assert help_line.count("(default:") <= 1, (page, help_line)


def test_psctl_help_lists_each_subcommand_with_a_line(capsys, monkeypatch):
    code, text = _run("psctl", ["--help"], capsys, monkeypatch)
    assert code == 0
    commands = _subcommands(text)
    assert {"status", "checkpoint"} <= set(commands), text


@pytest.mark.parametrize("script", SCRIPTS)
def test_version_prints_the_script_and_the_package_version(script, capsys, monkeypatch):
    code, text = _run(script, ["--version"], capsys, monkeypatch)
    assert code == 0
    assert text.strip() == f"{script} {importlib.metadata.version('psgrpc')}"


def test_version_without_the_package_installed_is_unknown(monkeypatch):
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert flags.version() == "unknown"


@dataclass(frozen=True, kw_only=True)
class _Settings:
    size: int = dataclasses.field(default=3, metadata={"help": "Size."})
    name: str | None = dataclasses.field(default=None, metadata={"help": "Name; unset: the host's."})
    empty: str = dataclasses.field(default="", metadata={"help": "Sections; empty: all."})
    own: int | None = dataclasses.field(default=None, metadata={"help": "Count (default: the task's)."})
    stated: float = dataclasses.field(default=0.5, metadata={"help": "Rate (Default: half)."})
    switch: bool = dataclasses.field(default=False, metadata={"help": "A switch."})


@pytest.mark.parametrize("flag, expected", [
    ("--size", "Size. (default: 3)"),
    ("--name", "Name; unset: the host's."),
    ("--empty", "Sections; empty: all."),
    ("--own", "Count (default: the task's)."),
    ("--stated", "Rate (Default: half)."),
    ("--switch", "A switch."),
])
def test_a_field_default_is_written_once_unless_the_help_states_it(flag, expected):
    import argparse

    parser = argparse.ArgumentParser()
    flags.add_fields(parser, _Settings)
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    assert action.help == expected


@dataclass(frozen=True, kw_only=True)
class _Switches:
    level: str = dataclasses.field(default="low", metadata={"help": "Level.", "choices": ("low", "mid", "high"),
                                                             "const": "high"})
    name: str = dataclasses.field(default="x", metadata={"help": "Name."})
    switch: bool = dataclasses.field(default=False, metadata={"help": "A switch."})


@pytest.mark.parametrize("argv, env, expected", [
    ([], {}, ("low", "x", False)),
    (["--level"], {}, ("high", "x", False)),  # a bare switch gives const
    (["--level", "mid", "--name", "y", "--switch"], {}, ("mid", "y", True)),
    (["--level", "--switch"], {}, ("high", "x", True)),
    ([], {"T_LEVEL": "mid", "T_NAME": "on", "T_SWITCH": "yes"}, ("mid", "on", True)),
    ([], {"T_LEVEL": "yes"}, ("high", "x", False)),  # the bool spellings of a switch: const ...
    ([], {"T_LEVEL": "0"}, ("low", "x", False)),  # ... and the default
    ([], {"T_LEVEL": ""}, ("low", "x", False)),
    (["--level", "mid"], {"T_LEVEL": "high"}, ("mid", "x", False)),
])
def test_a_field_with_const_is_a_switch_that_may_take_a_value(argv, env, expected):
    import argparse

    parser = argparse.ArgumentParser()
    flags.add_fields(parser, _Switches)
    got = flags.parse(_Switches, parser, argv, env, "T")
    assert (got.level, got.name, got.switch) == expected


@pytest.mark.parametrize("argv, env, message", [
    (["--level", "top"], {}, "argument --level: invalid choice: 'top' (choose from 'low', 'mid', 'high')"),
    ([], {"T_LEVEL": "top"}, "T_LEVEL='top' (--level) must be one of low, mid, high, or 1/true/yes/on (high) or "
                             "0/false/no/off (low)"),
])
def test_choices_bound_flags_and_variables_alike(argv, env, message, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    flags.add_fields(parser, _Switches)
    with pytest.raises(SystemExit) as info:
        flags.parse(_Switches, parser, argv, env, "T")
    assert info.value.code == 2 and message in capsys.readouterr().err
