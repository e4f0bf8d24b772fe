"""dsadapt build: a patched engine as an installable artifact.

The engine decides how its stack is built (`Engine.build`); this module holds the builds
engines share and lends them through `BuildHost` (the `engines.base.BuildServices` of a run):

- overlay: the pinned release wheel with the stack's files swapped in (verified by blob id
  against the patches' pre-images), RECORD rewritten, version `X+ds.<stack hash>`;
  byte-reproducible.
- full: the upstream's own build (`pip wheel --no-deps`) when a patch touches compiled
  code; refused up front when the toolchain or the source tree is missing.

Engines built differently (Triton's vLLM backend: a directory, nothing to compile) implement
`build` themselves with the same services.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from patcher.base import leftovers
from patcher.base.config import Config
from patcher.base.errors import (
    BuildError,
    EngineUnavailable,
    LockError,
    RefusedToClobber,
    ToolchainMissing,
    UnsafeArtifact,
    VerificationError,
)
from patcher.base.fsutil import fsync_dir, git_blob_id, remember_sha256, same_bytes, sha256_file
from patcher.engines.base import BuildKind, BuildResult, Engine, Progress, Tree, VariantSpec
from patcher.engines.registry import engine
from patcher.formats import sourcetree
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import Stack, expected_preimages, load_stack
from patcher.formats.wheel import (
    format_record,
    members_match,
    new_member,
    parse_record,
    read_raw_members,
    record_hash,
    write_members,
)
from patcher.stack.apply import apply_stack, checkout_tree
from patcher.stack.checkout import Checkout
from patcher.upstream.sources import check_members, fetch_artifact

__all__ = ["BuildHost", "BuildResult", "build_pin", "buildable_here", "full_build", "overlay_build",
           "overlay_version", "unpatched_build", "unpatched_version"]


def overlay_version(version: str, stack_hash: str, variant: str | None = None) -> str:
    """0.32.0 -> 0.32.0+ds.<8 hex>; an existing local label is kept in front (0.1+cpu -> 0.1+cpu.ds.<..>).

    A variant that overlays another variant's wheel (lmdeploy's `pytorch` on the `cuda` wheel) is
    named in the label too (0.18.0+ds.<8 hex>.pytorch), so no two variants share a file name."""
    label = f"ds.{stack_hash[:8]}" + (f".{variant}" if variant else "")
    return f"{version}.{label}" if "+" in version else f"{version}+{label}"


def _wheel_parts(filename: str) -> tuple[str, str, str]:
    """(escaped name, version, tag part) of a wheel file name."""
    stem = filename[:-4]
    parts = stem.split("-")
    if len(parts) < 5:
        raise BuildError(f"{filename}: not a wheel file name", hint="the lock's artifact must be a .whl")
    return parts[0], parts[1], "-".join(parts[2:])


def patched_files(co: Checkout, stack: Stack) -> dict[str, bytes | None]:
    """Final content of every path the stack touches, read from the applied branch (None = deleted).
    A path the stack leaves as a symbolic link is refused: a wheel ships files, and a link's bytes
    are only its target's name."""
    head = f"refs/heads/{co.branch}"
    paths = list(stack.touched_paths())
    found: dict[str, str] = {}
    if paths:  # one ls-tree for every path (mode and blob), one cat-file for their bytes
        for rec in co.git.run("ls-tree", "-z", head, "--", *paths).out.split("\0"):
            meta, _, path = rec.partition("\t")
            if not path:
                continue
            mode, kind, oid = meta.split()
            if mode == "120000":
                raise UnsafeArtifact(f"{co.ref}: the stack leaves {path} as a symbolic link; a built wheel ships files",
                                     hint="make the patch change the file itself, not turn it into a link")
            if kind == "blob":
                found[path] = oid
    blobs = co.git.cat_blobs(sorted(set(found.values())))
    return {p: (blobs.get(found[p]) if p in found else None) for p in paths}


def _shipped(ad: Engine, path: str) -> bool:
    return path.split("/", 1)[0] in ad.packages


def overlay_build(cfg: Config, lock: Lock, entry: LockEntry, ad: Engine, spec: VariantSpec, stack: Stack,
                  out_dir: Path, progress=None) -> BuildResult:
    t0 = time.monotonic()
    art = entry.artifact(spec.artifact_variant, wheel=True)
    if art is None:
        raise LockError(f"{entry} has no pinned wheel for variant '{spec.name}'",
                         hint=f"pinned variants: {', '.join(entry.variants) or 'none'}; add one with `dsadapt pin`")
    apply_stack(cfg, lock, entry.ref, progress=progress)  # no-op when the checkout already holds the stack
    co = Checkout(cfg, entry.ref)
    files = patched_files(co, stack)
    wheel_path = fetch_artifact(cfg, entry, art, progress)
    if progress:
        progress(f"overlaying {len(files)} file(s) onto {art.file}")
    members, z = read_raw_members(wheel_path)
    try:
        check_members(wheel_path, z.infolist())  # no link, device or path out of the tree goes into a build
        by_name = {m.name: m for m in members}
        expected, _post, chain = expected_preimages(stack.patches)
        if chain:
            raise VerificationError(f"{entry}: stack is inconsistent: {chain[0]}", hint="refresh the stack")
        not_shipped = sorted(p for p in files if not _shipped(ad, p))
        for path, (want, idx) in sorted(expected.items()):
            if path in not_shipped:
                continue
            got = git_blob_id(z.read(path)) if path in by_name else None
            if got != want:
                name = stack.entries[idx - 1].name
                raise VerificationError(
                    f"{art.file}: {path} is {got[:12] if got else 'absent'} in the wheel, {name} expects "
                    f"{want[:12] if want else 'absent'}",
                    hint="the wheel is not byte-identical to the tree the stack was made on; re-pin or rebase")
        new_version = overlay_version(_wheel_parts(art.file)[1], stack.hash, spec.name if spec.wheel_variant else None)
        provenance = {"pin": str(entry.ref), "variant": spec.name, "base_artifact": art.file,
                      "base_sha256": art.sha256, "stack_hash": stack.hash, "patches": [e.name for e in stack.entries]}
        final, replaced, added, removed, left_out = _rewrite_wheel(z, members, art, spec, files, not_shipped,
                                                                   new_version, provenance, out_dir)
    finally:
        z.close()
    if progress is not None and hasattr(progress, "end"):
        progress.end()  # the overlay is done: no "still overlaying" while the caller goes on
    return BuildResult(
        ref=str(entry.ref), variant=spec.name, kind="overlay", artifact=str(final), sha256=sha256_file(final),
        size=final.stat().st_size, seconds=round(time.monotonic() - t0, 2), stack_hash=stack.hash,
        base_artifact=art.file, base_sha256=art.sha256, version=new_version, replaced=replaced, added=added,
        removed=removed, left_out=left_out, not_shipped=not_shipped,
        how=f"overlay of {len(replaced) + len(added) + len(removed)} file(s) on {art.file} (sha256 verified; "
            f"pre-images verified by blob id), stack {stack.short_hash}")


def unpatched_version(version: str, variant: str | None = None) -> str:
    """0.18.0 -> 0.18.0+unpatched[.variant]: the release's files, a variant's leave-out dropped."""
    label = "unpatched" + (f".{variant}" if variant else "")
    return f"{version}.{label}" if "+" in version else f"{version}+{label}"


def unpatched_build(cfg: Config, entry: LockEntry, spec: VariantSpec, out_dir: Path, progress=None) -> BuildResult:
    """The unpatched side of a variant: the pinned release wheel itself, or, for a variant that
    leaves members out (LMDeploy's `pytorch`: no TurboMind), the release wheel with exactly that
    leave-out and nothing else changed, named ``X+unpatched.<variant>`` so it is never mistaken for
    the release or for a patched build. Needs no checkout (no stack is applied)."""
    t0 = time.monotonic()
    art = entry.artifact(spec.artifact_variant, wheel=True)
    if art is None:
        raise LockError(f"{entry} has no pinned wheel for variant '{spec.name}'",
                        hint=f"pinned variants: {', '.join(entry.variants) or 'none'}; add one with `dsadapt pin`")
    wheel_path = fetch_artifact(cfg, entry, art, progress)
    if not spec.leave_out:
        return BuildResult(str(entry.ref), spec.name, "release", str(wheel_path), art.sha256,
                           wheel_path.stat().st_size, round(time.monotonic() - t0, 2), "", base_artifact=art.file,
                           base_sha256=art.sha256, version=entry.version, how=f"the pinned release wheel {art.file}")
    if progress:
        progress(f"dropping the {spec.name} variant's leave-out from {art.file} (unpatched)")
    members, z = read_raw_members(wheel_path)
    try:
        check_members(wheel_path, z.infolist())
        new_version = unpatched_version(_wheel_parts(art.file)[1], spec.name)
        provenance = {"pin": str(entry.ref), "variant": spec.name, "base_artifact": art.file,
                      "base_sha256": art.sha256, "unpatched": True, "stack_hash": None, "patches": []}
        final, _, _, _, left_out = _rewrite_wheel(z, members, art, spec, {}, [], new_version, provenance, out_dir)
    finally:
        z.close()
    return BuildResult(str(entry.ref), spec.name, "unpatched", str(final), sha256_file(final), final.stat().st_size,
                       round(time.monotonic() - t0, 2), "", base_artifact=art.file, base_sha256=art.sha256,
                       version=new_version, left_out=left_out,
                       how=f"{art.file} (sha256 verified) without the {spec.name} variant's {len(left_out)} left-out "
                           f"member(s); no patch applied")


def _rewrite_wheel(z, members, art, spec: VariantSpec, files: dict[str, bytes | None], not_shipped: list[str],
                   new_version: str, provenance: dict, out_dir: Path) -> tuple[Path, list, list, list, list]:
    """The release wheel `art` (open as `z`, its raw `members`) with `files` swapped in (None: deleted),
    the variant's leave-out dropped, renamed to `new_version`, provenance in dsadapt.json and RECORD
    rebuilt; written atomically into `out_dir`. Returns (path, replaced, added, removed, left out)."""
    by_name = {m.name: m for m in members}
    name, version, tags = _wheel_parts(art.file)
    old_di = f"{name}-{version}.dist-info"
    if f"{old_di}/RECORD" not in by_name:
        raise BuildError(f"{art.file}: no {old_di}/RECORD", hint="the artifact is not a standard wheel")
    new_di = f"{name}-{new_version}.dist-info"
    # the .data directory carries the version too; installers other than pip (installer, uv)
    # only treat `{name}-{version}.data/` as data and would copy an old-named one verbatim
    old_data, new_data = f"{name}-{version}.data/", f"{name}-{new_version}.data/"
    renamed: dict[str, str] = {}  # new member name -> name in the release wheel
    rows = parse_record(z.read(f"{old_di}/RECORD").decode("utf-8"))
    record_of = {r[0]: r for r in rows}
    out_members = []
    replaced, added, removed, left_out = [], [], [], []
    for m in members:
        if m.name.startswith(old_di + "/"):
            continue
        if sourcetree.left_out(m.name, spec.leave_out):
            left_out.append(m.name)
            continue
        if m.name in files and m.name not in not_shipped:
            data = files[m.name]
            if data is None:
                removed.append(m.name)
                continue
            out_members.append(new_member(m.name, data, m.external_attr))
            replaced.append(m.name)
        elif m.name.startswith(old_data):
            new_name = new_data + m.name[len(old_data):]
            renamed[new_name] = m.name
            out_members.append(type(m)(**{**m.__dict__, "name": new_name}))
        else:
            out_members.append(m)
    for path in sorted(files):
        if path in not_shipped or path in by_name or files[path] is None:
            continue
        out_members.append(new_member(path, files[path]))  # type: ignore[arg-type]
        added.append(path)
    # dist-info: renamed, METADATA re-versioned, provenance added, RECORD rebuilt last
    di_members = []
    for m in members:
        if not m.name.startswith(old_di + "/") or m.name == f"{old_di}/RECORD":
            continue
        rel = m.name[len(old_di) + 1:]
        if rel == "METADATA":
            meta = z.read(m.name).decode("utf-8")
            meta = "\n".join(f"Version: {new_version}" if l.startswith("Version: ") else l for l in meta.split("\n"))
            di_members.append(new_member(f"{new_di}/{rel}", meta.encode("utf-8"), m.external_attr))
        else:
            m2 = type(m)(**{**m.__dict__, "name": f"{new_di}/{rel}"})
            di_members.append(m2)
    provenance = {**provenance, "replaced": replaced, "added": added, "removed": removed, "left_out": left_out}
    di_members.append(new_member(f"{new_di}/dsadapt.json",
                                 (json.dumps(provenance, indent=2, sort_keys=True) + "\n").encode()))
    changed = {m.name for m in out_members if m.name in replaced or m.name in added}
    new_rows = []
    for m in out_members:
        r = record_of.get(renamed.get(m.name, m.name))
        if r is not None and m.name not in changed:
            new_rows.append([m.name, *r[1:]])
        else:
            data = files[m.name] if m.name in files else z.read(renamed.get(m.name, m.name))
            new_rows.append([m.name, record_hash(data), str(len(data))])  # type: ignore[arg-type]
    for m in di_members:
        data = _member_bytes(m)
        new_rows.append([m.name, record_hash(data), str(len(data))])
    new_rows.append([f"{new_di}/RECORD", "", ""])
    record = new_member(f"{new_di}/RECORD", format_record(new_rows).encode("utf-8"))
    out_dir.mkdir(parents=True, exist_ok=True)
    leftovers.clean_tmp_files(out_dir)  # what killed builds left where this one writes
    out_name = f"{name}-{new_version}-{tags}.whl"
    final = out_dir / out_name
    _install_members(out_members + di_members + [record], final)
    return final, replaced, added, removed, left_out


def _install_members(members: list, final: Path) -> None:
    """Write the wheel `final` atomically; never over a different file of the same name. A file
    already there with exactly these bytes (a warm rebuild) is kept as it is: nothing is written,
    it is read once to compare, and its sha256 comes from that read."""
    if final.exists():
        digest = members_match(final, members)
        if digest is None:
            raise RefusedToClobber(f"{final} exists with other content than this build",
                                   hint=f"move it away (or delete it) and build again; dsadapt never replaces a "
                                        f"different file in {final.parent.name}/")
        remember_sha256(final, digest)
        return
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        digest = write_members(tmp, members)
        _install_output(tmp, final)
        remember_sha256(final, digest)
    finally:
        tmp.unlink(missing_ok=True)


def _install_output(tmp: Path, final: Path) -> None:
    """Move a finished build into place, durably (the bytes are on disk before the name is, and the
    rename is); never over a different file of the same name."""
    try:
        if final.exists():
            if not same_bytes(final, tmp):
                raise RefusedToClobber(f"{final} exists with other content than this build",
                                       hint=f"move it away (or delete it) and build again; dsadapt never replaces a "
                                            f"different file in {final.parent.name}/")
            return  # the same bytes are in place already (made, and synced, by an earlier build)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _member_bytes(m) -> bytes:
    """Uncompressed bytes of a member held as raw (stored or deflated) data."""
    import zlib

    return m.raw if m.method == 0 else zlib.decompress(m.raw, -15)


def missing_toolchain(spec: VariantSpec) -> list[str]:
    return [t for t in spec.toolchain if shutil.which(t) is None]


def full_build(cfg: Config, lock: Lock, entry: LockEntry, spec: VariantSpec, stack: Stack, kind: BuildKind,
               out_dir: Path, progress=None) -> BuildResult:
    why = "; ".join(kind.reasons[:3]) + (f" (+{len(kind.reasons) - 3} more)" if len(kind.reasons) > 3 else "")
    missing = missing_toolchain(spec)
    if missing:
        raise ToolchainMissing(f"{entry} needs a full source build ({why}) but {', '.join(missing)} "
                               f"{'is' if len(missing) == 1 else 'are'} not installed",
                               hint=f"install {', '.join(missing)} or build on a machine that has them")
    co = Checkout(cfg, entry.ref)
    res = apply_stack(cfg, lock, entry.ref, progress=progress)
    source = res.source or {}
    if source.get("kind") == "pypi":
        raise EngineUnavailable(f"{entry} needs a full source build ({why}), but its checkout was unpacked from "
                                f"{source['origin']}, which has no build files",
                         hint="configure the git source or a mirror (DSADAPT_MIRRORS) so the checkout is the upstream tree")
    t0 = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.glob("*.whl"))
    if progress:
        progress(f"running the upstream build: pip wheel --no-deps {co.path}")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out_dir), str(co.path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
        raise BuildError(f"{entry}: the upstream build failed: {' | '.join(tail)}", hint="see the build log above")
    new = sorted(set(out_dir.glob("*.whl")) - before) or sorted(out_dir.glob("*.whl"), key=lambda p: p.stat().st_mtime)[-1:]
    final = new[-1]
    return BuildResult(str(entry.ref), spec.name, "full", str(final), sha256_file(final), final.stat().st_size,
                       round(time.monotonic() - t0, 2), stack.hash, how=f"pip wheel --no-deps ({why})")


class BuildHost:
    """The `engines.base.BuildServices` of a build: the checkout and the shared builds."""

    def __init__(self, cfg: Config, lock: Lock, progress: Progress | None = None):
        self.cfg, self.lock, self.progress = cfg, lock, progress

    def checkout(self, ref: PinRef, *, patched: bool = True) -> Tree:
        return checkout_tree(self.cfg, self.lock, ref, patched=patched, progress=self.progress)

    def overlay_build(self, entry: LockEntry, spec: VariantSpec, stack: Stack, out_dir: Path) -> BuildResult:
        return overlay_build(self.cfg, self.lock, entry, engine(entry.engine), spec, stack, out_dir, self.progress)

    def full_build(self, entry: LockEntry, spec: VariantSpec, stack: Stack, kind: BuildKind,
                   out_dir: Path) -> BuildResult:
        return full_build(self.cfg, self.lock, entry, spec, stack, kind, out_dir, self.progress)


def build_pin(cfg: Config, lock: Lock, ref: PinRef, variant: str | None = None, out_dir: Path | None = None,
              progress=None) -> BuildResult:
    entry = lock.pin(ref)
    eng = engine(ref.engine)
    spec = eng.variant_for(entry, variant)
    stack = load_stack(cfg.patches_root, ref)
    return eng.build(entry, spec, stack, out_dir or cfg.dist_dir, BuildHost(cfg, lock, progress))


def buildable_here(cfg: Config, lock: Lock, entry: LockEntry, variant: str) -> str | None:
    """Why a pin/variant cannot be built on this machine, or None."""
    eng = engine(entry.engine)
    spec = eng.variant(variant)
    try:
        stack = load_stack(cfg.patches_root, entry.ref)
    except Exception as e:  # reported as the reason
        return getattr(e, "message", str(e))
    return eng.build_blocker(entry, spec, stack)
