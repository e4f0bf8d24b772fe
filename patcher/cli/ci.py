"""What CI systems read besides a command's output: JUnit XML (`--junit FILE`) and, on GitHub
Actions (GITHUB_ACTIONS=true), `::error` annotations (on stdout, where the runner reads workflow
commands; on stderr with --json, so that stdout stays one document) and Markdown tables appended to
$GITHUB_STEP_SUMMARY. Pure formatting plus two writes; the commands decide what to say."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Case:
    """One JUnit test case: a (pin, configuration) the command judged."""

    name: str
    classname: str
    seconds: float = 0.0
    failure: str | None = None       # the verdict's reasons when it failed
    skipped: str | None = None       # why it did not run here (never a pass)
    output: str = ""                 # where the report is, what was compared
    properties: dict = field(default_factory=dict)


def junit_xml(suite: str, cases: Sequence[Case]) -> str:
    """Pure: a JUnit XML document (one <testsuite>) for `cases`."""
    from xml.sax.saxutils import escape, quoteattr  # only when a report is written (`--junit FILE`)

    cases = unique_names(cases)
    failures = sum(c.failure is not None for c in cases)
    skipped = sum(c.skipped is not None and c.failure is None for c in cases)
    total = sum(c.seconds for c in cases)
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             f"<testsuites name={quoteattr(suite)} tests=\"{len(cases)}\" failures=\"{failures}\" "
             f"skipped=\"{skipped}\" time=\"{total:.2f}\">",
             f"  <testsuite name={quoteattr(suite)} tests=\"{len(cases)}\" failures=\"{failures}\" "
             f"errors=\"0\" skipped=\"{skipped}\" time=\"{total:.2f}\">"]
    for c in cases:
        lines.append(f"    <testcase classname={quoteattr(c.classname)} name={quoteattr(c.name)} "
                     f"time=\"{c.seconds:.2f}\">")
        if c.properties:
            lines.append("      <properties>")
            lines += [f"        <property name={quoteattr(str(k))} value={quoteattr(str(v))}/>"
                      for k, v in sorted(c.properties.items())]
            lines.append("      </properties>")
        if c.failure is not None:
            first = c.failure.splitlines()[0] if c.failure else "failed"
            lines.append(f"      <failure message={quoteattr(first[:500])} type=\"verdict\">{escape(c.failure)}</failure>")
        elif c.skipped is not None:
            lines.append(f"      <skipped message={quoteattr(c.skipped[:500])}/>")
        if c.output:
            lines.append(f"      <system-out>{escape(c.output)}</system-out>")
        lines.append("    </testcase>")
    lines += ["  </testsuite>", "</testsuites>", ""]
    return "\n".join(lines)


def unique_names(cases: Sequence[Case]) -> list[Case]:
    """Pure: the cases with no two of one class sharing a name (CI systems merge, or drop, test cases
    of equal names): a repeated name gets ' (2)', ' (3)' in the order given."""
    from dataclasses import replace

    seen: dict[tuple[str, str], int] = {}
    out = []
    for c in cases:
        n = seen[(c.classname, c.name)] = seen.get((c.classname, c.name), 0) + 1
        out.append(c if n == 1 else replace(c, name=f"{c.name} ({n})"))
    return out


def write_junit(path: Path | None, suite: str, cases: Sequence[Case]) -> None:
    if path is None:
        return
    from patcher.base.fsutil import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, junit_xml(suite, cases))


# ---------------------------------------------------------------- GitHub Actions


def on_github() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"


def _command_escape(text: str, prop: bool = False) -> str:
    """GitHub's workflow-command escaping (% CR LF, and : , in properties)."""
    out = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return out.replace(":", "%3A").replace(",", "%2C") if prop else out


def annotation(level: str, title: str, message: str, file: str | None = None) -> str:
    """Pure: a `::error`/`::warning`/`::notice` workflow command line."""
    props = [f"title={_command_escape(title, True)}"]
    if file:
        props.insert(0, f"file={_command_escape(file, True)}")
    return f"::{level} {','.join(props)}::{_command_escape(message)}"


def annotate(level: str, title: str, message: str, file: str | None = None, *, json_out: bool = False) -> None:
    """On GitHub Actions, one annotation line (stdout; stderr when stdout carries a JSON document)."""
    if not on_github():
        return
    stream = sys.stderr if json_out else sys.stdout
    stream.write(annotation(level, title, message, file) + "\n")
    stream.flush()


def md_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Pure: a Markdown table (| and newlines in cells escaped)."""
    def cell(x: object) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    head = "| " + " | ".join(cell(c) for c in columns) + " |"
    sep = "| " + " | ".join("---" for _ in columns) + " |"
    return "\n".join([head, sep, *("| " + " | ".join(cell(x) for x in r) + " |" for r in rows)]) + "\n"


def step_summary(markdown: str) -> None:
    """On GitHub Actions, append to the job's summary page ($GITHUB_STEP_SUMMARY)."""
    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if not on_github() or not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(markdown.rstrip("\n") + "\n\n")
    except OSError:  # a summary that cannot be written never fails the command
        pass
