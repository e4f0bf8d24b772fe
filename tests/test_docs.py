"""docs/commands.md is the commands' own help: regenerate with `make docs` when a command changes."""

from pathlib import Path

from patcher.cli import cli
from patcher.commands.reference import command_reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "commands.md"


def test_command_reference_is_current():
    assert DOC.read_text(encoding="utf-8") == command_reference(cli), "run `make docs` to regenerate docs/commands.md"


def test_every_command_is_documented():
    text = DOC.read_text(encoding="utf-8")
    for name in cli.commands:
        assert f"## `dsadapt {name}`" in text
