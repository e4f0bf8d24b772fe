"""Overlay builds on fixture wheels: content, RECORD, version label, reproducibility, refusals.

Each test makes a wheel of the fixture upstream's v1.0.0 (with a WHEEL file and a RECORD of
real hashes, like a release wheel) in DSADAPT_ARTIFACTS, pins its sha256 in the project's
lock, and builds through the CLI (`dsadapt build`, in-process). The stack replaces a module,
adds a module and a .jinja template, deletes a module and touches a file outside the
package (not shipped), so every branch of the overlay writer is exercised.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import (
    MOD_V1,
    P1_MOD,
    REF1,
    TAG2,
    commit_msg,
    files_snapshot,
    git,
)
from overlay_support import (  # noqa: F401
    COMPILED_EDITS,
    DATA_SCRIPT,
    DIST_INFO,
    NEWMOD,
    OVERLAY_EDITS,
    SO,
    TEMPLATE,
    WHEEL_NAME,
    pin_wheel,
    release_wheel,
    with_variants,
)

from patcher.engines.base import VariantSpec
from patcher.engines.registry import engine
from patcher.formats.wheel import parse_record, record_hash, verify_record


def build(project, *args: str, env: dict | None = None) -> dict:
    r = project.run("build", REF1, "--json", *args, env=env)
    assert r.rc == 0, r
    return r.json()


def read_zip(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def record_rows(members: dict[str, bytes]) -> dict[str, list[str]]:
    name = next(n for n in members if n.endswith(".dist-info/RECORD"))
    return {r[0]: r for r in parse_record(members[name].decode())}


# ---------------------------------------------------------------- the overlay wheel


def test_patched_added_and_deleted_files_land_in_wheel_and_record(project):
    base, _ = pin_wheel(project)
    res = build(project)
    out = Path(res["artifact"])
    assert res["kind"] == "overlay" and out.parent == project.root / "dist"
    got, orig = read_zip(out), read_zip(base)
    assert got["vllm/mod.py"].decode() == P1_MOD != MOD_V1
    assert got["vllm/newmod.py"].decode() == NEWMOD
    assert got["vllm/templates/chat.jinja"].decode() == TEMPLATE
    assert "vllm/util.py" not in got
    assert got["vllm/__init__.py"] == orig["vllm/__init__.py"] and got[SO] == orig[SO]
    assert "README.md" not in got  # outside the shipped packages
    assert res["replaced"] == ["vllm/mod.py"] and res["removed"] == ["vllm/util.py"]
    assert res["added"] == ["vllm/newmod.py", "vllm/templates/chat.jinja"] and res["not_shipped"] == ["README.md"]
    rows = record_rows(got)
    assert rows["vllm/mod.py"][1] == record_hash(P1_MOD.encode())
    assert rows["vllm/templates/chat.jinja"][1:] == [record_hash(TEMPLATE.encode()), str(len(TEMPLATE))]
    assert "vllm/newmod.py" in rows and "vllm/util.py" not in rows
    assert verify_record(out) == []
    prov = json.loads(got[f"vllm-{res['version']}.dist-info/dsadapt.json"])
    assert prov["stack_hash"] == res["stack_hash"] and prov["base_sha256"] == res["base_sha256"]
    assert prov["removed"] == ["vllm/util.py"] and len(prov["patches"]) == 4
    assert res["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()


def test_verify_record_catches_a_wrong_hash(project, tmp_path):
    """verify_record is the oracle above: it must see a member whose bytes do not match RECORD."""
    pin_wheel(project)
    members = read_zip(Path(build(project)["artifact"]))
    members["vllm/mod.py"] += b"# edited after the build\n"
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(bad, "w") as z:
        for n, d in members.items():
            z.writestr(n, d)
    assert verify_record(bad) == ["vllm/mod.py: RECORD hash or size mismatch"]


def test_local_version_label_in_file_name_dist_info_and_metadata(project):
    pin_wheel(project)
    lst = project.run("list", "--json")
    stack_hash = next(p for p in lst.json()["pins"] if p["pin"] == REF1)["stack_hash"]
    res = build(project)
    version = f"1.0.0+ds.{stack_hash[:8]}"
    assert res["version"] == version and res["stack_hash"] == stack_hash
    out = Path(res["artifact"])
    assert out.name == f"vllm-{version}-py3-none-any.whl"
    got = read_zip(out)
    dist_infos = {n.split("/", 1)[0] for n in got if ".dist-info/" in n}
    assert dist_infos == {f"vllm-{version}.dist-info"}
    meta = got[f"vllm-{version}.dist-info/METADATA"].decode()
    assert f"\nVersion: {version}\n" in meta and "Summary: fixture" in meta
    assert got[f"vllm-{version}.dist-info/WHEEL"].startswith(b"Wheel-Version: 1.0")
    # the .data directory is named for the version too: installers other than pip only look there
    assert {n.split("/", 1)[0] for n in got if ".data/" in n} == {f"vllm-{version}.data"}
    assert f"vllm-{version}.data/scripts/vllm-tool" in record_rows(got)


def test_pip_installs_the_overlay_wheel(project, tmp_path):
    pin_wheel(project)
    res = build(project)
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
                        "--disable-pip-version-check", "--target", str(target), res["artifact"]],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + r.stdout
    assert (target / "vllm" / "mod.py").read_text() == P1_MOD
    assert (target / "bin" / "vllm-tool").is_file()
    assert (target / "vllm" / "templates" / "chat.jinja").read_text() == TEMPLATE
    assert not (target / "vllm" / "util.py").exists()
    probe = ("import importlib.metadata as m, vllm.mod, vllm.newmod; "
             "print(m.version('vllm'), vllm.newmod.added(), vllm.mod.__file__)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    version, added, where = r.stdout.split()
    assert version == res["version"] and added == "ds" and where.startswith(str(target))


def test_rebuild_is_byte_identical_also_from_a_fresh_work_dir(project, tmp_path):
    pin_wheel(project)
    first = build(project)
    again = build(project)
    assert again["sha256"] == first["sha256"]
    Path(first["artifact"]).rename(tmp_path / "first.whl")
    fresh = build(project, env={"DSADAPT_WORKDIR": str(tmp_path / "work2"), "DSADAPT_CACHE": str(tmp_path / "c2")})
    assert fresh["artifact"] == first["artifact"]
    assert fresh["sha256"] == first["sha256"]
    assert (tmp_path / "first.whl").read_bytes() == Path(fresh["artifact"]).read_bytes()


def test_leave_out_patterns_drop_members_for_that_variant_only(project, monkeypatch):
    """Like lmdeploy's `pytorch` variant: the wheel pinned for another variant, minus the members it names."""
    with_variants(monkeypatch, VariantSpec("slim", "vllm", "cpu", wheel_variant="cpu", leave_out=("vllm/_C*.so",)))
    pin_wheel(project)
    full = build(project, "--variant", "cpu")
    assert full["left_out"] == [] and SO in read_zip(Path(full["artifact"]))
    Path(full["artifact"]).unlink()
    slim = build(project, "--variant", "slim")
    got = read_zip(Path(slim["artifact"]))
    assert slim["variant"] == "slim" and slim["left_out"] == [SO]
    assert SO not in got and SO not in record_rows(got)
    assert got["vllm/mod.py"].decode() == P1_MOD
    assert verify_record(Path(slim["artifact"])) == []


# ---------------------------------------------------------------- refusals


def test_refuses_to_build_commits_not_exported_to_the_stack(project):
    """The artifact is labelled with the stack's hash: it must never carry edits the stack lacks."""
    pin_wheel(project)
    build(project)
    co = project.checkout()
    (co / "vllm" / "mod.py").write_text(P1_MOD + "# local experiment\n")
    r = project.run("build", REF1)
    assert r.rc == 4 and "uncommitted changes" in r.err, r
    git(co, "commit", "-qam", "local experiment")
    r = project.run("build", REF1)
    assert r.rc == 4 and "not exported to the stack" in r.err and "dsadapt refresh" in r.err, r


def test_refuses_a_wheel_whose_file_differs_from_the_patch_preimage(project):
    wheel, sha = pin_wheel(project, overrides={"vllm/mod.py": MOD_V1 + "# rebuilt by the packager\n"})
    r = project.run("build", REF1)
    assert r.rc == 3, r
    assert "sha256" not in r.err.split("hint")[0]  # the lock's sha256 matched: the blob check refused
    assert wheel.name in r.err and "vllm/mod.py" in r.err and "0001-" in r.err and "expects" in r.err
    assert not (project.root / "dist").exists() or not list((project.root / "dist").iterdir())


def test_refuses_a_wheel_whose_sha256_differs_from_the_lock(project):
    wheel, _ = pin_wheel(project, sha="0" * 64)
    r = project.run("build", REF1)
    assert r.rc == 3, r
    assert "sha256" in r.err and wheel.name in r.err and "0000000000000000" in r.err
    assert not (project.root / "dist").exists() or not list((project.root / "dist").iterdir())




def test_compiled_change_without_toolchain_refuses_naming_tool_and_patch(project, monkeypatch):
    with_variants(monkeypatch, toolchain=("dsadapt-no-such-nvcc",))
    pin_wheel(project, COMPILED_EDITS)
    before = files_snapshot(project.root, ignore=("lock",))
    r = project.run("build", REF1)
    assert r.rc == 5, r
    assert "dsadapt-no-such-nvcc" in r.err and "0002-kernel-fused-routing.patch touches csrc/x.cu" in r.err
    assert "full source build" in r.err and "0001-" not in r.err.split("hint")[0]
    assert files_snapshot(project.root, ignore=("lock",)) == before


def test_compiled_change_on_a_checkout_from_a_wheel_refuses(project, monkeypatch):
    with_variants(monkeypatch, toolchain=("git",))  # present: the refusal is about the source tree
    wheel, _ = pin_wheel(project, COMPILED_EDITS)
    r = project.run("build", REF1, env={"DSADAPT_SOURCES": "pypi"})
    assert r.rc == 6, r  # the source tree to build from is not available here
    assert "full source build" in r.err and "csrc/x.cu" in r.err
    assert f"unpacked from {wheel.name}" in r.err and "DSADAPT_MIRRORS" in r.err


# ---------------------------------------------------------------- list / build-all


def test_list_json_shows_build_kind_and_full_build_reasons(project):
    pin_wheel(project)
    pin = next(p for p in project.run("list", "--json").json()["pins"] if p["pin"] == REF1)
    assert pin["build_kind"] == "overlay" and pin["full_build_reasons"] == []
    pin_wheel(project, COMPILED_EDITS)
    pin = next(p for p in project.run("list", "--json").json()["pins"] if p["pin"] == REF1)
    assert pin["build_kind"] == "full"
    assert pin["full_build_reasons"] == ["0002-kernel-fused-routing.patch touches csrc/x.cu"]


def test_build_kind_uses_each_engines_rules():
    from patcher.formats.pinref import PinRef
    from patcher.formats.stackfiles import load_stack

    root = Path(__file__).resolve().parents[2] / "patches"
    assert engine("vllm").build_kind(load_stack(root, PinRef("vllm", "v0.32.0"))).kind == "overlay"
    assert engine("triton").build_kind(load_stack(root, PinRef("triton", "r26.01"))).kind == "backend"
    for path, compiled in [("csrc/moe/x.cu", True), ("setup.py", True), ("CMakeLists.txt", True),
                           ("vllm/_C.abi3.so", True), ("vllm/model_executor/models/deepseek_v2.py", False),
                           ("vllm/entrypoints/chat.jinja", False)]:
        assert engine("vllm").is_compiled(path) is compiled, path
    assert engine("lmdeploy").is_compiled("src/turbomind/models/llama.cc")


def test_build_all_lists_every_pin_with_status_and_reason(project, monkeypatch):
    pin_wheel(project)
    r = project.run("build-all", "--json")
    assert r.rc == 0, r
    rows = {(b["pin"], b["variant"]): b for b in r.json()["builds"]}
    assert set(rows) == {(REF1, "cpu"), (f"vllm@{TAG2}", "cpu")}
    built, other = rows[(REF1, "cpu")], rows[(f"vllm@{TAG2}", "cpu")]
    assert built["status"] == "built" and built["kind"] == "overlay" and built["reason"] is None
    assert Path(built["artifact"]).is_file() and built["sha256"]
    assert other["status"] == "skipped" and "no stack" in other["reason"]
    table = project.run("build-all")
    assert table.rc == 0, table
    assert REF1 in table.out and f"vllm@{TAG2}" in table.out and "skipped" in table.out and "built" in table.out

    with_variants(monkeypatch, toolchain=("dsadapt-no-such-nvcc",))
    pin_wheel(project, COMPILED_EDITS)
    row = {b["pin"]: b for b in project.run("build-all", "--json").json()["builds"]}[REF1]
    assert row["status"] == "skipped" and row["reason"] == "full build needs dsadapt-no-such-nvcc"


def test_build_all_reports_a_failed_build_and_exits_nonzero(project):
    pin_wheel(project, sha="0" * 64)
    r = project.run("build-all", "--json")
    assert r.rc == 1, r
    row = {b["pin"]: b for b in r.json()["builds"]}[REF1]
    assert row["status"] == "failed" and "sha256" in row["reason"]
    assert r.json()["ok"] is False


@pytest.mark.parametrize("version,label", [("0.32.0", "0.32.0+ds.0123abcd"), ("0.1+cpu", "0.1+cpu.ds.0123abcd")])
def test_overlay_version(version, label):
    from patcher.artifacts.builder import overlay_version

    assert overlay_version(version, "0123abcd" + "f" * 56) == label


def test_full_build_runs_the_upstream_build_when_toolchain_and_tree_are_there(project, monkeypatch):
    """The other side of the refusals: git source + toolchain present -> `pip wheel` of the patched tree."""
    pyproject = ('[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
                 '[project]\nname = "vllm"\nversion = "1.0.0"\n\n'
                 '[tool.setuptools.packages.find]\ninclude = ["vllm*"]\n')
    edits = [*COMPILED_EDITS, (commit_msg("build: package the fixture"), {"pyproject.toml": pyproject})]
    with_variants(monkeypatch, toolchain=("git",))
    pin_wheel(project, edits)
    # offline: build with dsadapt's own setuptools instead of fetching one
    monkeypatch.setenv("PIP_NO_BUILD_ISOLATION", "0")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    res = build(project)
    assert res["kind"] == "full" and "0002-kernel-fused-routing.patch touches csrc/x.cu" in res["how"]
    got = read_zip(Path(res["artifact"]))
    assert got["vllm/mod.py"].decode() == P1_MOD and "vllm/util.py" in got


def test_the_unpatched_side_of_a_variant_is_the_release_with_only_that_leave_out(project, monkeypatch):
    """`check --unpatched --variant pytorch` (LMDeploy without TurboMind) runs the same variant
    without the stack: the release wheel minus the variant's leave-out, labelled +unpatched."""
    from patcher.artifacts.builder import unpatched_build
    from patcher.base.config import load_config
    from patcher.formats.lock import load_lock
    from patcher.formats.pinref import parse_pinref

    with_variants(monkeypatch, VariantSpec("slim", "vllm", "cpu", wheel_variant="cpu", leave_out=("vllm/_C*.so",)))
    release, sha = pin_wheel(project)
    cfg = load_config(project.root, project.env)
    entry = load_lock(project.root / "upstream.lock").pin(parse_pinref(REF1))
    slim = unpatched_build(cfg, entry, engine("vllm").variant("slim"), project.tmp / "out")
    got, orig = read_zip(Path(slim.artifact)), read_zip(release)
    assert slim.kind == "unpatched" and slim.version == "1.0.0+unpatched.slim" and slim.left_out == [SO]
    assert Path(slim.artifact).name == "vllm-1.0.0+unpatched.slim-py3-none-any.whl"
    assert SO not in got and got["vllm/mod.py"] == orig["vllm/mod.py"] == MOD_V1.encode()  # no patch applied
    same = {n for n in orig if not n.startswith(DIST_INFO) and n != SO and not n.startswith("vllm-1.0.0.data")}
    assert all(got[n] == orig[n] for n in same)
    info = json.loads(got["vllm-1.0.0+unpatched.slim.dist-info/dsadapt.json"])
    assert info["unpatched"] is True and info["patches"] == [] and info["base_sha256"] == sha
    assert verify_record(Path(slim.artifact)) == []
    # a variant without a leave-out: the pinned release wheel itself, checked against the lock
    full = unpatched_build(cfg, entry, engine("vllm").variant("cpu"), project.tmp / "out")
    assert full.kind == "release" and full.sha256 == sha and Path(full.artifact).read_bytes() == release.read_bytes()


# ---------------------------------------------------------------- warm rebuilds: hashed once, nothing written


class _CountingSha256:
    """hashlib.sha256 that adds every hashed byte to `counted`."""

    counted = 0

    def __init__(self, data=b""):
        self._h = _REAL_SHA256()
        self.update(data)

    def update(self, data):
        type(self).counted += len(data)
        self._h.update(data)

    def digest(self):
        return self._h.digest()

    def hexdigest(self):
        return self._h.hexdigest()


_REAL_SHA256 = hashlib.sha256


def test_a_warm_rebuild_hashes_each_artifact_once_and_rewrites_nothing(project, monkeypatch):
    """The release wheel is verified once (not again for the build), the output's sha256 comes from
    the one pass that compares it with the file already in dist/, and that file is left as it is."""
    import os

    from patcher.base import fsutil

    # a release wheel of a few MB (hex does not compress below half), so that a second pass over
    # the release or the output shows up in the count beside the small hashes (stack, RECORD rows)
    base, _ = pin_wheel(project, overrides={"vllm/weights.txt": os.urandom(1 << 20).hex()})
    first = build(project)
    out = Path(first["artifact"])
    before = out.stat()
    monkeypatch.setattr(fsutil, "_DIGESTS", {})  # a new run: nothing known yet
    monkeypatch.setattr(hashlib, "sha256", _CountingSha256)
    _CountingSha256.counted = 0
    again = build(project)
    assert again["sha256"] == first["sha256"] == _REAL_SHA256(out.read_bytes()).hexdigest()
    after = out.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    assert base.stat().st_size > 1 << 20
    small = 1 << 16  # the stack's hash, RECORD rows of changed members, the lock: kilobytes
    assert _CountingSha256.counted <= base.stat().st_size + out.stat().st_size + small, _CountingSha256.counted


def test_a_rebuild_never_replaces_another_file_of_the_same_name(project):
    pin_wheel(project)
    out = Path(build(project)["artifact"])
    data = out.read_bytes()
    out.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # the same name and size, other bytes
    kept = out.read_bytes()
    r = project.run("build", REF1)
    assert r.rc == 4 and "exists with other content" in r.err, r
    assert out.read_bytes() == kept and not list(out.parent.glob(".*.tmp-*"))


def test_a_file_hashed_once_is_hashed_again_when_it_changes(tmp_path):
    from patcher.base.fsutil import sha256_file

    f = tmp_path / "a.whl"
    f.write_bytes(b"one")
    st = f.stat()
    assert sha256_file(f) == _REAL_SHA256(b"one").hexdigest()
    f.write_bytes(b"two")  # same size, the same mtime put back: the change time still differs
    import os

    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert sha256_file(f) == _REAL_SHA256(b"two").hexdigest()
