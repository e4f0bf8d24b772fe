"""What dsadapt prints reads as a person would write it: counts agree with their nouns ('1 patch',
never '1 patches': `plural`), sizes and small numbers are formatted for people (`size_words`,
`number`), nowhere a bare `/ 2**30` GiB figure that prints '0.0 GiB' for a 0.93 GiB shard."""

from __future__ import annotations

import re

from conftest import REPO_ROOT

SOURCES = sorted((REPO_ROOT / "patcher").rglob("*.py"))
#: nouns dsadapt counts in its messages; a count before one of them goes through `plural`
NOUNS = ("patches", "layers", "files", "configs", "backups", "points", "commits", "tags", "pins", "checkouts")


#: (file, text) of the counts that stay as they are: `report` counts configurations only from 2 on;
#: a pypi checkout's commit message is part of its commit id (never reworded); a source tree's files
#: are thousands (or '?')
KEPT = (("patcher/gate/report.py", "configs"), ("patcher/cli/commands/report.py", "configs"),
        ("patcher/upstream/sources.py", "Unpacked by dsadapt's pypi source"),
        ("patcher/bench/page.py", "s tree ("))


def test_no_message_puts_a_bare_count_before_a_plural_noun():
    # a count is an expression in braces; names of pins, engines, paths and tags before a noun are not
    pat = re.compile(r"\{([^{}]+)\} (" + "|".join(NOUNS) + r")\b")
    bad = []
    for f in SOURCES:
        rel = str(f.relative_to(REPO_ROOT))
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            m = pat.search(line)
            if not m or line.lstrip().startswith("#") or re.search(r"ref|engine|path|tag|name|meant|show\(", m.group(1)):
                continue
            if any(rel == kf and kt in line for kf, kt in KEPT):
                continue
            bad.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert not bad, "use plural(n, 'noun'):\n" + "\n".join(bad)


def test_no_message_prints_gib_with_one_decimal():
    pat = re.compile(r"/ 2\*\*30:\.\df\} GiB")
    bad = [f"{f.relative_to(REPO_ROOT)}:{n}" for f in SOURCES
           for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if pat.search(line)]
    assert not bad, "use size_words(bytes): " + ", ".join(bad)
