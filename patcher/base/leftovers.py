"""What killed runs leave behind, how to recognise it, and how to remove it safely.

Everything dsadapt writes in steps is named so that a later run can tell a dead run's leftover
from a live run's work: temporary files and directories carry the writer's pid
(``.NAME.tmp-PID…``, ``.download-PID-…``). A leftover is removed only when that process is gone.
`dsadapt status` lists leftovers, `dsadapt gc` removes them, and the runs that write in a
directory clean the leftovers they find there.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from patcher.base.dotgit import CheckoutLayout
from patcher.base.fsutil import pid_alive

TMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)(?:-.*)?$")
# fsutil's temporary files before they carried a pid: ".<name>.<8 random chars>" (tempfile.mkstemp)
LEGACY_TMP_RE = re.compile(r"^\.(?P<name>series|upstream\.lock|.+\.patch|.+\.md|.+\.json|state\.json)\.[a-z0-9_]{8}$")
DOWNLOAD_RE = re.compile(r"^\.download-(?P<pid>\d+)-")
SCRATCH_RE = re.compile(r"^(?:index|blob|ref)-(?P<pid>\d+)-")  # a checkout's scratch (CheckoutLayout.scratch)
SCRATCH_DIR_RE = re.compile(r"^verify-(?P<pid>\d+)-")  # verify's own object dir and index (work dir tmp/)
TEMP_WORKTREES = ("dsadapt-verify-", "dsadapt-rebase-")  # the temporary worktrees older versions made
AGE_S = 3600  # a leftover without a pid is only taken when older than this


@dataclass
class Leftover:
    path: str
    kind: str      # checkout tmp | temp file | download | bench dir | op dir | scratch | worktree
    why: str
    bytes: int | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _dead_writer(pattern: re.Pattern, name: str) -> str | None:
    """The pid in `name` (where `pattern` finds one) when that process is gone; else None."""
    m = pattern.match(name)
    return m.group("pid") if m and not pid_alive(int(m.group("pid"))) else None


def _old(p: Path) -> bool:
    try:
        return time.time() - p.lstat().st_mtime > AGE_S
    except OSError:
        return False


def _size(p: Path) -> int:
    try:
        if p.is_symlink() or p.is_file():
            return p.lstat().st_size
        total = 0
        for dirpath, _dirs, files in os.walk(p):
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, f)).st_size
        return total
    except OSError:
        return 0


def disk_bytes(p: Path) -> int:
    """What removing `p` frees: its files' sizes, a file hard-linked elsewhere (an environment
    sharing site-packages with another) not counted."""
    try:
        if p.is_symlink():
            return 0
        if p.is_file():
            st = p.stat()
            return st.st_size if st.st_nlink == 1 else 0
        total = 0
        for dirpath, _dirs, files in os.walk(p):
            for f in files:
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(dirpath, f))
                    if st.st_nlink == 1:
                        total += st.st_size
        return total
    except OSError:
        return 0


def _scan_tmp(d: Path, kind: str, recursive: bool = False) -> list[Leftover]:
    out: list[Leftover] = []
    if not d.is_dir():
        return out
    walker = os.walk(d) if recursive else [(str(d), [], os.listdir(d))]
    for dirpath, dirs, files in walker:
        for name in list(files) + list(dirs if recursive else []):
            p = Path(dirpath) / name
            pid = _dead_writer(TMP_RE, name)
            if pid:
                out.append(Leftover(str(p), kind, f"temporary file of a dead dsadapt run (pid {pid})"))
            elif LEGACY_TMP_RE.match(name) and p.is_file() and _old(p):
                out.append(Leftover(str(p), kind, "temporary file of an interrupted write (older dsadapt)"))
        if recursive:
            dirs[:] = [x for x in dirs if not x.startswith(".git")]
    return out


def find(cfg, *, sizes: bool = False) -> list[Leftover]:
    """Leftovers of dead runs in the project, the work dir and the cache."""
    out: list[Leftover] = []
    for d, recursive in ((cfg.project, False), (cfg.patches_root, True), (cfg.reports_root, True), (cfg.dist_dir, False)):
        out += _scan_tmp(d, "temp file", recursive=recursive)
    out += _in_checkouts(cfg.workdir / "checkouts")
    out += _in_downloads(cfg.cache / "artifacts")
    out += _in_scratch(cfg.workdir / "tmp")
    out += _bench_dirs(cfg.workdir)
    out += _temp_worktrees(Path(os.environ.get("TMPDIR") or "/tmp"))
    if sizes:
        for lo in out:
            lo.bytes = _size(Path(lo.path))
    return out


def _entries(d: Path, pattern: str = "*") -> list[Path]:
    """`d`'s entries matching `pattern`, sorted; none when `d` is not a directory."""
    return sorted(d.glob(pattern)) if d.is_dir() else []


def _in_checkouts(checkouts: Path) -> list[Leftover]:
    """Checkouts a dead run was making, and what dead runs left inside each checkout."""
    out: list[Leftover] = []
    for engine_dir in _entries(checkouts):
        for entry in _entries(engine_dir):
            pid = _dead_writer(TMP_RE, entry.name) if entry.is_dir() else None
            if pid:
                out.append(Leftover(str(entry), "checkout tmp", f"checkout being made by a dead run (pid {pid})"))
            elif not entry.name.startswith(".") and (entry / ".git").is_dir():
                out += _checkout_leftovers(entry)
    return out


def _in_downloads(arts: Path) -> list[Leftover]:
    """Partial downloads and temporary files in the artifact cache."""
    out: list[Leftover] = []
    for entry in _entries(arts):
        pid = _dead_writer(DOWNLOAD_RE, entry.name)
        if pid:
            out.append(Leftover(str(entry), "download", f"partial download of a dead run (pid {pid})"))
        elif entry.is_dir() and entry.name.startswith("tmp") and _old(entry):
            out.append(Leftover(str(entry), "download", "partial download of an interrupted run (older dsadapt)"))
        elif _dead_writer(TMP_RE, entry.name):
            out.append(Leftover(str(entry), "download", "temporary file of a dead run"))
    return out


def _in_scratch(tmp: Path) -> list[Leftover]:
    """verify's scratch objects (the work dir's tmp/) of dead runs."""
    return [Leftover(str(entry), "scratch", f"verify's scratch objects of a dead run (pid {pid})")
            for entry in _entries(tmp) if (pid := _dead_writer(SCRATCH_DIR_RE, entry.name))]


def _bench_dirs(wd: Path) -> list[Leftover]:
    return [Leftover(str(entry), "bench dir", "work dir of an interrupted `dsadapt bench`")
            for entry in _entries(wd, "bench-*") if entry.is_dir() and _old(entry)]


def _temp_worktrees(tmp: Path) -> list[Leftover]:
    return [Leftover(str(entry), "worktree", "temporary worktree of an interrupted run (older dsadapt)")
            for prefix in TEMP_WORKTREES for entry in sorted(tmp.glob(f"{prefix}*"))
            if entry.is_dir() and _old(entry)]


def _checkout_leftovers(co_path: Path) -> list[Leftover]:
    import json

    out: list[Leftover] = []
    lay = CheckoutLayout(co_path)
    if lay.scratch.is_dir():
        for f in sorted(lay.scratch.iterdir()):
            if _dead_writer(SCRATCH_RE, f.name) or (not SCRATCH_RE.match(f.name) and _old(f)):
                out.append(Leftover(str(f), "scratch", "temporary index or object of a dead run"))
    if lay.op_dir.is_dir():
        try:
            st = json.loads(lay.state.read_text(encoding="utf-8"))
            has_op = bool(st.get("op"))
        except (OSError, ValueError, AttributeError):
            has_op = True  # unreadable state: leave the op's files alone (the record is rebuilt from git)
        if not has_op:
            out.append(Leftover(str(lay.op_dir), "op dir", "files of a finished or never-started operation"))
    out += _scan_tmp(lay.own, "temp file")
    wts = lay.worktrees
    if wts.is_dir():
        for w in sorted(wts.iterdir()):
            gd = w / "gitdir"
            try:
                target: Path | None = Path(gd.read_text().strip())
            except OSError:
                target = None
            # only the temporary worktrees older versions made: a user's worktree that is gone keeps its
            # registration (its HEAD may hold commits nothing else reaches; `git worktree prune` is theirs)
            ours = target is not None and target.parent.name.startswith(TEMP_WORKTREES)
            if ours and target is not None and not target.parent.exists() and not (w / "locked").exists():
                out.append(Leftover(str(w), "worktree", "registration of a temporary worktree that is gone"))
    return out


def remove(items: list[Leftover]) -> list[Leftover]:
    """Remove the leftovers; returns those that could not be removed."""
    import shutil

    failed = []
    for lo in items:
        p = Path(lo.path)
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
        except OSError:
            failed.append(lo)
    return failed


def _clean(d: Path, *patterns: re.Pattern) -> None:
    """Remove what dead runs left in `d` under one of `patterns`' names (best effort: a leftover
    that cannot be removed stays for `dsadapt gc` to name)."""
    import shutil

    for entry in _entries(d):
        if any(_dead_writer(p, entry.name) for p in patterns):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink(missing_ok=True)


def clean_checkout_tmps(engine_dir: Path) -> None:
    """Remove checkouts a dead run was making next to the one about to be made."""
    _clean(engine_dir, TMP_RE)


def clean_tmp_files(d: Path) -> None:
    """Remove temporary files of dead runs in one directory (a stack dir about to be written)."""
    for lo in _scan_tmp(d, "temp file"):
        Path(lo.path).unlink(missing_ok=True)


def clean_downloads(d: Path) -> None:
    """Remove partial downloads and temporary files of dead runs in an artifact directory (about to
    receive a download)."""
    _clean(d, DOWNLOAD_RE, TMP_RE)


def clean_scratch(d: Path) -> None:
    """Remove scratch directories of dead runs (`verify-PID-…`) in the work dir's tmp/."""
    _clean(d, SCRATCH_DIR_RE)
