"""Small file-system helpers with no policy in them.

Every write dsadapt makes to a file a user or a later run relies on is *durable*: the bytes go
to a temporary file next to the target, which is fsynced, renamed over the target, and the
directory is fsynced; readers see the old or the new file, never a mix, even after a kill or a
power cut. Temporary names carry the writer's pid (``.NAME.tmp-PID-XXXX``) so a later run can
tell a leftover of a dead process from the work of a live one.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from patcher.base import faults


def tmp_prefix(name: str) -> str:
    """Prefix of the temporary files dsadapt writes next to `name` (see leftovers.py)."""
    return f".{name}.tmp-{os.getpid()}-"


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Durably replace `path` with `text` (UTF-8)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix(path.name), dir=path.parent)
    try:
        try:  # the file keeps its mode (mkstemp makes 0600); a new one gets the umask's default
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        faults.point("write", path.name)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    faults.point("written", path.name)
    fsync_dir(path.parent)


def remove_file(path: Path) -> bool:
    """Durably remove a file; True if it existed."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return False
    faults.point("unlink", path.name)
    path.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def remove_tree(path: Path) -> bool:
    """Remove a directory tree (first renamed aside, so a half-removed tree never looks whole)."""
    path = Path(path)
    if not path.exists():
        return False
    faults.point("unlink", path.name)
    if path.is_dir() and not path.is_symlink():
        import shutil

        aside = path.with_name(f".{path.name}.tmp-{os.getpid()}-rm")
        try:
            os.replace(path, aside)
        except OSError:
            aside = path
        shutil.rmtree(aside, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return True


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: sha256 digests this process computed, by file identity (see `sha256_file`).
_DIGESTS: dict[tuple[int, int, int, int, int], str] = {}


def file_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What tells a file's content apart within one run: device, inode, size, mtime and ctime (ns).
    Any write, truncation, rename over it or chmod changes one of them; artifacts are replaced by
    rename (a new inode), never rewritten in place."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The file's sha256, hashed once per process: a later call for the same file, unchanged
    (`file_identity`), gets the digest already computed (a warm build verifies the 132 MB release
    wheel once, not at every step that needs its hash)."""
    with open(path, "rb") as f:
        key = file_identity(os.fstat(f.fileno()))
        known = _DIGESTS.get(key)
        if known is not None:
            return known
        import hashlib

        h = hashlib.sha256()
        while block := f.read(chunk):
            h.update(block)
    digest = h.hexdigest()
    _DIGESTS[key] = digest
    return digest


def forget_digests() -> None:
    """Start over as a new run would (benchmarks that time several runs in one process)."""
    _DIGESTS.clear()


def remember_sha256(path: Path, digest: str) -> None:
    """Record the digest of a file this process wrote and hashed while writing it (a build's
    output), so that nothing reads it back to hash it again."""
    _DIGESTS[file_identity(os.stat(path))] = digest


def same_bytes(a: Path, b: Path, chunk: int = 1 << 20) -> bool:
    """Whether two files hold the same bytes (sizes first; then a comparison, cheaper than hashing)."""
    if os.stat(a).st_size != os.stat(b).st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


def git_blob_id(data: bytes) -> str:
    """The id git gives a blob with these bytes (sha1 of 'blob <len>\\0' + data)."""
    import hashlib

    h = hashlib.sha1()
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def link_tree(src: Path, dst: Path, *, link_under: tuple[str, ...] = ("lib",)) -> tuple[int, int]:
    """Copy the directory `src` to `dst` with the files under `link_under` (relative folders)
    hard-linked instead of copied (one copy on disk for both); every other file is copied, so
    writing one in place never changes the other tree. Symlinks stay symlinks. Hard links are
    safe for trees whose files are only ever replaced, never rewritten in place (pip installs and
    uninstalls by unlink and rename). Falls back to copying where the file system refuses links.
    Returns (files linked, bytes copied)."""
    import shutil

    linked = copied = 0
    roots = tuple(src / p for p in link_under)

    def copy(s: str, d: str) -> str:
        nonlocal linked, copied
        if any(Path(s).is_relative_to(r) for r in roots):
            try:
                os.link(s, d)
                linked += 1
                return d
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                    raise
        shutil.copy2(s, d)
        copied += os.path.getsize(d)
        return d

    shutil.copytree(src, dst, symlinks=True, copy_function=copy)
    return linked, copied
