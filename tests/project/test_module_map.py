"""docs/architecture.md against the code: its module map names every module under patcher/ and no
module that does not exist, in the layers' order; each command is named where its module is; what
the document says of the layers (who prints, which layer starts no process, which imports which,
`__init__.py` without logic) holds."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATCHER = ROOT / "patcher"
DOC = ROOT / "docs" / "architecture.md"
ENTRY = re.compile(r"^( *)([A-Za-z_][A-Za-z0-9_]*(?:\.py|/))(?:\s|$)")


def module_map(text: str) -> dict[str, str]:
    """{path under patcher/ ("gate/plan.py", "engines/vllm/"): its line and the lines that continue
    it} from the first code block that starts with `patcher/`: an entry is a line whose first word
    is a module (`x.py`) or a folder (`x/`), indented two spaces a level under the folder above it."""
    block = text.split("```\npatcher/\n", 1)[1].split("```", 1)[0]
    entries: dict[str, str] = {}
    folders: list[str] = []
    last = None
    for line in block.splitlines():
        m = ENTRY.match(line)
        if not m:
            assert last is not None and line.startswith(" " * 14), f"a map line that names no module: {line!r}"
            entries[last] += " " + line.strip()
            continue
        indent, name = len(m.group(1)), m.group(2)
        assert indent % 2 == 0 and indent // 2 - 1 <= len(folders), f"misaligned: {line!r}"
        folders = folders[: indent // 2 - 1]
        path = "".join(folders) + name
        assert path not in entries, f"named twice: {path}"
        entries[path] = line.strip()
        last = path
        if name.endswith("/"):
            folders.append(name)
    return entries


def _modules() -> set[str]:
    """Every module under patcher/ (a package's __init__.py only at the top: the others hold a
    docstring, which the layer test reads)."""
    return {str(p.relative_to(PATCHER)) for p in PATCHER.rglob("*.py")
            if p.name != "__init__.py" or p.parent == PATCHER}


def _layers() -> list[str]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in doc["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    return [n.strip().removeprefix("patcher.") for layer in contract["layers"] for n in layer.split("|")]


def test_the_module_map_names_every_module_and_no_other():
    entries = module_map(DOC.read_text(encoding="utf-8"))
    named = {p for p in entries if p.endswith(".py")}
    missing, stale = sorted(_modules() - named), sorted(named - _modules())
    assert missing == [], f"modules docs/architecture.md does not name: {missing}"
    assert stale == [], f"modules docs/architecture.md names that do not exist: {stale}"
    for folder in (p for p in entries if p.endswith("/")):
        assert (PATCHER / folder / "__init__.py").is_file(), f"{folder}: not a package"
    for path, line in entries.items():
        assert len(line.split()) >= 2, f"{path}: the map says what it holds"


def test_the_module_map_lists_the_layers_in_the_order_of_the_import_contract():
    entries = module_map(DOC.read_text(encoding="utf-8"))
    tops = [p.rstrip("/") for p in entries if p.endswith("/") and p.count("/") == 1]
    assert tops == _layers()
    prose = DOC.read_text(encoding="utf-8")
    order = re.search(r"over\s+the\s+layer\s+packages\s+\(([^)]*)\)", prose)
    assert order, "docs/architecture.md states the layers' order"
    said = re.split(r"\s+above\s+|\s*\|\s*", " ".join(order.group(1).split(":")[0].split()))
    assert said == _layers(), said


def test_each_command_is_named_on_its_modules_line():
    from patcher.cli.main import COMMANDS

    entries = module_map(DOC.read_text(encoding="utf-8"))
    for name, (module, _attr, _help) in COMMANDS.items():
        line = entries[f"cli/commands/{module}.py"]
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", line.split(None, 1)[1]), \
            f"docs/architecture.md: cli/commands/{module}.py does not name `{name}`"


def _writes_output(tree: ast.Module) -> bool:
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print":
            return True
        if isinstance(n, ast.Attribute) and n.attr in ("stdout", "stderr") and \
                isinstance(n.value, ast.Name) and n.value.id == "sys":
            return True
        if isinstance(n, (ast.Import, ast.ImportFrom)) and any(
                (a.name if isinstance(n, ast.Import) else (n.module or "")).split(".")[0] in ("click", "rich")
                for a in n.names):
            return True
    return False


def _is_script(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


def test_only_the_cli_prints():
    """Outside patcher/cli nothing writes to stdout or stderr but the standalone scripts other
    processes run (a `__main__` block: the runners, the process guard, bootstrap.py, `make
    lock-envs`) and the runner protocol those scripts import."""
    protocol = {"runners/dsadapt_runner.py"}
    loud = []
    for p in PATCHER.rglob("*.py"):
        rel = str(p.relative_to(PATCHER))
        if rel.startswith("cli/") or rel in protocol:
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        if _writes_output(tree) and not _is_script(tree):
            loud.append(rel)
    assert loud == [], f"modules outside patcher/cli that print: {loud}"


def test_the_rules_start_no_process():
    """The gate's judgements are functions over data: no subprocess, no process group, no network."""
    banned = ("subprocess", "multiprocessing", "socket", "urllib", "patcher.base.procs", "patcher.base.gitutil")
    for p in (PATCHER / "rules").glob("*.py"):
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module or ""] if isinstance(n, ast.ImportFrom) else []
            assert not any(x == b or x.startswith(b + ".") for x in names for b in banned), (p.name, names)


def test_no_logic_in_init_modules():
    """A package's __init__.py holds its docstring (and the top one the version), nothing else."""
    for p in PATCHER.rglob("__init__.py"):
        body = ast.parse(p.read_text(encoding="utf-8")).body
        rest = [n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        if p.parent == PATCHER:
            rest = [n for n in rest if not (isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__version__")]
        assert rest == [], f"{p.relative_to(ROOT)}: logic in an __init__.py ({ast.unparse(rest[0])[:60]})"


def test_the_map_reader_catches_a_stale_and_a_missing_entry():
    text = "```\npatcher/\n  gate/         g\n    plan.py     p\n    gone.py     g\n```\n"
    assert set(module_map(text)) == {"gate/", "gate/plan.py", "gate/gone.py"}
    nested = "```\npatcher/\n  stack/   s\n    rebase/   r\n      carry.py  c\n    apply.py  a\n```\n"
    assert set(module_map(nested)) == {"stack/", "stack/rebase/", "stack/rebase/carry.py", "stack/apply.py"}


def _names_in(tree: ast.Module) -> dict[str, set[str]]:
    """{class name: its attributes and methods} and {"": the module's top-level names}."""
    out: dict[str, set[str]] = {"": set()}
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            out[""].add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                out[""].update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
        if isinstance(n, ast.ClassDef):
            out[n.name] = {b.name for b in n.body if isinstance(b, (ast.FunctionDef, ast.ClassDef))} | {
                x.id for b in n.body if isinstance(b, (ast.Assign, ast.AnnAssign))
                for t in (b.targets if isinstance(b, ast.Assign) else [b.target]) for x in ast.walk(t)
                if isinstance(x, ast.Name)}
    return out


def test_every_name_the_document_gives_in_code_exists():
    """`patcher.x.y.Name`, `module.name` (a module of patcher/) and `Class.attribute` (a class of
    patcher/) in backticks, and every patcher/ path the document names, exist."""
    trees = {str(p.relative_to(PATCHER)): _names_in(ast.parse(p.read_text(encoding="utf-8")))
             for p in PATCHER.rglob("*.py")}
    by_stem = {Path(k).stem: v for k, v in trees.items() if not k.endswith("__init__.py")}
    classes: dict[str, set[str]] = {}
    for names in trees.values():
        for cls, attrs in names.items():
            if cls:
                classes.setdefault(cls, set()).update(attrs)
    text = DOC.read_text(encoding="utf-8")
    wrong = []
    for token in set(re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`", text)):
        parts = token.split(".")
        if parts[-1] in ("py", "lock", "toml", "md", "json", "txt"):
            continue
        if parts[0] == "patcher":
            for cut in range(len(parts), 1, -1):
                mod = "/".join(parts[1:cut])
                hit = trees.get(mod + ".py") or trees.get(mod + "/__init__.py")
                if hit is not None:
                    rest = parts[cut:]
                    ok = not rest or rest[0] in hit[""] and (len(rest) == 1 or rest[1] in hit.get(rest[0], set()))
                    break
            else:
                ok = False
        elif parts[0] in by_stem:
            ok = parts[1] in by_stem[parts[0]][""]
        elif parts[0] in classes:
            ok = parts[1] in classes[parts[0]]
        else:
            continue  # not a name of patcher/ (an entry-point group, a JSON key, another package's name)
        if not ok:
            wrong.append(token)
    for path in set(re.findall(r"patcher/[\w/]+(?:\.py)?", text)):
        if not (ROOT / path).exists():
            wrong.append(path)
    assert sorted(wrong) == [], f"docs/architecture.md names what does not exist: {sorted(wrong)}"
