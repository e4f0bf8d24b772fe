"""One meaning per exit code, for every command: the table in docs/user-guide.md, enforced.

- the documented table is exactly patcher.base.errors.ExitCode (codes and names);
- every typed error in the package maps to a documented code;
- every command (walked from the CLI itself, so a new command must be added here) is run in
  the situations that apply to it, and each exits with the code its situation means: --help 0,
  a bad option 2, a malformed upstream.lock 2, a malformed DSADAPT_* variable 2, and its own
  situations (no reachable source 6 — `check` like `verify` —, nothing in progress 4, ...).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from unittest import mock

import click
import pytest
from conftest import REF1, REPO_ROOT, TAG1, artifact_toml, git, lock_text, make_wheel

import patcher
from patcher.base.errors import DsadaptError, ExitCode
from patcher.cli.main import cli

GUIDE = REPO_ROOT / "docs" / "user-guide.md"


def documented_codes() -> dict[int, str]:
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("## Errors and exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| `([a-z-]+)` \|", section, re.M)}


def test_the_documented_table_is_the_exit_code_enum():
    assert documented_codes() == {int(c): c.label for c in ExitCode}


def test_every_error_class_has_a_documented_code():
    for mod in pkgutil.walk_packages(patcher.__path__, "patcher."):
        if ".runners." in mod.name and not mod.name.endswith("runners"):
            continue  # runner scripts run in engine environments, not in dsadapt
        try:
            module = importlib.import_module(mod.name)
        except ImportError:
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, DsadaptError):
                assert cls.exit_code in set(ExitCode), (cls, cls.exit_code)


# ---------------------------------------------------------------- commands × situations

TRITON = "triton@r26.01"
HEX = "1" * 40


def _command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name in sorted(group.commands):
        cmd = group.commands[name]
        out += _command_paths(cmd, prefix + (name,)) if isinstance(cmd, click.Group) else [prefix + (name,)]
    return out


def _with_triton(p) -> None:
    """A served engine whose upstream cannot be reached here (the `check triton@r26.01` situation)."""
    text = lock_text(p.upstream)
    text = text.replace("[engines.vllm]", f'[engines.triton]\ngit = "{p.tmp / "no-such-upstream"}"\npypi = []\n\n'
                                          "[engines.vllm]")
    text += f'\n[pins."{TRITON}"]\nversion = "26.01"\ncommit = "{HEX}"\ntree = "{HEX}"\nserves = "{REF1}"\n'
    p.write_lock(text)
    d = p.root / "patches" / "triton" / "r26.01"
    d.mkdir(parents=True)
    (d / "series").write_text("")


def _model(p) -> str:
    from checkpoint_support import tiny_model

    return str(tiny_model(p.tmp / "mymodel"))


def _with_wheel(p) -> None:
    wheel, sha = make_wheel(p.upstream, p.tmp / "artifacts")
    p.write_lock(lock_text(p.upstream, artifact=artifact_toml(wheel.name, sha)))


def _applied(p) -> None:
    assert p.run("apply", REF1).rc == 0


#: Per command: (situation, setup, args, env, expected code). Every command of the CLI must be here.
def _hand_edited(p):
    _applied(p)
    f = sorted(p.stack_dir().glob("0001-*.patch"))[0]
    f.write_text(f.read_text().replace("Covered-By:", "Acked-by: A <a@example.org>\nCovered-By:", 1))
    co = p.checkout()
    (co / "vllm" / "util.py").write_text("# new\n")
    git(co, "commit", "-qam", "new work")


SITUATIONS: dict[str, list[tuple]] = {
    "apply": [("ok", None, [REF1], {}, 0),
              ("no reachable source", None, [REF1], {"DSADAPT_SOURCES": "mirror"}, 6),
              ("tag moved", lambda p: p.write_lock(lock_text(p.upstream).replace(p.upstream.commits[TAG1], HEX)),
               [REF1], {}, 3),
              ("dirty checkout", lambda p: (_applied(p), (p.checkout() / "vllm" / "mod.py").write_text("x")),
               [REF1], {}, 4)],
    "continue": [("nothing in progress", _applied, [], {}, 4)],
    "skip": [("nothing in progress", _applied, [REF1], {}, 4)],
    "abort": [("nothing in progress", _applied, [], {}, 4)],
    "refresh": [("no checkout", None, [REF1], {}, 4), ("ok", _applied, [REF1], {}, 0),
                ("patches/ newer than the checkout", _hand_edited, [REF1], {}, 4)],
    "verify": [("ok", None, [REF1], {}, 0),
               ("no reachable source", _with_triton, [TRITON], {}, 6),
               ("a stack with lint problems", lambda p: (p.stack_dir() / "9999-stray.patch").write_text("x"),
                [REF1], {}, 1)],
    "bisect": [("no reachable source", _with_triton, [TRITON, "--model", "MODEL"], {}, 6),
               ("no pin", None, [], {}, 2)],
    "check": [("no reachable source", _with_triton, [TRITON, "--model", "MODEL"], {}, 6),
              ("no pin", None, [], {}, 2),
              ("no runnable pin (--all)", lambda p: p.write_lock(lock_text(p.upstream, pins="")), ["--all"], {}, 6)],
    "build": [("no reachable source", _with_wheel, [REF1], {"DSADAPT_SOURCES": "mirror"}, 6),
              ("unknown variant", None, [REF1, "--variant", "gpu"], {}, 2)],
    "build-all": [("nothing buildable here", None, [], {"DSADAPT_SOURCES": "mirror"}, 0)],
    "install": [("no environment lock for the pin", None, [REF1], {}, 6),
                ("--offline: no such bundle", None, ["--offline", "OUT"], {}, 2),
                ("--offline: not a bundle", None, ["--offline", "."], {}, 2),
                ("no pin and no --offline", None, [], {}, 2)],
    "bundle": [("no environment lock for the pin", None, [REF1], {}, 6),
               ("a bad --have", None, [REF1, "--have", "torch>=2"], {}, 2),
               ("a bad --platform", None, [REF1, "--platform", "win_amd64"], {}, 2),
               ("unknown variant", None, [REF1, "--variant", "gpu"], {}, 2)],
    "list": [("ok", None, [], {}, 0)],
    "lock": [("a pin without release artifacts", None, [REF1], {}, 2),
             ("a lock that cannot be made (no index answers)", _with_wheel, [REF1, "--variant", "cpu"],
              {"DSADAPT_PYPI_INDEX": "http://127.0.0.1:9/simple", "DSADAPT_TORCH_INDEX": "http://127.0.0.1:9/cpu"}, 6),
             ("a bad --python", None, [REF1, "--python", "3"], {}, 2)],
    "replay": [("a tag that does not exist", None, ["vllm", "--from", "v9.9.9"], {}, 2),
               ("a range with no release", None, ["vllm", "--from", "v1.1.0"], {}, 2),
               ("no source lists the releases", lambda p: p.write_lock(lock_text(p.upstream, git_url=str(
                   p.tmp / "no-such-upstream"))), ["vllm", "--from", TAG1],
                {"DSADAPT_PYPI_INDEX": "http://127.0.0.1:9/simple"}, 6)],
    "status": [("ok", None, [], {}, 0)],
    "gc": [("ok", None, [], {}, 0), ("dry run", None, ["--dry-run"], {}, 0)],
    "report": [("ok", None, [], {}, 0)],
    "matrix": [("ok", None, ["--only", "pinned"], {}, 0)],
    "pin": [("ok (local upstream)", None, [f"vllm@{TAG1}"], {}, 0)],
    "tags": [("no reachable source", _with_triton, ["triton"], {}, 6), ("ok", None, ["vllm"], {}, 0)],
    "rebase": [("bad --onto", None, [REF1, "--onto", "../x"], {}, 2),
               ("no reachable source", None, [REF1, "--onto", "v1.1.0"], {"DSADAPT_SOURCES": "mirror"}, 6)],
    "serve": [("served as perf serves it: no environment lock for the pin", None, [REF1], {}, 6),
              ("no serving recipe", _with_triton, ["triton@r24.08"], {}, 2)],
    "perf": [("no pin", None, [], {}, 2), ("bad --threshold", None, [REF1, "--threshold", "2"], {}, 2),
             ("no speed-gate recipe", _with_triton, [TRITON], {}, 6),
             ("no environment lock for the pin", None, [REF1, "--model", "MODEL"], {}, 6)],
    "power": [("no pin", None, [], {}, 2), ("bad --eps-max", None, [REF1, "--eps-max", "2"], {}, 2),
              ("no reachable source", _with_triton, [TRITON, "--model", "MODEL", "--family", "attention"], {}, 6)],
    "bench": [("ok", None, ["--no-alternative", "--repeat", "1", "--sizes", "1,3", "--out", "OUT"], {}, 0)],
    "model make": [("unknown model variant", None, ["--variant", "v9", "--out", "OUT"], {}, 2),
                   ("--like without --layers", None, ["--like", "deepseek-v3", "--out", "OUT"], {}, 2)],
    "model slice": [("not a checkpoint", None, ["/nonexistent/checkpoint", "--layers", "1", "--out", "OUT"], {}, 2)],
    "model inspect": [("not a checkpoint", None, ["/nonexistent/checkpoint"], {}, 2)],
}
#: Commands that never read upstream.lock or the configuration.
NO_PROJECT = {"model make", "model slice"}


def test_every_command_has_its_situations():
    assert {" ".join(p) for p in _command_paths(cli)} == set(SITUATIONS)


def _cases():
    for path in _command_paths(cli):
        name = " ".join(path)
        yield pytest.param(path, "--help", None, ["--help"], {}, 0, id=f"{name}: --help")
        yield pytest.param(path, "unknown option", None, ["--no-such-option"], {}, 2, id=f"{name}: unknown option")
        if name not in NO_PROJECT:
            yield pytest.param(path, "malformed lock", lambda p: p.write_lock("pins = 5\n"), [], {}, 2,
                               id=f"{name}: malformed lock")
            yield pytest.param(path, "malformed env var", None, [], {"DSADAPT_GIT_TIMEOUT": "abc"}, 2,
                               id=f"{name}: DSADAPT_GIT_TIMEOUT=abc")
        for situation, setup, args, env, code in SITUATIONS[name]:
            yield pytest.param(path, situation, setup, args, env, code, id=f"{name}: {situation}")


@pytest.mark.parametrize("path, situation, setup, args, env, code", list(_cases()))
def test_command_situation_exit_code(project, clean_stack, path, situation, setup, args, env, code):
    if setup is not None:
        setup(project)
    args = [project.tmp / "bench.md" if a == "OUT" and path == ("bench",) else
            project.tmp / "model-out" if a == "OUT" else _model(project) if a == "MODEL" else a for a in args]
    if situation in ("malformed lock", "malformed env var") and path in (("check",),):
        args = ["--all"]
    if situation in ("malformed lock", "malformed env var") and path in (("pin",), ("continue",), ("skip",),
                                                                         ("abort",)):
        args = [f"vllm@{TAG1}"]  # without a pin these never read the lock: a broken lock must not block `abort`
    # the gate's reference (minutes of HF transformers) is not what these situations are about
    with mock.patch("patcher.gate.equivalence.run_reference", lambda *a, **k: None):
        r = project.run(*path, *map(str, args), env=env)
    assert r.rc == code, (situation, r)
    assert "Traceback" not in r.err
    if "error: " in r.err:  # an error is rendered once, as the last two lines (reports have none)
        lines = r.err.strip().split("\n")
        assert r.err.count("error: ") == 1 and lines[-2].startswith("error: ") and lines[-1].startswith("hint: "), r
    elif code not in (0, 1):
        assert path in (("verify",), ("check",)), r  # a report of what could not be verified or run
