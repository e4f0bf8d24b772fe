"""The shape of the code, checked: the engine boundary, no import cycles through the engines,
nothing outside patcher/engines/ that knows an engine by name, runners that never import
patcher, engines loaded lazily through their entry points."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patcher.base.errors import UsageError
from patcher.engines import registry as engines
from patcher.engines.base import Engine
from patcher.engines.registry import EngineLoadError, engine, engine_names
from patcher.runners.launch import KIT_DIR, REFERENCE_RUNNER

ROOT = Path(__file__).resolve().parents[2]
PATCHER = ROOT / "patcher"


def test_import_contracts_hold():
    """pyproject's [tool.importlinter] contracts (engines never import the orchestration, ...)."""
    pytest.importorskip("importlinter")
    r = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                        "sys.exit(lint_imports_command())"], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "broken" in r.stdout and " 0 broken" in r.stdout


def _cycles() -> list[set[str]]:
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("patcher")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[set[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycle_runs_through_the_engines_or_the_runners():
    cycles = _cycles()
    for comp in cycles:
        assert not any(m.startswith(("patcher.engines", "patcher.runners")) for m in comp), comp
    # op kinds (apply, refresh, rebase) register with patcher.stack.transaction instead of being
    # imported by it, so no import cycle is left anywhere in patcher/
    assert cycles == [], cycles


def _modules_outside_engines():
    for path in sorted(PATCHER.rglob("*.py")):
        if PATCHER / "engines" in path.parents:
            continue
        yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


#: methods whose string arguments decide something about their subject
_STRING_TESTS = {"split", "rsplit", "startswith", "endswith", "removeprefix", "removesuffix", "replace", "partition",
                 "rpartition", "index", "find", "count", "get", "pop", "setdefault"}


def engine_name_uses(tree: ast.AST, names: set[str], kinds: set[str] = frozenset()) -> list[tuple[int, str]]:
    """Every place a module decides something by an engine's name (or a build kind): a string that
    holds an engine name as a word (``"vllm"``, ``"-triton"``, ``"lmdeploy-generate"``,
    ``"vllm@v0.32.0"``) in a comparison, a membership test, a default value, a dict key, a
    subscript, a match pattern, or the argument of a string test (split, startswith...).
    Messages and docstrings may name engines; decisions may not."""
    import re

    word = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(sorted(map(re.escape, names))) + r")(?![A-Za-z0-9])")
    hits: list[tuple[int, str]] = []

    def consts(node: ast.AST | None):
        if node is None:
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for elt in node.elts:
                yield from consts(elt)

    def flag(node: ast.AST | None, why: str) -> None:
        for c in consts(node):
            if word.search(c.value):
                hits.append((c.lineno, f"{why}: {c.value!r}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                flag(side, "compares with")
                for c in consts(side):
                    if c.value in kinds:
                        hits.append((c.lineno, f"compares with build kind {c.value!r}"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in [*node.args.defaults, *node.args.kw_defaults]:
                flag(d, "default")
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "default":
                    flag(kw.value, "default")
            if isinstance(node.func, ast.Attribute) and node.func.attr in _STRING_TESTS:
                for a in node.args:
                    flag(a, f".{node.func.attr}()")
        elif isinstance(node, ast.Dict):
            for k in node.keys:
                flag(k, "dict key")
        elif isinstance(node, ast.Subscript):
            flag(node.slice, "subscript")
        elif isinstance(node, ast.MatchValue):
            flag(node.value, "match")
    return hits


def test_nothing_outside_the_engines_knows_an_engine_by_name_or_build_kind():
    names = set(engine_names()) | {"vllm", "lmdeploy", "triton"}
    kinds = {"overlay", "full", "backend"}
    hits = []
    for path, tree in _modules_outside_engines():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
        hits += [f"{path.relative_to(ROOT)}:{line}: {why}" for line, why in engine_name_uses(tree, names, kinds)]
    assert hits == [], "\n".join(hits)


PLANTED = {
    'if protocol == "lmdeploy-generate":\n    pass\n': "compares with",
    'base = name.split("-unpatched")[0].split("-triton")[0]\n': ".split()",
    'def bench(pin="vllm@v0.32.0"):\n    pass\n': "default",
    'click.option("--stack-pin", default="vllm@v0.32.0")\n': "default",
    'KEEP = {"vllm": ("enforce_eager",)}\n': "dict key",
    'x = settings["lmdeploy_profiler"]\n': "subscript",
    'ok = engine_name in ("vllm", "triton")\n': "compares with",
    'match e:\n    case "triton":\n        pass\n': "match",
    'if name.endswith("-triton"):\n    pass\n': ".endswith()",
}


@pytest.mark.parametrize("source", sorted(PLANTED))
def test_the_engine_name_check_fails_on_a_planted_use(source):
    hits = engine_name_uses(ast.parse(source), {"vllm", "lmdeploy", "triton"})
    assert any(PLANTED[source] in why for _line, why in hits), (source, hits)


def test_the_engine_name_check_lets_messages_name_engines():
    source = ('raise UsageError("name one ENGINE@TAG", hint="e.g. dsadapt check vllm@v0.32.0")\n'
              '"""Docstring naming lmdeploy."""\nlog(f"triton: {x}")\n')
    assert engine_name_uses(ast.parse(source), {"vllm", "lmdeploy", "triton"}) == []


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            out.add("<relative>")
    return out


def test_runner_scripts_never_import_patcher_and_the_protocol_is_stdlib_only():
    scripts = [REFERENCE_RUNNER.script] + [engine(n).runner.script for n in engine_names() if engine(n).runner]
    assert len(scripts) == 4
    for script in scripts:
        imported = _imports(script)
        assert "patcher" not in imported and "<relative>" not in imported, script
        assert "dsadapt_runner" in imported, f"{script} does not use the runner protocol"
    kit = _imports(KIT_DIR / "dsadapt_runner.py")
    assert kit <= set(sys.stdlib_module_names) | {"__future__"}, kit - set(sys.stdlib_module_names)


def test_speed_gate_scripts_never_import_patcher_and_the_guard_is_stdlib_only():
    """perf's engine-side scripts run in the engine's environment (the runner protocol only), and
    the guard is patcher/base/procs.py run as a script (`python -I`): stdlib only."""
    from patcher.engines.serving import STREAM_LOAD
    from patcher.engines.vllm.perf import SCRIPT

    for script in (SCRIPT, STREAM_LOAD):
        imported = _imports(script)
        assert "patcher" not in imported and "<relative>" not in imported, script
        assert "dsadapt_runner" in imported, f"{script} does not use the runner protocol"
    guard = _imports(PATCHER / "base" / "procs.py")
    assert guard <= set(sys.stdlib_module_names) | {"__future__"}, guard - set(sys.stdlib_module_names)
    # the engines' streaming protocols are loaded by stream_load.py in the engine's environment
    protocols = sorted(PATCHER.glob("engines/*/stream_protocol.py"))
    assert protocols, "no engine streaming protocol found"
    for proto in protocols:
        imported = _imports(proto) - {proto.parent.name}  # the engine's own package, where it is installed
        assert imported <= set(sys.stdlib_module_names) | {"__future__"}, (proto, imported)


def test_the_speed_gate_asks_the_protocol_for_recipes():
    """Every engine answers perf_recipe (EngineBase: None); vLLM's and LMDeploy's live in their package."""
    from patcher.formats.lock import load_lock

    lock = load_lock(ROOT / "upstream.lock")
    for name in engine_names():
        ad = engine(name)
        for entry in lock.pins_of(name) if name in lock.engines else []:
            for spec in ad.variants:
                recipe = ad.perf_recipe(entry, spec)
                if recipe is not None:
                    assert type(recipe).__module__ == f"patcher.engines.{name}.perf", type(recipe)


def test_every_engine_is_one_package_with_one_adapter_implementing_the_protocol():
    assert {"vllm", "lmdeploy", "triton"} <= set(engine_names())
    for name in ("vllm", "lmdeploy", "triton"):
        ad = engine(name)
        assert isinstance(ad, Engine) and ad.name == name
        module = type(ad).__module__
        assert module == f"patcher.engines.{name}.adapter", module
        if ad.runner is not None:
            assert ad.runner.script.parent == PATCHER / "engines" / name
        assert (ROOT / ad.docs_page).is_file(), ad.docs_page


def test_cli_help_loads_no_engine():
    """`dsadapt --help` must not pay for the engines: no adapter is imported, no entry point read."""
    code = ("import contextlib, io, sys; import patcher.cli.main as cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = cli.main(['--help'])\n"
            "print(rc, sorted(m for m in sys.modules if m.startswith('patcher.engines.')\n"
            "                 and m != 'patcher.engines.base'))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0 []"  # not even the loader (patcher.engines.registry)


@pytest.mark.parametrize("command", [["list"], ["status"], ["report"]])
def test_commands_that_run_no_engine_load_adapters_without_what_only_other_commands_use(command):
    """Start-up (docs/benchmarks.md): `list`, `status` and `report` on the project's own engines load the
    adapters but neither the gate, the per-module rule (bisect tables), the speed gate's recipes, nor
    any distribution's metadata (no entry-point scan: the project's engines are known by name)."""
    code = ("import contextlib, io, sys; import patcher.cli.main as cli, patcher.engines.registry as e\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = cli.main({['--project', str(ROOT), *command]!r})\n"
            "print(rc, e._ENTRIES is None, sorted(e._LOADED))\n"
            "print(' '.join(sorted(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "DSADAPT_WORKDIR": str(ROOT / ".dsadapt")})
    assert r.returncode == 0, r.stderr
    first, modules = r.stdout.splitlines()[-2:]
    rc, scanned, loaded = first.split(" ", 2)
    assert rc == "0" and scanned == "True", r.stdout
    if command == ["list"]:
        assert loaded == "['lmdeploy', 'triton', 'vllm']", loaded
    elif command == ["report"]:  # the engines' PyPI names come from the lock, as for verify
        assert loaded == "[]", loaded
    mods = set(modules.split())
    unwanted = sorted(m for m in mods if m.startswith(("patcher.gate.", "patcher.rules.modules", "patcher.rules.speed",
                                                       "patcher.engines.serving", "importlib.metadata"))
                      or m.endswith((".perf", ".bisect_table")))
    if command == ["report"]:  # report is the gate's summary and re-judges stored reports by the rules:
        unwanted.remove("patcher.gate.report")  # that module of the gate, and the per-module rule
        unwanted = [m for m in unwanted if m not in ("patcher.rules.modules", "patcher.rules.speed")]
    assert unwanted == [], unwanted


def test_the_loaders_own_engines_are_the_pyproject_entry_points():
    """patcher.engines.registry.OWN lets the project's engines load without a metadata scan; it must say what
    pyproject.toml declares (the entry points other tools see)."""
    import tomllib

    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert doc["project"]["entry-points"]["dsadapt.engines"] == engines.OWN


def test_the_transactions_own_op_kinds_are_the_pyproject_entry_points():
    """patcher.stack.transaction.OWN finds dsadapt's op kinds without reading metadata or
    pyproject.toml at run time; it must say what pyproject.toml declares, and each module it names
    registers that kind when imported."""
    import importlib
    import tomllib

    from patcher.stack import transaction

    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert doc["project"]["entry-points"]["dsadapt.ops"] == transaction.OWN
    for name, module in transaction.OWN.items():
        importlib.import_module(module)
        assert transaction.KINDS[name].name == name


def test_a_deferred_adapter_attribute_is_imported_when_read():
    from patcher.engines.vllm.bisect_table import TABLE

    code = ("import sys; from patcher.engines.registry import engine; ad = engine('vllm')\n"
            "before = 'patcher.engines.vllm.bisect_table' in sys.modules\n"
            "table = ad.bisect_table; mm = ad.module_map\n"
            "print(before, 'patcher.engines.vllm.bisect_table' in sys.modules, type(table).__name__, len(mm) > 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.stdout.split() == ["False", "True", type(TABLE).__name__, "True"], r.stderr
    assert engine("vllm").module_map == TABLE.module_map()


# ---------------------------------------------------------------- the loader


def _dist(root: Path, name: str, entry_points: str) -> None:
    d = root / f"{name}-0.1.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (d / "entry_points.txt").write_text(textwrap.dedent(entry_points))


@pytest.fixture
def fresh_loader(monkeypatch):
    engines.reset()
    yield
    engines.reset()


def test_unknown_engine_says_what_is_known(fresh_loader):
    with pytest.raises(UsageError, match="no adapter for engine 'sglang'") as e:
        engine("sglang")
    assert "vllm" in e.value.hint and "dsadapt.engines" in e.value.hint


def test_broken_plugins_are_one_line_errors_naming_the_package(tmp_path, monkeypatch, fresh_loader):
    (tmp_path / "badengine.py").write_text(
        "import no_such_dependency_here\n")
    (tmp_path / "notengine.py").write_text("class NotAnEngine:\n    name = 'notengine'\n")
    (tmp_path / "wrongname.py").write_text(
        "from patcher.engines.vllm.adapter import VllmEngine\n\nclass Other(VllmEngine):\n    pass\n")
    _dist(tmp_path, "dsadapt_plugins", """\
        [dsadapt.engines]
        badengine = badengine:Engine
        notengine = notengine:NotAnEngine
        wrongname = wrongname:Other
        """)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert {"badengine", "notengine", "wrongname", "vllm"} <= set(engine_names())
    with pytest.raises(EngineLoadError, match="engine 'badengine' .* does not load: ModuleNotFoundError") as e:
        engine("badengine")
    assert "dsadapt_plugins" in e.value.hint
    with pytest.raises(EngineLoadError, match="does not implement the engine protocol"):
        engine("notengine")
    with pytest.raises(EngineLoadError, match="loads the adapter of 'vllm'"):
        engine("wrongname")
    # the built-in engines are unaffected by a broken neighbour
    assert engine("vllm").name == "vllm"


def test_a_broken_plugin_is_the_machines_problem_not_bad_input(tmp_path, monkeypatch, fresh_loader):
    """exit 7 (an installed package failing), not 2: the user's ENGINE@TAG was right."""
    from patcher.base.errors import ExitCode

    (tmp_path / "badengine2.py").write_text("raise RuntimeError('half installed')\n")
    _dist(tmp_path, "dsadapt_plugins2", """\
        [dsadapt.engines]
        badengine2 = badengine2:Engine
        """)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EngineLoadError) as e:
        engine("badengine2")
    assert e.value.exit_code == ExitCode.ENVIRONMENT and "half installed" in e.value.message


# ---------------------------------------------------------------- the layout


def _layers() -> list[str]:
    import tomllib

    doc = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in doc["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    return [name.strip() for layer in contract["layers"] for name in layer.split("|")]


def test_every_module_lives_in_a_layer_of_the_layers_contract():
    """Nothing is left outside the contract: patcher/ holds only its __init__ and layer packages,
    and each layer package says in its docstring what lives there."""
    layers = {name.removeprefix("patcher.") for name in _layers()}
    loose = sorted(p.name for p in PATCHER.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules outside every layer: {loose}"
    packages = {p.name for p in PATCHER.iterdir() if (p / "__init__.py").is_file()}
    assert packages == layers, (packages - layers, layers - packages)
    for name in layers:
        doc = ast.get_docstring(ast.parse((PATCHER / name / "__init__.py").read_text(encoding="utf-8")))
        assert doc and len(doc.split()) >= 20, f"patcher/{name}/__init__.py: say what lives there and what it may import"


def _module_stems(root: Path) -> list[tuple[str, Path]]:
    """Module names that must say their job on their own: everything but one engine's files (each
    engine package mirrors the contract: adapter, runner, perf...) and the command modules (named
    for the commands they hold)."""
    skip = [PATCHER / "cli" / "commands", *(p for p in (PATCHER / "engines").iterdir() if p.is_dir())]
    return sorted((p.stem, p) for p in root.rglob("*.py")
                  if p.stem != "__init__" and not any(d in p.parents for d in skip))


def test_no_two_modules_are_named_alike_but_for_a_suffix():
    """`perf`/`perfrun`, `bisect`/`bisect_run`, `pin`/`pinref`: names that differ by a suffix hide
    which does what."""
    stems = _module_stems(PATCHER)
    clashes = [f"{pa.relative_to(ROOT)} / {pb.relative_to(ROOT)}" for a, pa in stems for b, pb in stems
               if a != b and b.startswith(a)]
    assert clashes == [], clashes
    dupes = {}
    for stem, path in stems:
        dupes.setdefault(stem, []).append(str(path.relative_to(ROOT)))
    assert {k: v for k, v in dupes.items() if len(v) > 1} == {}


def test_tests_live_in_one_folder_per_layer_each_marked():
    """Every test module sits in a folder named after a layer of patcher/ (or `project` / `tools`),
    and every folder's marker is registered, so `pytest -m LAYER` selects exactly that folder."""
    import tomllib

    from conftest import TEST_FOLDERS

    layers = {p.name for p in (ROOT / "patcher").iterdir() if (p / "__init__.py").is_file()}
    assert set(TEST_FOLDERS) - {"project", "tools"} <= layers, set(TEST_FOLDERS) - layers
    registered = {m.split(":")[0] for m in tomllib.loads((ROOT / "pyproject.toml").read_text())
                  ["tool"]["pytest"]["ini_options"]["markers"]}
    assert set(TEST_FOLDERS) <= registered
    stray = [p.name for p in (ROOT / "tests").glob("test_*.py")]
    assert stray == [], f"test modules outside a layer's folder: {stray}"
    for p in (ROOT / "tests").rglob("test_*.py"):
        if "fixtures" in p.relative_to(ROOT / "tests").parts:
            continue
        assert p.relative_to(ROOT / "tests").parts[0] in TEST_FOLDERS, p
