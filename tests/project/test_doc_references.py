"""Every path, report, test, make target, command and exit code the docs name exists: a doc that
points at something gone is wrong, whatever else it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO_ROOT

DOCS = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")])
#: where a path a doc names may start (anything else in backticks is not taken for a repository path)
ROOTS = ("patcher/", "tests/", "tools/", "reports/", "docs/", "patches/", ".github/", ".ci/")
#: paths that exist only on a machine that ran something (work dir, builds), or are spelled as patterns
RUNTIME = (".dsadapt/", "dist/", ".carry/", ".venv/", "reports/ci/")


def _code_spans(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def _paths(text: str) -> set[str]:
    out = set()
    for span in _code_spans(text):
        for token in re.split(r"[\s,;()]+", span):
            token = token.strip("'\"").rstrip(".:")
            if token.startswith(ROOTS) and not token.startswith(RUNTIME):
                out.add(token)
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):  # markdown links
        if not target.startswith(("http://", "https://", "mailto:")):
            out.add("LINK:" + target)
    return out


def _exists(token: str, doc: Path) -> bool:
    if token.startswith("LINK:"):
        return (doc.parent / token[5:]).exists()
    path = token.split("::", 1)[0]
    if any(c in path for c in "<>{}[]|$") or "…" in path or "..." in path or "NNNN" in path or "ENGINE" in path:
        return True  # a pattern, not a path
    if "*" in path:
        return bool(list(REPO_ROOT.glob(path)))
    p = REPO_ROOT / path
    if not p.exists():
        return False
    if "::" in token and p.suffix == ".py":  # tests/test_x.py::test_name
        name = token.split("::", 1)[1].split("[")[0].split("::")[-1]
        return bool(re.search(rf"^\s*def {re.escape(name)}\b|^class {re.escape(name)}\b", p.read_text(), re.M))
    return True


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(REPO_ROOT)))
def test_every_path_a_doc_names_exists(doc):
    missing = sorted(t for t in _paths(doc.read_text(encoding="utf-8")) if not _exists(t, doc))
    assert not missing, f"{doc.relative_to(REPO_ROOT)} names what does not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(REPO_ROOT)))
def test_every_anchor_a_doc_links_to_exists(doc):
    def anchors(md: Path) -> set[str]:
        heads = re.findall(r"^#+\s+(.+)$", md.read_text(encoding="utf-8"), re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}

    bad = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", doc.read_text(encoding="utf-8")):
        md = doc if not target else doc.parent / target
        if md.suffix == ".md" and md.exists() and anchor not in anchors(md):
            bad.append(f"{target}#{anchor}")
    assert not bad, f"{doc.relative_to(REPO_ROOT)} links to missing headings: {bad}"


def test_every_exit_code_a_doc_names_is_one_dsadapt_has():
    from patcher.base.errors import ExitCode

    codes = {int(c) for c in ExitCode}
    bad = []
    for doc in DOCS:
        for m in re.finditer(r"\bexit(?: code)?s? (\d{1,3})\b", doc.read_text(encoding="utf-8")):
            if int(m.group(1)) not in codes:
                bad.append(f"{doc.name}: {m.group(0)}")
    assert not bad, bad


def _command_lines(text: str) -> list[str]:
    """Code spans and lines of code blocks that start with a command."""
    lines = [sp for sp in _code_spans(text)]
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        lines += block.splitlines()
    return [ln.strip() for ln in lines]


def test_every_make_target_and_command_a_doc_names_exists():
    from patcher.cli.main import COMMANDS

    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO_ROOT / "Makefile").read_text(), re.M))
    bad = []
    for doc in DOCS:
        if doc.name == "commands.md":  # generated from the commands' own help (tests/project/test_docs.py)
            continue
        for line in _command_lines(doc.read_text(encoding="utf-8")):
            m = re.match(r"make ([a-z][\w-]*)", line)
            if m and m.group(1) not in targets:
                bad.append(f"{doc.name}: make {m.group(1)}")
            m = re.match(r"(?:[\w./]*/)?dsadapt((?: --?[\w-]+(?:[ =](?!-)\S+)?)*) ([a-z][\w-]*)", line)
            if m and m.group(2) not in COMMANDS:
                bad.append(f"{doc.name}: {line[:60]}")
    assert not bad, sorted(set(bad))


def test_every_report_a_doc_names_is_committed():
    named = set()
    for doc in DOCS:
        for span in _code_spans(doc.read_text(encoding="utf-8")):
            if "git show" in span:  # an old commit's file, named as such
                continue
            named |= {t for t in re.findall(r"reports/[\w./-]+\.(?:json|md|png|txt)", span)
                      if not t.startswith("reports/ci/") and "ENGINE" not in t}
    missing = sorted(n for n in named if not (REPO_ROOT / n).exists() and "*" not in n)
    assert named and not missing, missing
