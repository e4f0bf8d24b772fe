"""The CLI behaves like the tools its users live in: results on stdout and progress on stderr,
-q/-v, colour only where wanted, tables within 100 columns off a terminal, a `schema` in every
--json document, --version naming the environment, shell completion, heartbeats that do not
repeat themselves."""

from __future__ import annotations

import ast
import io
import json
import time
from pathlib import Path

import pytest
from conftest import REF1, REPO_ROOT

from patcher.cli.commands import common


def test_plain_tables_fit_100_columns_and_wrap_long_cells(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    rows = [["vllm@v0.32.0", "pass", "x " * 80], ["lmdeploy@v0.18.0", "FAIL", "y" * 150]]
    text = common.plain_table("t", ["pin", "verdict", "detail"], rows, width=common.plain_width())
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "vllm@v0.32.0" in text and "lmdeploy@v0.18.0" in text  # short columns are never cut
    assert "".join(text.split()).count("y" * 10) >= 14  # nothing lost, only wrapped
    monkeypatch.setenv("COLUMNS", "60")
    assert max(len(line) for line in common.plain_table(None, ["a", "b"], [["1", "z " * 60]],
                                                        width=common.plain_width()).splitlines()) <= 60


@pytest.mark.parametrize("width", [60, 95, 100])
def test_plain_tables_never_break_a_name_inside_a_word(width):
    rows = [["lmdeploy@v0.18.0", "pytorch deepseek-v3-slice4 fp8", "check: pass", "2026-12-01", "H200",
             "planted-inverse-deepseek-v3-slice4-fp8.json"],
            ["vllm@v0.32.0", "cpu v3 transformers float32 tp2", "perf: pass (quick run)", "2026-11-30", "CPU",
             "v3-transformers-float32-tp2.json"]]
    cols = ["pin", "configuration", "gate: verdict", "date", "machine", "report"]
    text = common.plain_table(None, cols, rows, width=width)
    assert max(len(ln) for ln in text.splitlines()) <= width
    words = {w for r in [cols, *rows] for c in r for w in common._words(c)}
    assert {"planted-", "inverse-", "deepseek-v3-slice4-fp8.json"} <= words  # textwrap's own pieces
    got = {w for ln in text.splitlines() if set(ln) - {"-", " "} for w in common._words(ln)}
    if width >= 16 + 18 + 7 + 10 + 7 + 27 + 2 * 5:  # the longest words side by side fit: none is cut
        assert got <= words, (got - words, text)  # every piece is a whole word, or ends at a hyphen


def test_colour_follows_no_color_and_the_color_option(monkeypatch):
    from patcher.cli import options

    options.reset()
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert common.verdict_word("PASS") == "PASS"  # not a terminal (pytest captures stdout)
    options.set_color("always")
    assert common.verdict_word("PASS") == "\x1b[32;1mPASS\x1b[0m"
    options.set_color("auto")
    monkeypatch.setenv("NO_COLOR", "1")
    assert not options.color_enabled()
    options.set_color("never")
    assert common.verdict_word("FAIL") == "FAIL"
    options.reset()


def test_heartbeats_say_when_nothing_new_came_and_stop_when_the_step_ends():
    stream = io.StringIO()
    p = common.Progress(stream, live=False, heartbeat=0.3, slow=0.0)
    p("engine: loading")
    p.note("INFO loading weights")
    time.sleep(3.3)
    p.end()
    time.sleep(0.8)
    p.close()
    lines = [line for line in stream.getvalue().splitlines() if "still" in line]
    assert lines, stream.getvalue()
    assert sum("INFO loading weights" in line for line in lines) == 1, lines  # said once, not every beat
    assert any("no new output for" in line for line in lines), lines
    assert stream.getvalue().rstrip().splitlines()[-1].startswith("  engine: loading:")  # its time, then silence


def test_verbose_progress_prints_every_line_as_it_comes():
    stream = io.StringIO()
    p = common.Progress(stream, live=False, verbose=True)
    p("installing")
    p.note("pip: Collecting torch")
    p.note("pip: Collecting numpy")
    p.close()
    assert "    | pip: Collecting torch\n    | pip: Collecting numpy" in stream.getvalue()


def test_every_json_document_names_its_schema():
    """Every `emit_json` in the commands names a schema (or passes a document that has one)."""
    missing = []
    for f in sorted((REPO_ROOT / "patcher" / "cli" / "commands").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "emit_json":
                has_kw = any(k.arg == "schema" for k in node.keywords)
                literal = node.args and isinstance(node.args[0], ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value == "schema" for k in node.args[0].keys)
                if not (has_kw or literal):
                    missing.append(f"{f.name}:{node.lineno}")
    assert not missing, missing
    documented = (REPO_ROOT / "docs" / "json.md").read_text()
    for f in sorted((REPO_ROOT / "patcher").rglob("*.py")):
        for schema in set(__import__("re").findall(r'"(dsadapt\.[a-z-]+/\d+)"', f.read_text())):
            assert f"`{schema}`" in documented, (f, schema)


def test_json_of_commands_and_errors_carry_a_schema(project, clean_stack):
    for args in (("list",), ("status",), ("report",), ("gc", "--dry-run"), ("verify",), ("matrix", "--only", "pinned"),
                 ("--version",), ("apply", "nope@v1"), ("check", "vllm@v1.0.0", "--model", "nope")):
        r = project.run(*args, "--json")
        doc = r.json()
        assert str(doc.get("schema", "")).startswith("dsadapt."), (args, doc)
        if r.rc not in (0, 6):
            assert doc["schema"] == "dsadapt.error/1" and doc["ok"] is False, (args, r)
    assert project.run("--json", "--version").json()["schema"] == "dsadapt.version/1"


def test_version_names_the_environment(project):
    import sys

    r = project.run("--version")
    assert r.rc == 0 and r.out.startswith("dsadapt ") and sys.prefix in r.out and "source " in r.out, r
    doc = project.run("--version", "--json").json()
    assert doc["executable"] == sys.executable and doc["environment"] == sys.prefix
    assert Path(doc["source"]) == REPO_ROOT / "patcher"


def test_shell_completion_prints_the_script_and_completes_pins(project):
    def complete(**env) -> str:
        proc = project.spawn(env=env)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        return out

    assert "_dsadapt_completion()" in complete(_DSADAPT_COMPLETE="bash_source")
    out = complete(_DSADAPT_COMPLETE="bash_complete", COMP_WORDS="dsadapt check vllm@v1", COMP_CWORD="2")
    assert "plain,vllm@v1.0.0" in out and "plain,vllm@v1.1.0" in out, out
    assert "plain,rebase" in complete(_DSADAPT_COMPLETE="bash_complete", COMP_WORDS="dsadapt reb", COMP_CWORD="1")

    def words(line: str) -> list[str]:
        n = len(line.split()) - (0 if line.endswith(" ") else 1)
        return complete(_DSADAPT_COMPLETE="bash_complete", COMP_WORDS=line, COMP_CWORD=str(n)).splitlines()

    assert words("dsadapt tags ") == ["plain,vllm"]  # the engines `tags` takes
    for cmd in ("check", "bisect", "perf", "serve"):  # built-in models, then the shell's directories
        assert words(f"dsadapt {cmd} vllm@v1.0.0 --model ") == ["plain,v3", "plain,v2-lite", "plain,v2", "dir,"], cmd
    assert words("dsadapt check vllm@v1.0.0 --model v2") == ["plain,v2-lite", "plain,v2", "dir,v2"]
    assert words("dsadapt rebase vllm@v1.0.0 --onto ") == ["plain,v1.1.0"]  # the pinned tags newer than the pin


def test_quiet_and_verbose_go_before_or_after_the_command_but_not_together(project, clean_stack):
    r = project.run("-q", "apply", REF1)
    assert r.rc == 0 and "applied 3 patches" in r.out and "…" not in r.err, r
    r = project.run("status", "-q")
    assert r.rc == 0 and r.err == "", r
    r = project.run("status", "-q", "-v")
    assert r.rc == 2 and "pass -q or -v, not both" in r.err, r


def test_tags_with_nothing_newer_say_so(project, clean_stack):
    project.write_stack(project.stack_dir().joinpath("series").read_text() and
                        [p.read_text() for p in sorted(project.stack_dir().glob("*.patch"))], tag="v1.1.0")
    r = project.run("tags", "vllm")
    assert r.rc == 0 and "vllm: nothing newer than v1.1.0" in r.out and "tag  version" not in r.out, r


def test_list_says_when_no_source_can_provide_a_pins_tree(project, clean_stack):
    r = project.run("list", "--json", env={"DSADAPT_SOURCES": "mirror"})
    pins = {p["pin"]: p for p in r.json()["pins"]}
    assert all("no source here for its tree" in b for b in pins[REF1]["run_blockers"].values()), pins[REF1]
    assert not any(pins[REF1]["runs_here"].values())
    assert project.run("apply", REF1).rc == 0  # once the checkout exists, it is here
    pins = {p["pin"]: p for p in project.run("list", "--json", env={"DSADAPT_SOURCES": "mirror"}).json()["pins"]}
    assert "no source here" not in json.dumps(pins[REF1]["run_blockers"])


@pytest.mark.parametrize("lines,cause", [
    (["ERROR: Ignored the following versions that require a different python version: 1.0 Requires-Python >=3.12",
      "ERROR: No matching distribution found for torch==2.13.0+cpu"], "No matching distribution found for torch==2.13.0+cpu"),
    (["ERROR: Cannot install x because these package versions have conflicting dependencies.",
      "The conflict is caused by:", "    The user requested (constraint) torch<=2.14.1",
      "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io"], "Cannot install x because"),
])
def test_pip_causes(lines, cause):
    from patcher.artifacts.venvs import pip_cause

    assert pip_cause(lines)[0].startswith(cause)
