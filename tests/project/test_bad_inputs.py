"""Every bad input gets a one-line answer: one `error:` line and one `hint:` line on stderr, the
documented exit code, no traceback, and nothing changed on disk (and nothing written outside the
project and the run's temporary directory).

A table of cases, one per bad input, grouped by class: pin syntax, arguments, upstream.lock,
series, patch, artifact, mirror, environment variables, dsadapt.toml, file system, concurrent
runs. Cases stopped before dsadapt takes the work-dir lock change nothing at all, not even the
lock file; the few that can only be recognised while a source is read (an unsafe artifact, a
moved mirror tag) may leave the work dir's lock file, empty folders and the source cache, and
nothing else.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest
from conftest import (
    REF1,
    REPO_ROOT,
    TAG1,
    Project,
    artifact_toml,
    clean_stack_edits,
    git,
    lock_text,
    make_patches,
    make_upstream,
)

LONG = "v" + "9" * 10_000


# ---------------------------------------------------------------- the disk, before and after


def disk_state(root: Path, *, deep: bool = False, workdir: Path | None = None) -> dict[str, tuple]:
    """Every path under root: (kind, mode, content hash or link target). With `deep`, the work
    dir's lock file, empty folders and the source cache are left out (see the module doc)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        if deep and workdir is not None and (d == workdir / "cache" or workdir / "cache" in d.parents):
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            p = d / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                if deep and not any(p.rglob("*")):
                    continue
                if not deep:
                    out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                if deep and workdir is not None and p == workdir / "lock" and st.st_size == 0:
                    continue
                out[rel] = ("file", stat.S_IMODE(st.st_mode), hashlib.sha256(p.read_bytes()).hexdigest())
    return out


# ---------------------------------------------------------------- setups


def _lock(p: Project, old: str, new: str) -> None:
    text = (p.root / "upstream.lock").read_text()
    assert old in text, old
    p.write_lock(text.replace(old, new, 1))


def _lock_bytes(p: Project, data: bytes) -> None:
    (p.root / "upstream.lock").write_bytes(data)


def _series(p: Project, data: bytes) -> None:
    (p.stack_dir() / "series").write_bytes(data)


def _patch0(p: Project) -> Path:
    return sorted(p.stack_dir().glob("0001-*.patch"))[0]


def _patch_edit(p: Project, old: str, new: str) -> None:
    f = _patch0(p)
    text = f.read_text()
    assert old in text, old
    f.write_text(text.replace(old, new))


def _evil_patch(p: Project, diff: str) -> None:
    """Replace the stack with one patch whose diff is `diff`."""
    text = ("From: Ada Dev <ada@example.org>\nSubject: [PATCH] evil\n\nBecause.\n\n"
            "Upstream-Status: Pending\nCovered-By: tests/x.py::y\n---\n" + diff)
    p.write_stack([text], names=["0001-evil.patch"])


NEW_BLOB = "0" * 39 + "1"
ZERO = "0" * 40


def _new_file_diff(path_a: str, path_b: str | None = None, mode: str = "100644", body: str = "+x") -> str:
    path_b = path_b or path_a.replace("a/", "b/", 1)
    return (f"diff --git {path_a} {path_b}\nnew file mode {mode}\nindex {ZERO}..{NEW_BLOB}\n--- /dev/null\n"
            f"+++ {path_b}\n@@ -0,0 +1 @@\n{body}\n\\ No newline at end of file\n")


def _wheel(p: Project, members: dict[str, bytes | tuple[int, bytes]], name: str = "vllm-1.0.0-py3-none-any.whl") -> None:
    """A wheel with the given members, pinned in the lock with its true sha256 (so only its content is bad)."""
    path = p.tmp / "artifacts" / name
    with zipfile.ZipFile(path, "w") as z:
        for member, data in {"vllm/__init__.py": b"", **members,
                             "vllm-1.0.0.dist-info/RECORD": b""}.items():
            info = zipfile.ZipInfo(member)
            if isinstance(data, tuple):
                info.external_attr, data = data[0] << 16, data[1]
            z.writestr(info, data)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    p.write_lock(lock_text(p.upstream, artifact=artifact_toml(name, sha)))
    p.env["DSADAPT_SOURCES"] = "pypi"


def _sha_mismatch(p: Project) -> None:
    """A wheel whose bytes are not the ones the lock pins."""
    _wheel(p, {})
    text = (p.root / "upstream.lock").read_text()
    sha = text.split('sha256 = "', 1)[1][:64]
    p.write_lock(text.replace(sha, ("1" if sha[0] != "1" else "2") + sha[1:]))


def _not_a_zip(p: Project) -> None:
    """A pinned 'wheel' that is not a zip archive at all (its sha256 matches the lock)."""
    name = "vllm-1.0.0-py3-none-any.whl"
    path = p.tmp / "artifacts" / name
    path.write_bytes(b"not a zip archive\n" * 100)
    p.write_lock(lock_text(p.upstream, artifact=artifact_toml(name, hashlib.sha256(path.read_bytes()).hexdigest())))
    p.env["DSADAPT_SOURCES"] = "pypi"


def _file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _link(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


def _config(p: Project, text: str | bytes) -> None:
    f = p.root / "dsadapt.toml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())


def _mirror_moved(p: Project) -> None:
    """A mirror whose v1.0.0 is another commit than the lock's, and a lock that records the tree only."""
    mirror = p.tmp / "mirror"
    git(p.tmp, "clone", "-q", "--mirror", p.upstream.url, str(mirror))
    work = p.tmp / "mirror-work"
    git(p.tmp, "clone", "-q", str(mirror), str(work))
    git(work, "checkout", "-q", TAG1)
    (work / "README.md").write_text("moved\n")
    git(work, "commit", "-q", "-am", "moved")
    git(work, "tag", "-f", "-a", TAG1, "-m", "moved")
    git(work, "push", "-q", "-f", "origin", f"refs/tags/{TAG1}")
    _lock(p, f'commit = "{p.upstream.commits[TAG1]}"\n', "")
    p.env.update({"DSADAPT_SOURCES": "mirror", "DSADAPT_MIRRORS": f"vllm={mirror}"})


def _checkpoint(p: Project, damage: str) -> None:
    """A mini checkpoint in DeepSeek-V2-Lite's released layout at {tmp}/ckpt, damaged one way."""
    from checkpoint_support import mini_copy

    d = mini_copy(p.tmp / "ckpt")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    if damage == "no weights":
        index_path.unlink()
        for f in set(index["weight_map"].values()):
            (d / f).unlink()
    elif damage == "missing shard":
        (d / shard).unlink()
    elif damage == "absent tensor":
        index["weight_map"]["model.layers.0.mlp.gate_proj.weight.extra"] = shard
        index_path.write_text(json.dumps(index))
    elif damage == "llama":
        config = json.loads((d / "config.json").read_text())
        config["model_type"] = "llama"
        (d / "config.json").write_text(json.dumps(config))
    elif damage == "config":
        config = json.loads((d / "config.json").read_text())
        config["hidden_size"] = 256   # the weights say 320
        (d / "config.json").write_text(json.dumps(config))


def _with_artifact(p: Project) -> None:
    """vllm@v1.0.0 with a release wheel pinned (so its environment has a lock to make)."""
    p.write_lock(lock_text(p.upstream, artifact=artifact_toml("vllm-1.0.0-py3-none-any.whl", "ab" * 32)))


def _hold_lock(p: Project) -> None:
    """Another process holds the work dir's run lock (as a concurrent dsadapt run would)."""
    p.workdir.mkdir(parents=True, exist_ok=True)
    lock = p.workdir / "lock"
    lock.write_text("")
    holder = subprocess.Popen([sys.executable, "-c",
                               "import fcntl,sys,time; f=open(sys.argv[1],'a'); fcntl.flock(f, fcntl.LOCK_EX); "
                               "print('held', flush=True); time.sleep(60)", str(lock)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    p.env["DSADAPT_LOCK_TIMEOUT"] = "0.3"
    _HOLDERS.append(holder)


_HOLDERS: list[subprocess.Popen] = []


def _raise_in(target: str, exc: BaseException) -> Callable:
    """A setup that makes `target` raise `exc` while the command runs (in-process)."""
    def setup(p: Project):
        return mock.patch(target, side_effect=exc)
    return setup


# ---------------------------------------------------------------- the table


@dataclass
class Case:
    args: tuple[str, ...]
    code: int
    needle: str
    setup: Callable[[Project], object] | None = None
    env: dict[str, str] = field(default_factory=dict)
    deep: bool = False          # recognised while a source is read, or the machine fails (see the module doc)


def C(args, code, needle, setup=None, env=None, deep=False) -> Case:
    return Case(tuple(args.split()) if isinstance(args, str) else tuple(args), code, needle, setup, env or {}, deep)


CASES: dict[str, Case] = {
    # ---- pin syntax (parsed while the arguments are parsed: before anything runs)
    "pin: no @": C("apply vllm", 2, "is not ENGINE@TAG"),
    "pin: no engine": C("apply @v1.0.0", 2, "is not ENGINE@TAG"),
    "pin: no tag": C("refresh vllm@", 2, "is not ENGINE@TAG"),
    "pin: upper-case engine": C("build VLLM@v1.0.0", 2, "not a valid engine name"),
    "pin: tag with ..": C(["apply", "vllm@../x"], 2, "not a valid tag name"),
    "pin: tag with a slash": C(["verify", "vllm@v1/x"], 2, "not a valid tag name"),
    "pin: newline in the tag": C(["apply", "vllm@v1.0.0\nrm -rf /"], 2, "\\n"),
    "pin: 10,000-character tag": C(["apply", "vllm@" + LONG], 2, "longer than"),
    "pin: 10,000-character engine": C(["apply", "v" * 10_000 + "@v1"], 2, "not a valid engine name"),
    "pin: tag ending in .lock": C("apply vllm@v1.0.0.lock", 2, "not a valid tag name"),
    "pin: tag starting with -": C(["apply", "vllm@-rf"], 2, "not a valid tag name"),
    "pin: trailing space": C(["apply", "vllm@v1.0.0 "], 2, "not a valid tag name"),
    "pin: NUL byte": C(["apply", "vllm@v1\x00x"], 2, "not a valid tag name"),
    "pin: non-ASCII tag": C(["apply", "vllm@v1.0.0é"], 2, "not a valid tag name"),
    "pin: escape sequence": C(["skip", "vllm@\x1b[31mred"], 2, "\\x1b"),
    "pin: unknown engine": C("apply sglang@v1.0.0", 2, "unknown engine 'sglang'"),
    "pin: not pinned": C("install vllm@v9.9.9", 2, "vllm@v9.9.9 is not pinned"),
    "pin: not pinned (continue)": C("continue vllm@v9.9.9", 2, "is not pinned"),
    "pin: not pinned (abort)": C("abort vllm@v9.9.9", 2, "is not pinned"),
    "pin: not pinned (check)": C("check vllm@v9.9.9", 2, "is not pinned"),
    "pin: bad pin for pin": C(["pin", "vllm@v1..2"], 2, "not a valid tag name"),
    # ---- arguments
    "args: check without a pin": C("check", 2, "name one ENGINE@TAG or pass --all"),
    "args: check with a pin and --all": C(f"check {REF1} --all", 2, "name one ENGINE@TAG or pass --all"),
    "args: check --dtype float8": C(f"check {REF1} --dtype float8", 2, "float8"),
    "args: check --model missing dir": C(f"check {REF1} --model /nonexistent/model", 2, "neither a built-in model"),
    "args: check --model with broken config.json": C(f"check {REF1} --model {{tmp}}/badmodel", 2, "not valid JSON",
                                                     lambda p: _file(p.tmp / "badmodel" / "config.json", b"{x")),
    "args: check --model with a list as config.json": C(f"check {REF1} --model {{tmp}}/badmodel", 2,
                                                        "not a JSON object",
                                                        lambda p: _file(p.tmp / "badmodel" / "config.json", b"[]")),
    "args: check --model with non-UTF-8 config.json": C(f"check {REF1} --model {{tmp}}/badmodel", 2, "not UTF-8",
                                                        lambda p: _file(p.tmp / "badmodel" / "config.json", b"\xff")),
    "args: --project is a file": C("--project {tmp}/project/upstream.lock status", 2, "is a file"),
    "args: --report-dir is a file": C("--report-dir {tmp}/project/upstream.lock report", 2, "is a file"),
    "args: build unknown variant": C(f"build {REF1} --variant gpu", 2, "has no variant 'gpu'"),
    "args: check unknown variant": C(f"check {REF1} --variant gpu", 2, "has no variant 'gpu'"),
    "args: rebase --onto ../x": C(f"rebase {REF1} --onto ../x", 2, "--onto '../x'"),
    "pin: not pinned (perf)": C("perf vllm@v9.9.9", 2, "is not pinned"),
    "args: perf without a pin": C("perf", 2, "name one ENGINE@TAG (or --rescore REPORT)"),
    "args: perf --concurrency 0": C(f"perf {REF1} --concurrency 0", 2, "is not a positive integer"),
    "args: perf --rounds 1": C(f"perf {REF1} --rounds 1", 2, "at least 2 rounds"),
    "args: perf --requests 0": C(f"perf {REF1} --requests 0", 2, "--requests must be positive"),
    "args: perf --threshold 0": C(f"perf {REF1} --threshold 0", 2, "must be in (0, 1]"),
    "args: perf --time-limit -1": C(f"perf {REF1} --time-limit -1", 2, "must be positive"),
    "args: perf --input-len without --output-len": C(f"perf {REF1} --input-len 8,16,32 --output-len 4,8", 2,
                                                     "--input-len has 3 values"),
    "args: perf --cpus x": C(f"perf {REF1} --cpus x", 2, "is not a CPU list"),
    "pin: not pinned (power)": C("power vllm@v9.9.9", 2, "is not pinned"),
    "args: power --family that is none": C(f"power {REF1} --family attn", 2, "not a module family or comparison point"),
    "args: power --family the model lacks": C(f"power {REF1} --model v2-lite --family attn.q_a_norm", 2,
                                             "has no q_a_layernorm"),
    "args: power --phase that is none": C(f"power {REF1} --phase warmup", 2, "--phase 'warmup': not a phase"),
    "args: power --kind that is none": C(f"power {REF1} --kind shift", 2, "not a perturbation kind"),
    "args: power --eps-min 0": C(f"power {REF1} --eps-min 0", 2, "--eps-min 0: eps must be in (0, 1)"),
    "args: power --eps-min negative": C(["power", REF1, "--eps-min=-0.01"], 2, "eps must be in (0, 1)"),
    "args: power --eps-max 1": C(f"power {REF1} --eps-max 1", 2, "--eps-max 1: eps must be in (0, 1)"),
    "args: power --eps-max nan": C(f"power {REF1} --eps-max nan", 2, "eps must be in (0, 1)"),
    "args: power --eps-min above --eps-max": C(f"power {REF1} --eps-min 0.2 --eps-max 0.1", 2, "is not below"),
    "args: power --resolution 1": C(f"power {REF1} --resolution 1", 2, "--resolution 1: must be above 1"),
    "args: power --require 2": C(f"power {REF1} --require 2", 2, "--require 2: eps must be in (0, 1)"),
    "args: power --eps-max abc": C(f"power {REF1} --eps-max abc", 2, "abc"),
    "args: power --time-limit 0": C(f"power {REF1} --time-limit 0", 2, "--time-limit 0: must be positive"),
    "args: power --grid 0": C(f"power {REF1} --grid 0", 2, "--grid 0: must be 1 to 20"),
    "args: perf --model missing dir": C(f"perf {REF1} --model /nonexistent/model", 2, "neither a built-in model"),
    "args: perf unknown variant": C(f"perf {REF1} --variant gpu", 2, "has no variant 'gpu'"),
    "args: perf --rescore of a non-report": C("perf --rescore {tmp}/project/upstream.lock", 2,
                                              "not a readable perf report"),
    "args: rebase --onto with a space": C(["rebase", REF1, "--onto", "v1 x"], 2, "not a valid tag name"),
    "args: rebase --onto its own tag": C(f"rebase {REF1} --onto {TAG1}", 2, "is the tag vllm@v1.0.0 is already on"),
    "args: rebase --onto another engine": C(f"rebase {REF1} --onto lmdeploy@v1.0.0", 2, "names engine lmdeploy"),
    "args: unknown command": C("frobnicate", 2, "no such command"),
    "args: unknown option": C(f"apply {REF1} --frob", 2, "no such option"),
    "args: missing argument": C("apply", 2, "missing argument"),
    "args: bench --repeat 0": C("bench --repeat 0", 2, "--repeat"),
    "args: tags of an unknown engine": C("tags sglang", 2, "unknown engine 'sglang'"),
    "args: replay from a tag that does not exist": C("replay vllm --from v9.9.9", 2, "vllm has no release tag v9.9.9"),
    "args: replay to a tag that does not exist": C(f"replay vllm --from {TAG1} --to v1.0.9", 2,
                                                   "vllm has no release tag v1.0.9"),
    "args: replay over a range with no release": C("replay vllm --from v1.1.0", 2, "no vllm release after v1.1.0"),
    "args: replay backwards": C(f"replay vllm --from v1.1.0 --to {TAG1}", 2, "no vllm release after v1.1.0 up to"),
    "args: replay of a tag without a stack": C(f"replay vllm --from {TAG1} --stack vllm@v1.1.0", 2,
                                               "vllm@v1.1.0 has no stack"),
    "args: lock --python 3": C(f"lock {REF1} --python 3", 2, "is not a Python version"),
    "args: lock unknown variant": C(f"lock {REF1} --variant gpu", 2, "has no variant 'gpu'"),
    "args: lock a pin without release artifacts": C(f"lock {REF1}", 2, "pins no release artifact"),
    "lock: a lock that cannot be made": C(f"-q lock {REF1} --variant cpu", 6, "uv could not lock vllm-v1.0.0-cpu",
                                          lambda p: _with_artifact(p),
                                          env={"DSADAPT_PYPI_INDEX": "http://127.0.0.1:9/simple",
                                               "DSADAPT_TORCH_INDEX": "http://127.0.0.1:9/cpu"}, deep=True),
    "args: --publish and --report-dir": C("--publish --report-dir /tmp/x list", 2, "not both"),
    "args: no command": C([], 2, "no command given"),
    # ---- empty values: never "the default" or "the current directory"
    "args: perf --concurrency ''": C(["perf", REF1, "--concurrency", ""], 2, "--concurrency is empty"),
    "args: perf --requests ''": C(["perf", REF1, "--requests", ""], 2, "--requests is empty"),
    "args: perf --time-limit nan": C(f"perf {REF1} --time-limit nan", 2, "--time-limit nan must be positive"),
    "args: check --model ''": C(["check", REF1, "--model", ""], 2, "--model is empty"),
    "args: serve --model missing dir": C(f"serve {REF1} --model /nonexistent/model", 2, "neither a built-in model"),
    "args: model make --out ''": C(["model", "make", "--variant", "v3", "--out", ""], 2, "an empty path"),
    "args: --report-dir ''": C(["--report-dir", "", "report"], 2, "an empty path"),
    "args: --project ''": C(["--project", "", "status"], 2, "an empty path"),
    "args: bundle --python ''": C(["bundle", REF1, "--python", ""], 2, "not a Python version"),
    "args: bundle --platform ''": C(["bundle", REF1, "--platform", ""], 2, "not a manylinux platform tag"),
    "args: bundle --exclude ''": C(["bundle", REF1, "--exclude", ""], 2, "not a distribution name"),
    "args: bundle --out ''": C(["bundle", REF1, "--out", ""], 2, "an empty path"),
    "args: bundle --max-size 0": C(f"bundle {REF1} --max-size 0", 2, "--max-size 0: must be above 0"),
    "args: bench --sizes ''": C(["bench", "--sizes", ""], 2, "--sizes is empty"),
    # ---- checked before the work-dir lock (nothing, not even the lock file, is written)
    "args: bundle --platform ../x": C(f"bundle {REF1} --platform ../x", 2, "not a manylinux platform tag"),
    "args: bundle --python 3": C(f"bundle {REF1} --python 3", 2, "not a Python version"),
    "args: bundle --have x==": C(f"bundle {REF1} --have x==", 2, "neither a probe file"),
    "args: install --offline missing": C("install --offline {tmp}/nonexistent", 2, "no such file or folder"),
    "args: install --offline a file that is not a tar": C("install --offline {tmp}/project/upstream.lock", 2,
                                                          "not a readable tar"),
    "args: install --offline a folder that is no bundle": C("install --offline {tmp}/project", 2, "no bundle.json"),
    "pin: pin of an unknown engine": C("pin sglang@v1.0.0", 2, "unknown engine 'sglang'"),
    "args: bench --sizes 1,,2": C("bench --sizes 1,,2", 2, "is not a positive integer"),
    "args: bench --stack-pin not pinned": C("bench --stack-pin vllm@v9.9.9", 2, "is not pinned"),
    "args: bench --stack-pin without a tag": C("bench --stack-pin vllm", 2, "is not ENGINE@TAG"),
    "args: bench --rebase-to ../x": C(f"bench --stack-pin {REF1} --rebase-to ../x", 2, "not a valid tag name"),
    # ---- options that contradict each other
    "args: gc --runs --leftovers-only": C("gc --runs --leftovers-only", 2, "not both"),
    "args: model make --shard-size without --like": C("model make --variant v3 --shard-size 1GB --out {tmp}/m", 2,
                                                      "--shard-size goes with --like"),
    "args: model make --workers without --like": C("model make --workers 2 --out {tmp}/m", 2,
                                                   "--workers goes with --like"),
    # ---- inputs that loop or nest without end
    "args: --project is a symbolic link loop": C("--project {tmp}/loop status", 2, "symbolic link loop",
                                                lambda p: (p.tmp / "loop").symlink_to(p.tmp / "loop")),
    "lock: a symbolic link loop": C("status", 2, "symbolic link loop", lambda p: (
        (p.root / "upstream.lock").unlink(), (p.root / "upstream.lock").symlink_to(p.root / "upstream.lock"))),
    "args: check --model whose config.json nests too deeply": C(
        f"check {REF1} --model {{tmp}}/badmodel", 2, "nested too deeply",
        lambda p: _file(p.tmp / "badmodel" / "config.json", b"[" * 100_000 + b"]" * 100_000)),
    "args: bundle --have probe file nested too deeply": C(f"bundle {REF1} --have {{tmp}}/host.json", 2,
                                                          "nested too deeply",
                                                          lambda p: _file(p.tmp / "host.json", b"[" * 100_000)),
    "config: a directory": C("status", 2, "is a directory", lambda p: (p.root / "dsadapt.toml").mkdir()),
    "config: a symbolic link loop": C("status", 2, "symbolic link loop",
                                      lambda p: (p.root / "dsadapt.toml").symlink_to(p.root / "dsadapt.toml")),
    "config: a symbolic link to nothing": C("status", 2, "a symbolic link to nothing",
                                            lambda p: (p.root / "dsadapt.toml").symlink_to(p.tmp / "gone.toml")),
    "mirror: DSADAPT_MIRRORS without a path": C(f"apply {REF1}", 2, "is not ENGINE=PATH",
                                                env={"DSADAPT_MIRRORS": "vllm="}),
    # ---- upstream.lock
    "lock: non-UTF-8 byte": C(f"apply {REF1}", 2, "upstream.lock:1: not UTF-8 text (byte 0xff at offset",
                              lambda p: _lock_bytes(p, b"\xff" + (p.root / "upstream.lock").read_bytes())),
    "lock: pins = 5": C("status", 2, "'pins' must be a table",
                        lambda p: _lock_bytes(p, b'version = 1\npins = 5\n[engines.vllm]\ngit = "/x"\n')),
    "lock: engines = 5": C("list", 2, "'engines' must be a table", lambda p: _lock_bytes(p, b"version = 1\nengines = 5\n")),
    "lock: version 2": C(f"apply {REF1}", 2, "lock format version", lambda p: _lock(p, "version = 1", "version = 2")),
    "lock: not TOML": C(f"verify {REF1}", 2, "not valid TOML", lambda p: _lock_bytes(p, b"[pins\n")),
    "lock: missing": C("status", 2, "upstream.lock not found", lambda p: (p.root / "upstream.lock").unlink()),
    "lock: a directory": C("status", 2, "is a directory", lambda p: ((p.root / "upstream.lock").unlink(),
                                                                    (p.root / "upstream.lock").mkdir())),
    "lock: commit not hex": C(f"apply {REF1}", 2, "40-hex git id",
                              lambda p: _lock(p, f'commit = "{p.upstream.commits[TAG1]}"', 'commit = "HEAD"')),
    "lock: ext:: git URL": C(f"apply {REF1}", 2, "is not a git URL",
                             lambda p: _lock(p, f'git = "{p.upstream.url}"', 'git = "ext::sh -c touch% /tmp/pwned"')),
    "lock: git URL that is an option": C(f"apply {REF1}", 2, "is not a git URL",
                                         lambda p: _lock(p, f'git = "{p.upstream.url}"', 'git = "--upload-pack=touch /tmp/x"')),
    "lock: pin key with ..": C("list", 2, "not a valid tag name",
                               lambda p: _lock(p, f'[pins."vllm@{TAG1}"]', '[pins."vllm@../x"]')),
    "lock: unknown top-level key": C("list", 2, "unknown top-level key",
                                     lambda p: _lock(p, "version = 1", "version = 1\nhooks = 1")),
    "lock: artifact file escapes": C(f"apply {REF1}", 2, "is not a wheel or sdist name",
                                     lambda p: p.write_lock(lock_text(p.upstream, artifact=artifact_toml(
                                         "../../evil.whl", "a" * 64)))),
    "lock: artifact sha256 not hex": C(f"apply {REF1}", 2, "64 lower-case hex",
                                       lambda p: p.write_lock(lock_text(p.upstream, artifact=artifact_toml(
                                           "vllm-1.0.0-py3-none-any.whl", "Z" * 64)))),
    "lock: serves an unpinned pin": C("list", 2, "which is not pinned",
                                      lambda p: _lock(p, 'version = "1.0.0"\ncommit', 'version = "1.0.0"\nserves = "vllm@v7"\ncommit')),
    # ---- series
    "series: non-UTF-8 byte": C(f"apply {REF1}", 2, "series:2: not UTF-8 text (byte 0xfe at offset",
                                lambda p: _series(p, b"# x\n\xfe.patch\n")),
    "series: names a missing file": C(f"apply {REF1}", 2, "0009-gone.patch, which does not exist",
                                      lambda p: _series(p, b"0009-gone.patch\n")),
    "series: a path": C(f"apply {REF1}", 2, "is not a plain patch file name", lambda p: _series(p, b"../x.patch\n")),
    "series: a hidden name": C(f"apply {REF1}", 2, "is not a plain patch file name", lambda p: _series(p, b".git\n")),
    "series: listed twice": C(f"apply {REF1}", 2, "listed twice", lambda p: _series(
        p, ((p.stack_dir() / "series").read_text().splitlines()[1] + "\n") .encode() * 2)),
    "series: a symbolic link": C(f"apply {REF1}", 2, "is a symbolic link", lambda p: (
        (p.stack_dir() / "series").unlink(), (p.stack_dir() / "series").symlink_to("/etc/passwd"))),
    "series: a directory": C(f"apply {REF1}", 2, "is a directory", lambda p: (
        (p.stack_dir() / "series").unlink(), (p.stack_dir() / "series").mkdir())),
    # ---- patch
    "patch: non-UTF-8 byte": C(f"apply {REF1}", 2, "not UTF-8 text (byte 0xff at offset",
                               lambda p: _patch0(p).write_bytes(_patch0(p).read_bytes().replace(b"Because", b"Bec\xffause"))),
    "patch: CRLF line endings": C(f"apply {REF1}", 2, "CRLF line endings",
                                  lambda p: _patch0(p).write_bytes(_patch0(p).read_bytes().replace(b"\n", b"\r\n"))),
    "patch: .git/hooks path": C(f"apply {REF1}", 2, "inside .git",
                                lambda p: _evil_patch(p, _new_file_diff("a/.git/hooks/post-commit"))),
    "patch: .GIT in any case": C(f"apply {REF1}", 2, "inside .git",
                                 lambda p: _evil_patch(p, _new_file_diff("a/vllm/.GIT/config"))),
    "patch: .git. (NTFS)": C(f"apply {REF1}", 2, "inside .git",
                             lambda p: _evil_patch(p, _new_file_diff("a/.git./hooks/x"))),
    "patch: quoted path with ..": C(f"apply {REF1}", 2, "escapes the source tree", lambda p: _evil_patch(
        p, _new_file_diff('"a/../x y"', '"b/../x y"').replace('+++ "b/../x y"', '+++ "b/../x y"'))),
    "patch: quoted path into .git": C(f"apply {REF1}", 2, "inside .git", lambda p: _evil_patch(
        p, _new_file_diff('"a/.git/hooks/\\303\\251"', '"b/.git/hooks/\\303\\251"'))),
    "patch: quoted path with a tab": C(f"apply {REF1}", 2, "control character", lambda p: _evil_patch(
        p, _new_file_diff('"a/vllm/x\\ty"', '"b/vllm/x\\ty"'))),
    "patch: .. path": C(f"apply {REF1}", 2, "escapes the source tree",
                        lambda p: _evil_patch(p, _new_file_diff("a/vllm/../../x"))),
    "patch: absolute path": C(f"apply {REF1}", 2, "is absolute",
                              lambda p: _evil_patch(p, _new_file_diff("a//etc/cron.d/x"))),
    "patch: backslash path": C(f"apply {REF1}", 2, "backslash",
                               lambda p: _evil_patch(p, _new_file_diff("a/vllm\\..\\..\\x"))),
    "patch: symlink out of the tree": C(f"apply {REF1}", 2, "points outside the tree", lambda p: _evil_patch(
        p, _new_file_diff("a/vllm/link", mode="120000", body="+../../../etc/passwd"))),
    "patch: absolute symlink": C(f"apply {REF1}", 2, "points outside the tree", lambda p: _evil_patch(
        p, _new_file_diff("a/vllm/link", mode="120000", body="+/etc/passwd"))),
    "patch: symlink into .git": C(f"apply {REF1}", 2, "points into .git", lambda p: _evil_patch(
        p, _new_file_diff("a/vllm/link", mode="120000", body="+../.git/hooks"))),
    "patch: smuggled non-git diff": C(f"apply {REF1}", 2, "without its own `diff --git` header", lambda p: _evil_patch(
        p, _new_file_diff("a/vllm/ok.py") + "--- a/../evil\n+++ b/../evil\n@@ -0,0 +1 @@\n+x\n")),
    "patch: gitlink": C(f"apply {REF1}", 2, "submodule", lambda p: _evil_patch(
        p, f"diff --git a/sub b/sub\nnew file mode 160000\nindex {ZERO}..{NEW_BLOB}\n--- /dev/null\n+++ b/sub\n"
           f"@@ -0,0 +1 @@\n+Subproject commit {NEW_BLOB}\n")),
    "patch: malformed hunk header": C(f"apply {REF1}", 2, "malformed hunk header",
                                      lambda p: _evil_patch(p, _new_file_diff("a/vllm/x.py").replace("@@ -0,0 +1 @@", "@@ bad"))),
    "patch: not a mail": C(f"apply {REF1}", 2, "is not a mail header",
                           lambda p: _patch0(p).write_text("just some text\n\n" + "diff --git a/x b/x\n")),
    "patch: no diff": C(f"apply {REF1}", 2, "no diff found",
                        lambda p: _patch0(p).write_text("From: a <a@b>\nSubject: [PATCH] x\n\nbody\n")),
    "patch: a symbolic link": C(f"apply {REF1}", 2, "is a symbolic link", lambda p: _link(_patch0(p), "/etc/shadow")),
    # ---- release artifacts (pinned with their true sha256: the content is what is bad)
    "artifact: .git/hooks member": C(f"apply {REF1}", 2, "inside .git", lambda p: _wheel(
        p, {".git/hooks/post-commit": b"#!/bin/sh\ntouch /tmp/pwned\n"}), deep=True),
    "artifact: .Git/config member": C(f"apply {REF1}", 2, "inside .git", lambda p: _wheel(
        p, {"vllm/.Git/config": b"[core]\n\tfsmonitor = touch /tmp/pwned\n"}), deep=True),
    "artifact: .. member": C(f"apply {REF1}", 2, "escapes the source tree", lambda p: _wheel(
        p, {"vllm/../../evil.py": b"x"}), deep=True),
    "artifact: absolute member": C(f"apply {REF1}", 2, "is absolute", lambda p: _wheel(
        p, {"/tmp/evil.py": b"x"}), deep=True),
    "artifact: backslash member": C(f"apply {REF1}", 2, "backslash", lambda p: _wheel(
        p, {"vllm\\..\\evil.py": b"x"}), deep=True),
    "artifact: symlink member": C(f"apply {REF1}", 2, "is a symbolic link", lambda p: _wheel(
        p, {"vllm/link": (0o120777, b"/etc/passwd")}), deep=True),
    "artifact: sha256 mismatch": C(f"apply {REF1}", 3, "has sha256", _sha_mismatch, deep=True),
    "artifact: not a zip": C(f"apply {REF1}", 2, "not a valid wheel", _not_a_zip, deep=True),
    # ---- mirrors
    "mirror: the tag moved": C(f"apply {REF1}", 3, "tag moved", _mirror_moved, deep=True),
    "mirror: DSADAPT_MIRRORS without =": C(f"apply {REF1}", 2, "is not ENGINE=PATH", env={"DSADAPT_MIRRORS": "vllm"}),
    # ---- environment variables
    "env: DSADAPT_GIT_TIMEOUT=abc": C(f"apply {REF1}", 2, "DSADAPT_GIT_TIMEOUT: 'abc' is not a number",
                                      env={"DSADAPT_GIT_TIMEOUT": "abc"}),
    "env: DSADAPT_LOCK_TIMEOUT=abc": C(f"apply {REF1}", 2, "DSADAPT_LOCK_TIMEOUT: 'abc' is not a number",
                                       env={"DSADAPT_LOCK_TIMEOUT": "abc"}),
    "env: DSADAPT_GIT_TIMEOUT=-1": C("pin vllm@v1.0.0", 2, "DSADAPT_GIT_TIMEOUT", env={"DSADAPT_GIT_TIMEOUT": "-1"}),
    "env: DSADAPT_LOCK_TIMEOUT=nan": C(f"apply {REF1}", 2, "DSADAPT_LOCK_TIMEOUT", env={"DSADAPT_LOCK_TIMEOUT": "nan"}),
    "env: DSADAPT_GIT_TIMEOUT=inf": C("status", 2, "DSADAPT_GIT_TIMEOUT", env={"DSADAPT_GIT_TIMEOUT": "inf"}),
    "env: DSADAPT_GIT_TIMEOUT=0": C(f"verify {REF1}", 2, "DSADAPT_GIT_TIMEOUT", env={"DSADAPT_GIT_TIMEOUT": "0"}),
    "env: DSADAPT_SOURCES=ftp": C(f"apply {REF1}", 2, "unknown source 'ftp'", env={"DSADAPT_SOURCES": "ftp"}),
    "env: DSADAPT_SOURCES=,": C(f"apply {REF1}", 2, "unknown source '(empty)'", env={"DSADAPT_SOURCES": ","}),
    "env: DSADAPT_WORKDIR is a file": C(f"apply {REF1}", 2, "exists and is not a directory",
                                        lambda p: (p.root / "afile").write_text("x"), env={"DSADAPT_WORKDIR": "afile"}),
    "env: DSADAPT_CACHE is a file": C(f"apply {REF1}", 2, "DSADAPT_CACHE", lambda p: (p.root / "afile").write_text("x"),
                                      env={"DSADAPT_CACHE": "afile"}),
    "env: DSADAPT_PROJECT missing": C("status", 2, "DSADAPT_PROJECT", env={"DSADAPT_PROJECT": "/nonexistent/dsadapt"}),
    "env: DSADAPT_REPORTS is a file": C("report", 2, "DSADAPT_REPORTS", lambda p: (p.root / "afile").write_text("x"),
                                        env={"DSADAPT_REPORTS": "afile"}),
    # ---- dsadapt.toml
    "config: sources = 5": C(f"apply {REF1}", 2, "'sources' must be", lambda p: _config(p, "sources = 5\n")),
    "config: git_timeout = 'abc'": C("status", 2, "'git_timeout' must be", lambda p: _config(p, 'git_timeout = "abc"\n')),
    "config: lock_timeout = -3": C(f"apply {REF1}", 2, "'lock_timeout' must be", lambda p: _config(p, "lock_timeout = -3\n")),
    "config: mirrors = 5": C("list", 2, "'mirrors' must be", lambda p: _config(p, "mirrors = 5\n")),
    "config: mirrors.vllm = 5": C("list", 2, "mirrors.vllm", lambda p: _config(p, "[mirrors]\nvllm = 5\n")),
    "config: artifact_dirs = 'x'": C("list", 2, "'artifact_dirs' must be", lambda p: _config(p, 'artifact_dirs = "x"\n')),
    "config: workdir = 5": C("status", 2, "'workdir' must be", lambda p: _config(p, "workdir = 5\n")),
    "config: unknown key": C("status", 2, "unknown key 'hooks'", lambda p: _config(p, "hooks = 1\n")),
    "config: sources.order = ['ftp']": C(f"apply {REF1}", 2, "unknown source 'ftp'",
                                         lambda p: _config(p, '[sources]\norder = ["ftp"]\n')),
    "config: non-UTF-8 byte": C("status", 2, "dsadapt.toml:1: not UTF-8 text", lambda p: _config(p, b"\xff = 1\n")),
    "config: not TOML": C("status", 2, "not valid TOML", lambda p: _config(p, "[x\n")),
    # ---- file system (the machine refuses; typed one-line errors, exit 7)
    "fs: read-only (EROFS)": C(f"apply {REF1}", 7, "read-only file system",
                               _raise_in("patcher.stack.checkout.init_repo", OSError(errno.EROFS, "Read-only file system", "/w/x")), deep=True),
    "fs: permission denied (EACCES)": C(f"apply {REF1}", 7, "permission denied",
                                        _raise_in("patcher.stack.checkout.init_repo", PermissionError(errno.EACCES, "Permission denied", "/w/x")), deep=True),
    "fs: disk full (ENOSPC)": C(f"apply {REF1}", 7, "no space left on the device",
                                _raise_in("patcher.stack.checkout.init_repo", OSError(errno.ENOSPC, "No space left on device", "/w/x")), deep=True),
    "fs: quota (EDQUOT)": C(f"apply {REF1}", 7, "disk quota exceeded",
                            _raise_in("patcher.stack.checkout.init_repo", OSError(errno.EDQUOT, "Disk quota exceeded", "/w/x")), deep=True),
    "fs: file too large (EFBIG)": C(f"apply {REF1}", 7, "file too large",
                                    _raise_in("patcher.stack.checkout.init_repo", OSError(errno.EFBIG, "File too large", "/w/x")), deep=True),
    # ---- checkpoints (--model DIR, model slice): told from config.json and the safetensors headers
    "model: a folder that is not a checkpoint": C(f"check {REF1} --model {{tmp}}/ckpt", 2, "not a checkpoint",
                                                  lambda p: _checkpoint(p, "no weights")),
    "model: a missing shard": C(f"check {REF1} --model {{tmp}}/ckpt", 2, "is missing",
                                lambda p: _checkpoint(p, "missing shard")),
    "model: an index naming a tensor no shard holds": C(f"bisect {REF1} --model {{tmp}}/ckpt", 2,
                                                        "which does not hold it",
                                                        lambda p: _checkpoint(p, "absent tensor")),
    "model: a config the weights do not match": C(f"check {REF1} --model {{tmp}}/ckpt", 2, "config.json says",
                                                  lambda p: _checkpoint(p, "config")),
    "model: a config that is not DeepSeek's": C(f"check {REF1} --model {{tmp}}/ckpt", 2, "model_type 'llama'",
                                                lambda p: _checkpoint(p, "llama")),
    "model: slice --layers larger than the model": C("model slice {tmp}/ckpt --layers 3 --out {tmp}/slice", 2,
                                                     "has 2 decoder layer(s)", lambda p: _checkpoint(p, "none")),
    "model: slice of a damaged checkpoint": C("model slice {tmp}/ckpt --layers 1 --out {tmp}/slice", 2, "is missing",
                                              lambda p: _checkpoint(p, "missing shard")),
    "model: inspect of a folder that is not a checkpoint": C("model inspect {tmp}/ckpt", 2, "not a checkpoint",
                                                             lambda p: _checkpoint(p, "no weights")),
    "model: inspect --dtype fp8 of a checkpoint without block FP8": C(
        "model inspect {tmp}/ckpt --dtype fp8", 2, "needs a block-FP8 checkpoint", lambda p: _checkpoint(p, "none")),
    "model: make --like into a folder that holds files": C(
        "model make --like deepseek-v2-lite --layers 1 --out {tmp}/project", 2, "exists and is not an empty folder"),
    # ---- concurrent runs
    "concurrent: another run holds the work dir": C(f"apply {REF1}", 4, "another dsadapt run holds", _hold_lock),
}


@pytest.fixture(scope="module")
def _template(tmp_path_factory):
    """One fixture upstream and one clean three-patch stack for the whole table (copied per case)."""
    root = tmp_path_factory.mktemp("bad-inputs-template")
    up = make_upstream(root)
    texts = make_patches(up, root / "mk", TAG1, clean_stack_edits())
    return up, texts


@pytest.fixture
def project(tmp_path, _template) -> Project:
    """conftest's project, made from the template: the same files, a fraction of the time."""
    up, texts = _template
    root = tmp_path / "project"
    root.mkdir()
    (tmp_path / "artifacts").mkdir()
    env = {"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(tmp_path / "work"),
           "DSADAPT_CACHE": str(tmp_path / "work" / "cache"), "DSADAPT_SOURCES": "git", "DSADAPT_MIRRORS": "",
           "DSADAPT_ARTIFACTS": str(tmp_path / "artifacts"), "DSADAPT_LOCK_TIMEOUT": "5"}
    proj = Project(root, up, env, tmp_path)
    proj.write_lock(lock_text(up))
    return proj


@pytest.fixture
def clean_stack(project, _template) -> list[str]:
    texts = _template[1]
    project.write_stack(texts)
    return texts


@pytest.fixture(autouse=True)
def _end_lock_holders():
    yield
    while _HOLDERS:
        h = _HOLDERS.pop()
        h.kill()
        h.wait()


def _run_case(project, case: Case, extra_args: tuple[str, ...] = ()):
    tmpdir = project.tmp / "tmp"
    tmpdir.mkdir(exist_ok=True)
    patcher = None
    if case.setup is not None:
        got = case.setup(project)
        patcher = got if hasattr(got, "start") and hasattr(got, "stop") else None
    env = {**case.env, "TMPDIR": str(tmpdir)}
    before = disk_state(project.tmp, deep=case.deep, workdir=project.workdir)
    if patcher is not None:
        patcher.start()
    args = [a.replace("{tmp}", str(project.tmp)) for a in case.args]
    try:
        r = project.run(*extra_args, *args, env=env)
    finally:
        if patcher is not None:
            patcher.stop()
    after = disk_state(project.tmp, deep=case.deep, workdir=project.workdir)
    return r, before, after


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(project, clean_stack, name):
    case = CASES[name]
    r, before, after = _run_case(project, case)
    assert r.rc == case.code, r
    lines = r.err.split("\n")
    assert lines[-1] == "" and len(lines) == 3, r  # exactly: error line, hint line
    assert lines[0].startswith("error: ") and case.needle in lines[0], r
    assert lines[1].startswith("hint: ") and len(lines[1]) > len("hint: ") + 3, r
    assert len(lines[0]) < 600, "echoed input must be cut"
    assert "Traceback" not in r.err and "Traceback" not in r.out
    assert r.out == "" or name == "args: no command", r  # the help, for `dsadapt` alone
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert not changed, f"changed on disk: {sorted(changed)[:10]}"


def test_the_table_covers_every_class():
    classes = {name.split(":")[0] for name in CASES}
    assert classes >= {"pin", "args", "lock", "series", "patch", "artifact", "mirror", "env", "config", "fs",
                       "concurrent"}
    assert len(CASES) >= 60
    assert {c.code for c in CASES.values()} >= {2, 3, 4, 7}


@pytest.mark.parametrize("name", ["lock: pins = 5", "pin: newline in the tag", "env: DSADAPT_GIT_TIMEOUT=abc",
                                  "artifact: .git/hooks member", "fs: disk full (ENOSPC)", "args: unknown option",
                                  "concurrent: another run holds the work dir"])
@pytest.mark.parametrize("where", ["command", "global"])
def test_bad_input_with_json_prints_one_json_error_object(project, clean_stack, name, where):
    case = CASES[name]
    json_arg = ("--json",)
    if where == "command" and case.args and not case.args[0].startswith("-"):
        case = Case(case.args + json_arg, case.code, case.needle, case.setup, case.env, case.deep)
        r, before, after = _run_case(project, case)
    else:
        r, before, after = _run_case(project, case, json_arg)
    assert r.rc == case.code, r
    doc = json.loads(r.out)
    err = doc["error"]
    assert doc["ok"] is False and err["exit_code"] == case.code and case.needle in err["message"], doc
    assert err["hint"] and err["code"] in ("usage", "verification", "stopped", "environment"), doc
    assert "\n" not in err["message"]
    assert len(r.err.strip().split("\n")) == 2 and "Traceback" not in r.err
    assert not {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


# ---------------------------------------------------------------- rendering


def test_brackets_print_verbatim(project, clean_stack):
    """Messages and hints are plain text: `[mirrors]` and `dsadapt[models]` are not markup."""
    project.env["DSADAPT_SOURCES"] = "mirror"
    r = project.run("apply", REF1)
    assert r.rc == 6 and "(DSADAPT_MIRRORS or [mirrors] in dsadapt.toml)" in r.err, r
    from patcher.base.errors import MissingDependency

    with mock.patch("patcher.cli.commands.status.checkout_status",
                    side_effect=MissingDependency("no torch", hint="pip install 'dsadapt[models]'")):
        r = project.run("status")
    assert r.rc == 5 and r.err == "error: no torch\nhint: pip install 'dsadapt[models]'\n", r


def test_unexpected_exception_is_one_line_exit_8_and_traceback_only_with_debug(project, clean_stack):
    with mock.patch("patcher.cli.commands.status.checkout_status", side_effect=RuntimeError("boom\nsecond line")):
        r = project.run("status")
        assert r.rc == 8 and r.err.startswith("error: internal error: RuntimeError: boom\n"), r
        assert "DSADAPT_DEBUG=1" in r.err and "Traceback" not in r.err and len(r.err.strip().split("\n")) == 2
        d = project.run("status", env={"DSADAPT_DEBUG": "1"})
        assert d.rc == 8 and "Traceback (most recent call last)" in d.err and "RuntimeError: boom" in d.err


def test_interrupt_is_exit_130(project, clean_stack):
    with mock.patch("patcher.cli.commands.status.checkout_status", side_effect=KeyboardInterrupt):
        r = project.run("status")
    assert r.rc == 130 and r.err.startswith("error: interrupted\nhint: "), r


def test_git_hook_in_artifact_never_runs(project, clean_stack, tmp_path):
    """The attack the issue measured: a pinned wheel with .git/hooks/post-commit ran it during apply."""
    marker = tmp_path / "pwned"
    _wheel(project, {".git/hooks/post-commit": f"#!/bin/sh\ntouch {marker}\n".encode(),
                     ".git/hooks/post-checkout": f"#!/bin/sh\ntouch {marker}\n".encode()})
    r = project.run("apply", REF1)
    assert r.rc == 2 and "inside .git" in r.err and not marker.exists()
    assert not project.checkout().exists()


# ---------------------------------------------------------------- real file systems (root only)


def _can_mount() -> bool:
    if os.geteuid() != 0:
        return False
    probe = Path("/tmp") / f"dsadapt-mount-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], capture_output=True)
        return ok
    finally:
        probe.rmdir()


needs_mount = pytest.mark.skipif(not _can_mount(), reason="needs root and mount(2) (a tmpfs / read-only bind mount)")


@needs_mount
def test_read_only_work_dir_is_exit_7(project, clean_stack):
    work = project.workdir
    work.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(work)], check=True)
    try:
        before = disk_state(project.root)
        r = project.run("apply", REF1)
        assert r.rc == 7 and r.err.startswith("error: read-only file system: ") and str(work) in r.err, r
        assert len(r.err.strip().split("\n")) == 2 and "Traceback" not in r.err
        assert disk_state(project.root) == before
    finally:
        subprocess.run(["umount", str(work)], check=True)


@needs_mount
def test_disk_full_while_unpacking_a_wheel_is_exit_7(project, clean_stack):
    """ENOSPC while the pinned wheel is unpacked into the checkout: a tiny tmpfs as the work dir."""
    _wheel(project, {"vllm/big.py": os.urandom(400_000)})
    work = project.workdir
    work.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(work)], check=True)
    try:
        r = project.run("apply", REF1)
        # said before the slow step (and before any progress line): one error line, one hint
        lines = r.err.strip().split("\n")
        assert r.rc == 7 and len(lines) == 2 and lines[0].startswith("error: no space left on the device") and \
            "MB are free on the disk of" in lines[0] and lines[1].startswith("hint: "), r
        assert "Traceback" not in r.err and not project.checkout().exists()
    finally:
        subprocess.run(["umount", str(work)], check=True)


def test_cli_entry_point_renders_errors_in_a_subprocess(project, clean_stack):
    """The installed console script, not just main(): one line, no traceback, exit 2."""
    env = {**os.environ, **project.env, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-m", "patcher.cli.main", "apply", "vllm@" + LONG], capture_output=True,
                       text=True, env=env, cwd=project.root)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().split("\n")) == 2, r
    assert "Traceback" not in r.stderr and len(r.stderr) < 600


def test_a_closed_stdout_is_exit_141_without_noise(project, clean_stack):
    """`dsadapt list --json | head -0`: the reader went away; no traceback, no error text."""
    env = {**os.environ, **project.env, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run(f"{sys.executable} -m patcher.cli.main list --json | (exec 0<&-; true); echo rc=${{PIPESTATUS[0]}}",
                       shell=True, executable="/bin/bash", capture_output=True, text=True, env=env, cwd=project.root)
    assert r.stdout.strip() == "rc=141" and r.stderr == "", r
