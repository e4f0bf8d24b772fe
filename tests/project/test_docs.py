"""docs/commands.md is the commands' own help: regenerate with `make docs` when a command changes.

The file is checked against `dsadapt CMD --help` run as a real subprocess (what a user sees),
not against the generator that wrote it: a generator bug (like a doubled `dsadapt dsadapt`)
cannot hide behind its own output.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from patcher.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "commands.md"


def _command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    for name in sorted(group.commands):
        cmd = group.commands[name]
        out += _command_paths(cmd, prefix + (name,)) if isinstance(cmd, click.Group) else [prefix + (name,)]
    return out


def _sections(text: str) -> dict[str, str]:
    """`## \\`dsadapt x\\`` heading -> the help text in its code block."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^## `([^`]+)`\n\n```\n(.*?)\n```\n", text, re.S | re.M)}


def test_command_reference_is_current():
    """Generated in a fresh interpreter, as `make docs` does: other tests in this process may have swapped
    an engine's adapter, which changes the choices some options list."""
    code = ("from patcher.cli.main import cli; from patcher.cli.commands.reference import command_reference; "
            "import sys; sys.stdout.write(command_reference(cli))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert DOC.read_text(encoding="utf-8") == r.stdout, "run `make docs` to regenerate docs/commands.md"


def test_every_command_is_documented():
    sections = _sections(DOC.read_text(encoding="utf-8"))
    for path in _command_paths(cli):
        assert " ".join(("dsadapt",) + path) in sections, path


@pytest.mark.parametrize("path", _command_paths(cli), ids=lambda p: " ".join(p) or "dsadapt")
def test_reference_matches_help_run_as_a_subprocess(path):
    sections = _sections(DOC.read_text(encoding="utf-8"))
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "patcher.cli.main", *path, "--help"], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip() == sections[" ".join(("dsadapt",) + path)]
    usage = r.stdout.splitlines()[0]
    assert usage.startswith("Usage: " + " ".join(("dsadapt",) + path) + " ")
    assert "dsadapt dsadapt" not in r.stdout
