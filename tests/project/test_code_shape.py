"""The shape of the code, measured: no function outside patcher/cli takes more than 10 parameters
(a request object says what travels together), no command function is longer than 60 lines (the
click layer parses and renders; the work is a function below it), and radon rates no function
worse than D (cyclomatic complexity at most 30).

`KNOWN` lists the functions that still exceed a limit, each with the number it has today: a
listed function may only get better, a new one may not join, and a listed one that meets the
limit must leave the list (so the list only shrinks)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHER = ROOT / "patcher"
MAX_PARAMETERS = 10
MAX_COMMAND_LINES = 60
MAX_COMPLEXITY = 30  # radon's D ends at 30; E starts at 31

#: (measure, "path:qualified name") -> today's number (complexity: radon's cyclomatic complexity).
KNOWN: dict[tuple[str, str], int] = {}


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function, methods as Class.name."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return n - 1 if names and names[0] in ("self", "cls") else n


def _is_command(fn) -> bool:
    return any("command" in ast.unparse(d) or "group" in ast.unparse(d) for d in fn.decorator_list)


def _modules():
    for p in sorted(PATCHER.rglob("*.py")):
        yield str(p.relative_to(ROOT)), p


def measure() -> dict[tuple[str, str], int]:
    """Every function over a limit: (measure, "path:name") -> its number."""
    from radon.complexity import cc_visit

    over: dict[tuple[str, str], int] = {}
    for rel, path in _modules():
        text = path.read_text(encoding="utf-8")
        cli = rel.startswith("patcher/cli/")
        for name, fn in _functions(ast.parse(text)):
            if not cli and _parameters(fn) > MAX_PARAMETERS:
                over[("parameters", f"{rel}:{name}")] = _parameters(fn)
            lines = fn.end_lineno - fn.lineno + 1
            if cli and _is_command(fn) and lines > MAX_COMMAND_LINES:
                over[("command lines", f"{rel}:{name}")] = lines
        for block in cc_visit(text):
            items = [block] + [m for m in getattr(block, "methods", [])]
            for b in items:
                name = f"{b.classname}.{b.name}" if getattr(b, "classname", None) else b.name
                if b.complexity > MAX_COMPLEXITY:
                    over[("complexity", f"{rel}:{name}")] = b.complexity
    return over


def test_no_function_is_wider_longer_or_more_complex_than_the_limits():
    pytest.importorskip("radon", reason="radon comes with dsadapt's test extra (pip install -e '.[test]')")
    over = measure()
    new = {k: v for k, v in over.items() if k not in KNOWN}
    worse = {k: (KNOWN[k], v) for k, v in over.items() if k in KNOWN and v > KNOWN[k]}
    fixed = sorted(k for k in KNOWN if k not in over)
    assert new == {}, f"over the limits (parameters <= {MAX_PARAMETERS} outside patcher/cli, command functions " \
                      f"<= {MAX_COMMAND_LINES} lines, complexity <= {MAX_COMPLEXITY}): {new}"
    assert worse == {}, f"listed functions that got worse (was, now): {worse}"
    assert fixed == [], f"within the limits now: take them out of KNOWN: {fixed}"


def test_the_measures_see_a_wide_long_and_complex_function(tmp_path, monkeypatch):
    """The measures themselves: a planted function over each limit is found."""
    pytest.importorskip("radon")
    branches = "\n".join(f"    if x == {i}:\n        x += 1" for i in range(MAX_COMPLEXITY + 1))
    wide = ", ".join(f"a{i}" for i in range(MAX_PARAMETERS + 1))
    fake = tmp_path / "patcher"
    (fake / "cli").mkdir(parents=True)
    (fake / "gate.py").write_text(f"def wide({wide}):\n    pass\n\n\ndef knotty(x):\n{branches}\n    return x\n")
    body = "\n".join("    x = 1" for _ in range(MAX_COMMAND_LINES))
    (fake / "cli" / "cmd.py").write_text(f"@click.command('c')\ndef c_cmd():\n{body}\n")
    import sys

    mod = sys.modules[__name__]
    monkeypatch.setattr(mod, "PATCHER", fake)
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    over = measure()
    assert over[("parameters", "patcher/gate.py:wide")] == MAX_PARAMETERS + 1
    assert over[("complexity", "patcher/gate.py:knotty")] == MAX_COMPLEXITY + 2
    assert over[("command lines", "patcher/cli/cmd.py:c_cmd")] == MAX_COMMAND_LINES + 1
