"""The rebase report: what happened to every patch of OLD's stack on NEW (pure data + formatting).

Written by `dsadapt rebase` into reports/rebase/ENGINE-OLD-to-NEW.md and .json. The JSON is the
same data as the markdown; see docs/rebase.md for the schema.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field

from patcher.stack.state import CARRIED, Outcome

# The classifications, in the order reports list them.
OUTCOMES = (Outcome.CLEAN, Outcome.MERGED, Outcome.CHANGED, Outcome.UPSTREAM, Outcome.SKIPPED)

_RD_HEADER = re.compile(r"^\s*(\d+|-):\s+([0-9a-f]+|-+)\s+([<>=!])\s+(\d+|-):\s+([0-9a-f]+|-+)\s(.*)$")


@dataclass
class PatchReport:
    index: int                 # position in OLD's stack (1-based)
    name: str                  # file name in OLD's stack
    subject: str
    outcome: Outcome           # one of OUTCOMES
    detail: str                # how it applied, or how it was found upstream
    new_name: str | None = None  # file name in NEW's stack (carried patches only)
    range_diff: str = ""       # this patch's block of `git range-diff`


@dataclass
class RebaseReport:
    engine: str
    old: str                   # OLD tag
    new: str                   # NEW tag
    old_version: str
    new_version: str
    date: str
    old_source: str
    new_source: str
    pinned_new: bool           # the rebase added NEW to upstream.lock
    old_stack_hash: str
    new_stack_hash: str
    range_diff_command: str
    patches: list[PatchReport] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        c = Counter(p.outcome for p in self.patches)
        return {k: c[k] for k in OUTCOMES if c[k]}

    def to_json(self) -> dict:
        return {**asdict(self), "counts": self.counts}


def report_stem(engine: str, old: str, new: str) -> str:
    return f"{engine}-{old}-to-{new}"


def split_range_diff(text: str) -> dict[int, str]:
    """`git range-diff` output split into blocks keyed by the left (OLD) position.

    Blocks for commits that exist only on the right (``-: ------- > 3: …``) are left out:
    a rebase never adds patches.
    """
    blocks: dict[int, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        m = _RD_HEADER.match(line)
        if m:
            current = None
            if m.group(1) != "-":
                current = blocks.setdefault(int(m.group(1)), [])
            if current is not None:
                current.append(line.rstrip())
            continue
        if current is not None:
            current.append(line.rstrip())
    return {k: "\n".join(v).rstrip("\n") for k, v in blocks.items()}


def format_markdown(r: RebaseReport) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in r.counts.items()) or "empty stack"
    out = [
        f"# Rebase of {r.engine}@{r.old} onto {r.new}",
        "",
        f"- date: {r.date}",
        f"- from: {r.engine}@{r.old} ({r.old_version}), source {r.old_source}, stack {r.old_stack_hash[:10]}",
        f"- onto: {r.engine}@{r.new} ({r.new_version}), source {r.new_source}, stack {r.new_stack_hash[:10]}"
        + (" (pinned by this rebase)" if r.pinned_new else ""),
        f"- result: {counts}",
        "",
        "| # | patch | outcome | detail | in the new stack |",
        "|---|-------|---------|--------|------------------|",
    ]
    for p in r.patches:
        out.append(f"| {p.index} | {_cell(p.name)} | {p.outcome} | {_cell(p.detail)} | {_cell(p.new_name or '—')} |")
    dropped = [p for p in r.patches if p.outcome not in CARRIED]
    if dropped:
        out += ["", "## Dropped", ""]
        for p in dropped:
            why = "already upstream" if p.outcome == Outcome.UPSTREAM else "skipped by the user"
            out.append(f"- {p.name}: {why}: {p.detail}")
    out += ["", "## Range-diff of every carried patch", "",
            f"`{r.range_diff_command}` (`=` same change, `!` changed, `<` dropped).", ""]
    for p in r.patches:
        if p.outcome not in CARRIED:
            continue
        out += [f"### {p.index}. {p.subject} ({p.outcome})", "", "```", p.range_diff or "(no range-diff output)", "```", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
