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


# ---------------------------------------------------------------- options a doc shows

#: where a command line written in prose or a code block ends
_END = re.compile(r"\s(?:\||&&|\|\||;|#|>|2>|<)\s|[`)]\s*$")


def _dsadapt_lines(text: str) -> list[str]:
    """Every `dsadapt ...` command a doc writes (in code spans and code blocks): from the word
    dsadapt (after an environment assignment, `$(BIN)/`, `.venv/bin/`) to the end of the command."""
    out = []
    for line in _command_lines(text):
        for m in re.finditer(r"(?:^|(?<=[\s`(]))(?:[\w.$()/-]*/)?dsadapt(?=\s)", line):
            rest = line[m.end():]
            cut = _END.search(rest)
            out.append("dsadapt" + (rest[:cut.start()] if cut else rest))
    return out


def _option_names(cmd) -> dict[str, object]:
    """Every option a click command takes (both forms of a --x/--no-x flag), by name."""
    names = {}
    for p in cmd.params:
        for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]:
            if o.startswith("-"):
                names[o] = p
    return names


def option_problems(line: str) -> list[str]:
    """What is wrong with the options of one `dsadapt ...` line: an option the command (or, before
    the command, dsadapt itself) does not take, or a global option written after the command."""
    import shlex

    import click

    from patcher.cli.main import cli

    text = line
    for ch in "[]`|…":  # optional parts, alternatives (--continue|--skip), the end of a code span
        text = text.replace(ch, " ")
    try:
        words = shlex.split(text.replace("...", " "))
    except ValueError:
        words = text.replace("...", " ").split()
    words = [w.rstrip(":,.;)") for w in words[1:] if not w.startswith(("<", "$", "{"))]
    top = {**_option_names(cli), **HELP}
    problems = []
    i = 0
    while i < len(words) and words[i].startswith("-"):  # dsadapt's own options, before the command
        name = words[i].split("=", 1)[0]
        p = top.get(name)
        if name not in top:
            problems.append(f"`dsadapt {name}` is no option of dsadapt (before the command)")
        i += 1 if p is None or getattr(p, "is_flag", False) or "=" in words[i] else 2
    if i >= len(words) or words[i] not in cli.commands:
        return problems
    cmd, where = cli.commands[words[i]], words[i]
    i += 1
    if isinstance(cmd, click.Group):
        if i < len(words) and words[i] in cmd.commands:
            cmd, where = cmd.commands[words[i]], f"{where} {words[i]}"
            i += 1
        else:
            return problems
    own = {**_option_names(cmd), **HELP}
    for w in words[i:]:
        if not w.startswith("-") or w in ("-", "--") or re.fullmatch(r"-\d+(\.\d+)?", w):
            continue
        name = w.split("=", 1)[0]
        if name in own:
            continue
        if name in top:
            problems.append(f"`{name}` is an option of dsadapt itself: it goes before the command "
                            f"(`dsadapt {name} ... {where}`), not after `{where}`")
        else:
            problems.append(f"`dsadapt {where}` has no option `{name}`")
    return problems


#: every command takes these (click's own)
HELP = {"--help": None, "-h": None}


def _command_spans(text: str) -> list[str]:
    """Code spans of prose that name a dsadapt command and an option of it (`check --rescore`,
    `gc --prune`), as the command lines they stand for; not another tool's (`git apply --cached`)."""
    from patcher.cli.main import COMMANDS

    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = []
    for m in re.finditer(r"(\S*)\s?`([^`\n]+)`", text):
        words = m.group(2).split()
        if m.group(1).lower() in ("git", "pip", "vllm", "lmdeploy", "uv"):
            continue
        if len(words) >= 2 and words[0] in COMMANDS and any(w.startswith("--") for w in words[1:]):
            out.append("dsadapt " + m.group(2))
    return out


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "commands.md"], ids=lambda d: str(d.relative_to(REPO_ROOT)))
def test_every_option_a_doc_shows_exists_where_it_shows_it(doc):
    text = doc.read_text(encoding="utf-8")
    bad = sorted({f"{p}  (in: {line.strip()[:90]})" for line in _dsadapt_lines(text) + _command_spans(text)
                  for p in option_problems(line)})
    assert not bad, f"{doc.relative_to(REPO_ROOT)}:\n" + "\n".join(bad)


@pytest.mark.parametrize("line, words", [
    ("dsadapt gc --prune", "`dsadapt gc` has no option `--prune`"),
    ("dsadapt perf vllm@v0.32.0 --report-dir DIR", "`--report-dir` is an option of dsadapt itself"),
    ("dsadapt --bogus status", "`dsadapt --bogus` is no option of dsadapt"),
    ("dsadapt model make --like deepseek-v3 --layerz 4", "`dsadapt model make` has no option `--layerz`"),
])
def test_the_option_check_sees_what_is_wrong(line, words):
    assert any(words in p for p in option_problems(line)), option_problems(line)


@pytest.mark.parametrize("line", [
    "dsadapt --project DIR --report-dir /tmp/r check vllm@v0.32.0 --model v3 --dtype bfloat16 --tp 2 --json",
    "dsadapt report --no-configs", "dsadapt check vllm@v0.32.0 [--variant cpu] [--model v3] -q",
    "dsadapt model slice SRC --layers 4 --out DIR", "dsadapt rebase --continue",
])
def test_the_option_check_takes_what_is_right(line):
    assert option_problems(line) == []


def _global_only() -> set[str]:
    """dsadapt's own options that no command takes (their place is before the command)."""
    import click

    from patcher.cli.main import cli

    subs = set()
    for name in cli.commands:
        cmd = cli.commands[name]
        subs |= set(_option_names(cmd))
        if isinstance(cmd, click.Group):
            for sub in cmd.commands.values():
                subs |= set(_option_names(sub))
    return set(_option_names(cli)) - subs - set(HELP)


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "commands.md"], ids=lambda d: str(d.relative_to(REPO_ROOT)))
def test_an_option_of_dsadapt_itself_is_shown_in_its_place(doc):
    """`--report-dir DIR` alone reads as if `check` or `perf` took it; written where it goes
    (`dsadapt --report-dir DIR perf …`) it cannot be misplaced."""
    only = _global_only()
    assert "--report-dir" in only and "--project" in only and "--publish" not in only
    bad = [span for span in _code_spans(doc.read_text(encoding="utf-8")) if span.split()[0] in only]
    assert not bad, f"{doc.relative_to(REPO_ROOT)}: write these as `dsadapt OPTION ... COMMAND`: {bad}"


# ---------------------------------------------------------------- outputs a doc names


def _json_rows() -> dict[str, str]:
    """docs/json.md's table: command -> its keys column."""
    rows = {}
    for line in (REPO_ROOT / "docs" / "json.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0]] = cells[2]
    return rows


def documented_keys(cell: str) -> tuple[list[str], dict[str, list[str]]]:
    """Pure: (top-level keys, {key: the keys of each of its items}) a json.md cell names:
    `a`, `b` (each: `x`, `y`; each of `y`: `z`) ..."""
    top: list[str] = []
    each: dict[str, list[str]] = {}
    depth, targets, naming = 0, [], False
    for m in re.finditer(r"`([^`]+)`|(\(each:)|(each of)|(:)|(\()|(\))", cell):
        key, opens_each, each_of, colon, opens, closes = m.groups()
        if opens_each:
            depth, targets = depth + 1, top[-1:]
        elif each_of:
            targets, naming = [], True
        elif colon:
            naming = False
        elif opens:
            depth += 1
        elif closes:
            depth = max(depth - 1, 0)
            targets = [] if depth == 0 else targets
        elif key and re.fullmatch(r"[a-z_]+", key):
            if naming:
                targets.append(key)
            elif depth == 0:
                top.append(key)
            else:
                for t in targets:
                    each.setdefault(t, []).append(key)
    return top, each


@pytest.mark.parametrize("command", ["`dsadapt --version`", "`list`", "`status`", "`gc`", "`report`"])
def test_the_json_keys_a_doc_names_are_in_the_output(command, tmp_path):
    """What docs/json.md says a command's --json document holds, it holds (run here, on this
    project, with an empty work dir; the commands that need no engine and no network)."""
    import contextlib
    import io
    import json
    import os
    from unittest import mock

    from patcher.cli.main import main

    args = {"`dsadapt --version`": ["--version", "--json"], "`list`": ["list", "--json"],
            "`status`": ["status", "--json"], "`gc`": ["gc", "--dry-run", "--json"],
            "`report`": ["report", "--json"]}[command]
    out = io.StringIO()
    env = {"DSADAPT_PROJECT": str(REPO_ROOT), "DSADAPT_WORKDIR": str(tmp_path / "work"), "DSADAPT_SOURCES": "pypi"}
    with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(args) == 0
    doc = json.loads(out.getvalue())
    top, each = documented_keys(_json_rows()[command])
    assert top and not [k for k in top if k not in doc], (command, [k for k in top if k not in doc])
    def items(key: str) -> list[dict]:  # every item of a list `key`, wherever it is (pins[*].checks[*])
        found: list[dict] = []

        def walk(x):
            if isinstance(x, dict):
                for k, v in x.items():
                    if k == key and isinstance(v, list):
                        found.extend(i for i in v if isinstance(i, dict))
                    else:
                        walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)

        walk(doc)
        return found

    for key, keys in each.items():
        for item in items(key)[:5]:
            assert not [k for k in keys if k not in item], (command, key, [k for k in keys if k not in item])


def test_documented_keys_reads_nested_lists():
    cell = "`pins` (each: `pin`, `checks`, `perfs`, …; each of `checks` and `perfs`: `config`), `ok` (false)"
    assert documented_keys(cell) == (["pins", "ok"], {"pins": ["pin", "checks", "perfs"], "checks": ["config"],
                                                      "perfs": ["config"]})


def test_every_stack_size_a_doc_states_is_the_stack_s():
    """`vllm@v0.32.0` (2 patches), `patches/triton/r26.01` (3 patches), a table row's "2 patches":
    the number of patches its series lists today."""
    from patcher.formats.lock import load_lock
    from patcher.formats.stackfiles import load_stack

    lock = load_lock(REPO_ROOT / "upstream.lock")
    pat = re.compile(r"`(?:patches/)?([a-z][\w-]*)[@/](v?[\w.]+)`(?:\s*\(|\s*\|\s*(?:the same )?)(\d+) patch(?:es)?\b")
    bad, seen = [], 0
    for doc in DOCS:
        for m in pat.finditer(doc.read_text(encoding="utf-8")):
            ref = f"{m.group(1)}@{m.group(2)}"
            if ref not in lock.pins:
                continue
            seen += 1
            n = len(load_stack(REPO_ROOT / "patches", lock.pins[ref].ref))
            if int(m.group(3)) != n:
                bad.append(f"{doc.name}: {m.group(0)} (the stack has {n})")
    assert seen >= 5 and not bad, bad


def test_every_picture_is_shown_by_a_doc_and_small():
    """docs/img/ holds the pictures docs show (tools/doc_images.py draws them), nothing else, a few
    hundred KB in all."""
    img = REPO_ROOT / "docs" / "img"
    shown = {m for doc in DOCS for m in re.findall(r"\]\((?:\.\./)?img/([\w.-]+\.png)\)", doc.read_text(encoding="utf-8"))}
    files = {f.name for f in img.glob("*")} if img.is_dir() else set()
    assert files == shown, (sorted(files - shown), sorted(shown - files))
    total = sum((img / f).stat().st_size for f in files)
    assert total < 400_000 and all((img / f).stat().st_size < 100_000 for f in files), total
