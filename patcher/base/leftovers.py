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


def _pid_dead(m: re.Match | None) -> bool:
    return bool(m) and not pid_alive(int(m.group("pid")))  # type: ignore[union-attr]


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
            m = TMP_RE.match(name)
            if m and not pid_alive(int(m.group("pid"))):
                out.append(Leftover(str(p), kind, f"temporary file of a dead dsadapt run (pid {m.group('pid')})"))
            elif LEGACY_TMP_RE.match(name) and p.is_file() and _old(p):
                out.append(Leftover(str(p), kind, "temporary file of an interrupted write (older dsadapt)"))
        if recursive:
            dirs[:] = [x for x in dirs if not x.startswith(".git")]
    return out


def find(cfg, *, sizes: bool = False) -> list[Leftover]:
    """Leftovers of dead runs in the project, the work dir and the cache."""
    out: list[Leftover] = []
    project = cfg.project
    out += _scan_tmp(project, "temp file")
    out += _scan_tmp(cfg.patches_root, "temp file", recursive=True)
    out += _scan_tmp(cfg.reports_root, "temp file", recursive=True)
    out += _scan_tmp(cfg.dist_dir, "temp file")
    wd = cfg.workdir
    checkouts = wd / "checkouts"
    if checkouts.is_dir():
        for engine_dir in sorted(checkouts.iterdir()):
            if not engine_dir.is_dir():
                continue
            for entry in sorted(engine_dir.iterdir()):
                m = TMP_RE.match(entry.name)
                if m and entry.is_dir() and not pid_alive(int(m.group("pid"))):
                    out.append(Leftover(str(entry), "checkout tmp",
                                        f"checkout being made by a dead run (pid {m.group('pid')})"))
                elif not entry.name.startswith(".") and (entry / ".git").is_dir():
                    out += _checkout_leftovers(entry)
    arts = cfg.cache / "artifacts"
    if arts.is_dir():
        for entry in sorted(arts.iterdir()):
            m = DOWNLOAD_RE.match(entry.name)
            if m and not pid_alive(int(m.group("pid"))):
                out.append(Leftover(str(entry), "download", f"partial download of a dead run (pid {m.group('pid')})"))
            elif entry.is_dir() and entry.name.startswith("tmp") and _old(entry):
                out.append(Leftover(str(entry), "download", "partial download of an interrupted run (older dsadapt)"))
            elif TMP_RE.match(entry.name) and _pid_dead(TMP_RE.match(entry.name)):
                out.append(Leftover(str(entry), "download", "temporary file of a dead run"))
    if (wd / "tmp").is_dir():
        for entry in sorted((wd / "tmp").iterdir()):
            m = SCRATCH_DIR_RE.match(entry.name)
            if m and not pid_alive(int(m.group("pid"))):
                out.append(Leftover(str(entry), "scratch", f"verify's scratch objects of a dead run (pid {m.group('pid')})"))
    if wd.is_dir():
        for entry in sorted(wd.glob("bench-*")):
            if entry.is_dir() and _old(entry):
                out.append(Leftover(str(entry), "bench dir", "work dir of an interrupted `dsadapt bench`"))
    tmp = Path(os.environ.get("TMPDIR") or "/tmp")
    for pat in (f"{p}*" for p in TEMP_WORKTREES):
        for entry in sorted(tmp.glob(pat)):
            if entry.is_dir() and _old(entry):
                out.append(Leftover(str(entry), "worktree", "temporary worktree of an interrupted run (older dsadapt)"))
    if sizes:
        for lo in out:
            lo.bytes = _size(Path(lo.path))
    return out


def _checkout_leftovers(co_path: Path) -> list[Leftover]:
    import json

    out: list[Leftover] = []
    lay = CheckoutLayout(co_path)
    if lay.scratch.is_dir():
        for f in sorted(lay.scratch.iterdir()):
            m = SCRATCH_RE.match(f.name)
            if (m and not pid_alive(int(m.group("pid")))) or (not m and _old(f)):
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


def clean_checkout_tmps(engine_dir: Path) -> None:
    """Remove checkouts a dead run was making next to the one about to be made."""
    import shutil

    if not engine_dir.is_dir():
        return
    for entry in engine_dir.iterdir():
        m = TMP_RE.match(entry.name)
        if m and not pid_alive(int(m.group("pid"))):
            shutil.rmtree(entry, ignore_errors=True)


def clean_tmp_files(d: Path) -> None:
    """Remove temporary files of dead runs in one directory (a stack dir about to be written)."""
    if not d.is_dir():
        return
    for lo in _scan_tmp(d, "temp file"):
        Path(lo.path).unlink(missing_ok=True)


def clean_downloads(d: Path) -> None:
    """Remove partial downloads and temporary files of dead runs in an artifact directory (about to
    receive a download)."""
    import shutil

    if not d.is_dir():
        return
    for entry in d.iterdir():
        dead = _pid_dead(DOWNLOAD_RE.match(entry.name)) or _pid_dead(TMP_RE.match(entry.name))
        if dead:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def clean_scratch(d: Path) -> None:
    """Remove scratch directories of dead runs (`verify-PID-…`) in the work dir's tmp/."""
    import shutil

    if not d.is_dir():
        return
    for entry in d.iterdir():
        if _pid_dead(SCRATCH_DIR_RE.match(entry.name)):
            shutil.rmtree(entry, ignore_errors=True)
