"""A fixture upstream (local git repo, tags v1.0.0 → v1.1.0 …) and a dsadapt project whose
vllm@v1.0.0 stack meets every rebase classification on v1.1.0.

Stack of vllm@v1.0.0 and what v1.1.0 does to it:

  1 a.py   absorbed verbatim (same commit content upstream)          -> upstream (patch-id / reverse-apply)
  2 b.py   absorbed with other whitespace                           -> upstream (reverse-apply -w)
  3 g.py   absorbed with other context (a nearby line changed too)  -> upstream (empty 3-way merge)
  4 c.py   context moved (lines inserted above, a context line edited) -> merged
  5 d.py   the same line changed differently upstream               -> conflict, then changed
  6 e.py   Drop-When: vllm>=1.1.0                                    -> upstream (Drop-When)
  7 f.py   untouched upstream                                       -> clean
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from patcher.base.config import load_config
from patcher.base.gitutil import Git, init_repo
from patcher.formats.lock import EngineDecl, Lock, LockEntry, format_lock
from patcher.formats.stackfiles import write_stack
from patcher.stack.refresh import export_commits

ENGINE = "vllm"


def _lines(*ls: str) -> str:
    return "\n".join(ls) + "\n"


def _func(name: str, body: list[str]) -> list[str]:
    return [f"def {name}(a, b):", *[f"    {l}" if l else "" for l in body], ""]


BASE_FILES = {
    "pkg/a.py": _lines(*_func("a", ["x = 1", "y = 2", "return x + y"])),
    "pkg/b.py": _lines(*_func("b", ["x = 1", "y = 2", "return x"]), *_func("b2", ["pass"])),
    "pkg/g.py": _lines(*_func("g", ["x = 1", "y = 2", "return x"])),
    "pkg/c.py": _lines("import os", "", "", *_func("c", ["total = 0", "for i in range(a):", "    total += i",
                                                          "scale = 1", "return total * scale"])),
    "pkg/d.py": _lines(*_func("d", ["retries = 3", "timeout = 10", "return retries, timeout"])),
    "pkg/e.py": _lines(*_func("e", ["return a or b"])),
    "pkg/f.py": _lines(*_func("f", ["return a", ""]), *_func("f2", ["return b"])),
}

# (path, old line, new line, subject, trailers beyond Upstream-Status/Covered-By)
STACK = [
    ("pkg/a.py", "    y = 2", "    y = 3", "a: use y = 3", ()),
    ("pkg/b.py", "    y = 2", "    y = 2\n    z = foo(a, b)", "b: compute z", ()),
    ("pkg/g.py", "    y = 2", "    y = 2\n    z = compute(a, b)", "g: compute z", ()),
    ("pkg/c.py", "    return total * scale", "    return total * scale * 2", "c: double the total", ()),
    ("pkg/d.py", "    timeout = 10", "    timeout = 30", "d: raise the timeout", ()),
    ("pkg/e.py", "    return a or b", "    return b or a", "e: prefer b", (("Drop-When", "vllm>=1.1.0"),)),
    ("pkg/f.py", "    return b", "    return b + 1", "f: shift f2", ()),
]

# What v1.1.0 changes (path -> (old, new) replacements, applied in order)
UPSTREAM_V11 = {
    "pkg/b.py": [("    y = 2\n", "    y = 2\n    z  =  foo(a,  b)\n")],
    "pkg/g.py": [("    x = 1\n    y = 2\n", "    x = 10\n    y = 2\n    z = compute(a, b)\n")],
    "pkg/c.py": [("import os\n", "import os\nimport sys\nimport re\n\nLIMIT = 5\n"),
                 ("    for i in range(a):\n", "    for i in range(min(a, LIMIT)):\n")],
    "pkg/d.py": [("    timeout = 10\n", "    timeout = 20\n")],
}

RESOLVED_D = _lines(*_func("d", ["retries = 3", "timeout = 30  # ours; upstream moved to 20", "return retries, timeout"]))


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={"GIT_AUTHOR_DATE": "1700000000 +0000", "GIT_COMMITTER_DATE": "1700000000 +0000",
                               "PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(repo)}).stdout.strip()


def _write(repo: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = repo / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _edit(repo: Path, rel: str, old: str, new: str) -> None:
    p = repo / rel
    text = p.read_text()
    assert old in text, (rel, old)
    p.write_text(text.replace(old, new, 1))


def make_upstream(root: Path) -> Path:
    """Upstream repo with tags v1.0.0, v1.1.0, v1.2.0rc1, v1.2.0, and the stack's commits on branch 'ours'."""
    up = root / "upstream"
    init_repo(up)
    _write(up, BASE_FILES)
    git(up, "add", "-A")
    git(up, "commit", "-qm", "release 1.0.0")
    git(up, "tag", "v1.0.0")
    # the stack, as commits on a side branch (exported into the project below)
    git(up, "checkout", "-qb", "ours")
    for path, old, new, subject, extra in STACK:
        _edit(up, path, old, new)
        trailers = [("Upstream-Status", "Pending"), *extra, ("Covered-By", f"tests/test_x.py::test_{path[4]}")]
        msg = f"{subject}\n\nWhy: the fixture needs a patch on {path}.\n\n" + "\n".join(f"{k}: {v}" for k, v in trailers)
        git(up, "commit", "-qam", msg)
    git(up, "checkout", "-q", "main")
    # v1.1.0: patch 1 verbatim (cherry-pick), the rest edited by hand
    first = git(up, "rev-list", "--reverse", "v1.0.0..ours").split()[0]
    git(up, "cherry-pick", first)
    for path, edits in UPSTREAM_V11.items():
        for old, new in edits:
            _edit(up, path, old, new)
        git(up, "commit", "-qam", f"upstream: touch {path}")
    git(up, "tag", "v1.1.0")
    (up / "NEWS").write_text("1.2.0rc1\n")
    git(up, "add", "NEWS")
    git(up, "commit", "-qm", "1.2.0rc1")
    git(up, "tag", "v1.2.0rc1")
    (up / "NEWS").write_text("1.2.0\n")
    git(up, "commit", "-qam", "1.2.0")
    git(up, "tag", "-a", "-m", "1.2.0", "v1.2.0")
    return up


def make_project(root: Path, up: Path, *, stack: bool = True) -> Path:
    """Project with engine vllm (git = the fixture) pinned at v1.0.0 and its stack."""
    proj = root / "project"
    proj.mkdir()
    commit = git(up, "rev-parse", "v1.0.0^{commit}")
    tree = git(up, "rev-parse", "v1.0.0^{tree}")
    lock = Lock(engines={ENGINE: EngineDecl(ENGINE, str(up), ())},
                pins={f"{ENGINE}@v1.0.0": LockEntry(ENGINE, "v1.0.0", "1.0.0", commit=commit, tree=tree)})
    (proj / "upstream.lock").write_text(format_lock(lock))
    if stack:
        patches = export_commits(Git(up), commit, git(up, "rev-parse", "ours"))
        write_stack(proj / "patches" / ENGINE / "v1.0.0", patches)
    return proj


def config(proj: Path, root: Path, sources: str = "git", mirror: Path | None = None):
    env = {"DSADAPT_WORKDIR": str(root / "work"), "DSADAPT_SOURCES": sources}
    if mirror is not None:
        env["DSADAPT_MIRRORS"] = f"{ENGINE}={mirror}"
    return load_config(proj, env=env)


def snapshot(d: Path) -> dict[str, bytes]:
    """Every file under d (relative path -> bytes)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()} if d.exists() else {}


def make_wheels(up: Path, dest: Path, tags=("v1.0.0", "v1.1.0")) -> dict[str, Path]:
    """A wheel per tag holding the upstream tree at that tag (as a release artifact would)."""
    from conftest import make_wheel

    return {tag: make_wheel(up, dest, tag, under=None, version=tag[1:], extra={})[0] for tag in tags}


def make_pypi_project(root: Path, up: Path) -> tuple[Path, Path]:
    """Project whose pins (v1.0.0 and v1.1.0) have only wheel artifacts; returns (project, wheel dir)."""
    from patcher.base.fsutil import sha256_file
    from patcher.formats.lock import Artifact

    wheels = make_wheels(up, root / "wheels")
    proj = root / "project"
    proj.mkdir()
    pins = {}
    for tag, path in wheels.items():
        art = Artifact("vllm", "cuda", path.name, sha256_file(path), source=True, size=path.stat().st_size)
        pins[f"{ENGINE}@{tag}"] = LockEntry(ENGINE, tag, tag[1:], artifacts=(art,))
    lock = Lock(engines={ENGINE: EngineDecl(ENGINE, str(root / "unreachable"), ("vllm",))}, pins=pins)
    (proj / "upstream.lock").write_text(format_lock(lock))
    commit = git(up, "rev-parse", "v1.0.0^{commit}")
    write_stack(proj / "patches" / ENGINE / "v1.0.0", export_commits(Git(up), commit, git(up, "rev-parse", "ours")))
    return proj, root / "wheels"
