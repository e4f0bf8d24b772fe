"""Real-looking upstream releases of the toy engine (tests/fixtures/toyengine), for the tests of
`dsadapt replay` and of the upstream workflow's script: a git repository with four release tags,
a release wheel of each, a package index serving them (PEP 691 JSON, on localhost: dsadapt's
DSADAPT_PYPI_INDEX), and a project whose stack is on the oldest release.

What each release does to the stack's one patch (RoPE pairs interleaved, toyds/model.py):

  v0.1.0  the stack's own release
  v0.2.0  an unrelated change in another file               -> clean
  v0.3.0  a helper inserted above the patched function      -> merged (applied at an offset)
  v0.4.0  the patched lines changed another way             -> conflict
  v0.5.0  upstream takes the fix                            -> upstream (dropped)
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from conftest import REPO_ROOT, git, make_wheel
from toy_engine_support import FIXTURE, GIT_ENV

RELEASES = ("v0.1.0", "v0.2.0", "v0.3.0", "v0.4.0", "v0.5.0")
OLD_ROPE = '''    """Rotate `x` [..., seq, dim] by position: the two halves of the head dimension form the pairs."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
'''
FIXED_ROPE = '''    """Rotate `x` [..., seq, dim] by position: adjacent dimensions (2i, 2i+1) form the pairs, as
    DeepSeek's checkpoints expect (its q/k rope weights are laid out interleaved)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
'''
HELPER = '''def rope_dim(config: dict) -> int:
    """The rotary part of a query/key head."""
    return int(config["qk_rope_head_dim"])


'''
#: the gate configuration the stack's patch names (docs/patch-format.md): the toy runs float32 only
GATE = "dsadapt check --model v2-lite --config-style deepseek --dtype float32"


def _commit(repo: Path, message: str, tag: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message, env=GIT_ENV)
    git(repo, "tag", "-a", tag, "-m", message, env=GIT_ENV)


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def make_releases(tmp: Path) -> Path:
    """toyds's upstream with the five release tags (module docstring)."""
    repo = tmp / "toyds"
    shutil.copytree(FIXTURE / "upstream", repo, ignore=shutil.ignore_patterns("__pycache__"))
    git(repo, "init", "-q", "-b", "main")
    init, model = repo / "toyds" / "__init__.py", repo / "toyds" / "model.py"
    _commit(repo, "toyds 0.1.0", "v0.1.0")
    (repo / "NEWS.md").write_text("0.2.0: a changelog\n")
    _edit(init, '"0.1.0"', '"0.2.0"')
    _commit(repo, "toyds 0.2.0", "v0.2.0")
    _edit(model, "def apply_rope(", HELPER + "def apply_rope(")
    _edit(init, '"0.2.0"', '"0.3.0"')
    _commit(repo, "toyds 0.3.0", "v0.3.0")
    _edit(model, "    half = x.shape[-1] // 2\n", "    half = x.size(-1) // 2  # the rotary half\n")
    _edit(init, '"0.3.0"', '"0.4.0"')
    _commit(repo, "toyds 0.4.0", "v0.4.0")
    _edit(model, OLD_ROPE.replace("    half = x.shape[-1] // 2\n", "    half = x.size(-1) // 2  # the rotary half\n"),
          FIXED_ROPE)
    _edit(init, '"0.4.0"', '"0.5.0"')
    _commit(repo, "toyds 0.5.0: RoPE pairs interleaved, as DeepSeek's checkpoints expect", "v0.5.0")
    return repo


def release_wheels(repo: Path, dest: Path) -> dict[str, tuple[Path, str]]:
    """{tag: (wheel, sha256)}: what toyds publishes for each release (pure Python)."""
    return {t: make_wheel(repo, dest, t, under="toyds", dist="toyds", version=t[1:], extra={}) for t in RELEASES}


class Index:
    """A package index on localhost serving the toyds wheels the way PyPI's JSON simple API does."""

    def __init__(self, wheels: dict[str, tuple[Path, str]]):
        files = [{"filename": p.name, "hashes": {"sha256": sha}, "size": p.stat().st_size,
                  "url": f"/files/{p.name}", "yanked": False} for p, sha in wheels.values()]
        page = json.dumps({"name": "toyds", "files": files, "versions": [t[1:] for t in wheels]}).encode()
        blobs = {p.name: p.read_bytes() for p, _ in wheels.values()}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server API
                path = self.path.split("?", 1)[0]
                if path.rstrip("/") == "/simple/toyds":
                    body, kind = page, "application/vnd.pypi.simple.v1+json"
                elif path.startswith("/files/") and path[7:] in blobs:
                    body, kind = blobs[path[7:]], "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def stack_with_gate_config(dest: Path) -> None:
    """The fixture's stack, its patch also naming its gate configuration in Covered-By."""
    shutil.copytree(FIXTURE / "stack", dest)
    patch = next(dest.glob("*.patch"))
    _edit(patch, "\n---\n", f"\nCovered-By: {GATE}\n---\n")


def make_project(tmp: Path, repo: Path, wheels: dict[str, tuple[Path, str]], *, git_repo: bool = False) -> Path:
    """A project of the toy engine alone: toy@v0.1.0 pinned (git commit/tree and its wheel) with the
    stack; the later releases are not pinned. `git_repo`: make it a git repository (a fresh clone
    is one) so the workflow's script dates its reports from the commit."""
    root = tmp / "project"
    (root / "patches" / "toy").mkdir(parents=True)
    commit = git(repo, "rev-parse", "v0.1.0^{commit}")
    tree = git(repo, "rev-parse", "v0.1.0^{tree}")
    wheel, sha = wheels["v0.1.0"]
    (root / "upstream.lock").write_text(
        'version = 1\n\n[engines.toy]\ngit = "' + str(repo) + '"\npypi = [\n    "toyds",\n]\n\n'
        '[pins."toy@v0.1.0"]\nversion = "0.1.0"\ncommit = "' + commit + '"\ntree = "' + tree + '"\n\n'
        '[[pins."toy@v0.1.0".artifacts]]\ndist = "toyds"\nvariant = "cpu"\nfile = "' + wheel.name + '"\n'
        'sha256 = "' + sha + '"\nsize = ' + str(wheel.stat().st_size) + '\nsource = true\n')
    stack_with_gate_config(root / "patches" / "toy" / "v0.1.0")
    if git_repo:
        git(root, "init", "-q", "-b", "main")
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", "project", env=GIT_ENV)
    return root


def toy_env(root: Path, tmp: Path, index: Index, artifacts: Path) -> dict[str, str]:
    """The environment dsadapt runs in for these projects: the toy adapter on the path, the local
    index instead of PyPI, git as the only source, the machine's shared HF reference cache."""
    from shared_envs import shared_config

    shared_reference = shared_config().cache / "reference"
    shared_reference.mkdir(parents=True, exist_ok=True)
    cache = tmp / "work" / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / "reference").exists():
        (cache / "reference").symlink_to(shared_reference)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSADAPT_", "SOURCE_DATE_EPOCH"))}
    env.update({"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(tmp / "work"), "DSADAPT_CACHE": str(cache),
                "DSADAPT_SOURCES": "git", "DSADAPT_MIRRORS": "", "DSADAPT_ARTIFACTS": str(artifacts),
                "DSADAPT_PYPI_INDEX": index.url,
                "PYTHONPATH": os.pathsep.join([str(FIXTURE), str(REPO_ROOT)])})
    return env


def dsadapt_cmd() -> str:
    return f"{sys.executable} -m patcher.cli.main"


def run(env: dict[str, str], *args: str, cwd: Path | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "patcher.cli.main", *args], cwd=cwd or env["DSADAPT_PROJECT"],
                          env=env, capture_output=True, text=True, timeout=timeout)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
