"""What `status` lists and `gc` removes as leftovers of dead runs: one of every kind, in every place
dsadapt writes in steps, found; the same names written by a live run, or too young to judge
without a pid, left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from patcher.base import leftovers
from patcher.base.dotgit import CheckoutLayout


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _cfg(root: Path) -> SimpleNamespace:
    cfg = SimpleNamespace(project=root / "project", workdir=root / "work", cache=root / "cache")
    cfg.patches_root, cfg.reports_root, cfg.dist_dir = (cfg.project / "patches", cfg.project / "reports",
                                                        cfg.project / "dist")
    for d in (cfg.project, cfg.patches_root / "vllm" / "v1", cfg.reports_root / "vllm", cfg.dist_dir):
        d.mkdir(parents=True, exist_ok=True)
    return cfg


def _touch(p: Path, old: bool = False, directory: bool = False) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        p.mkdir()
    else:
        p.write_text("x")
    if old:
        os.utime(p, (0, 0))
    return p


def test_every_kind_of_leftover_is_found_where_it_is_left_and_live_or_young_work_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "systmp"))
    cfg = _cfg(tmp_path)
    dead, live = _dead_pid(), os.getpid()
    co = cfg.workdir / "checkouts" / "vllm" / "v1"
    (co / ".git").mkdir(parents=True)
    lay = CheckoutLayout(co)
    expected = {
        _touch(cfg.project / f".upstream.lock.tmp-{dead}"): "temp file",
        _touch(cfg.patches_root / "vllm" / "v1" / f".series.tmp-{dead}"): "temp file",
        _touch(cfg.reports_root / "vllm" / ".report.json.abcd1234", old=True): "temp file",
        _touch(cfg.dist_dir / f".x.whl.tmp-{dead}"): "temp file",
        _touch(cfg.workdir / "checkouts" / "vllm" / f".v2.tmp-{dead}", directory=True): "checkout tmp",
        _touch(lay.scratch / f"index-{dead}-1"): "scratch",
        _touch(cfg.cache / "artifacts" / f".download-{dead}-x.whl"): "download",
        _touch(cfg.cache / "artifacts" / "tmpabc", old=True, directory=True): "download",
        _touch(cfg.cache / "artifacts" / f".y.tmp-{dead}"): "download",
        _touch(cfg.workdir / "tmp" / f"verify-{dead}-1", directory=True): "scratch",
        _touch(cfg.workdir / "bench-1", old=True, directory=True): "bench dir",
        _touch(tmp_path / "systmp" / "dsadapt-rebase-1", old=True, directory=True): "worktree",
    }
    kept = [
        _touch(cfg.project / f".upstream.lock.tmp-{live}"),
        _touch(cfg.reports_root / "vllm" / ".report.md.efgh5678"),  # no pid, and young
        _touch(cfg.workdir / "checkouts" / "vllm" / f".v3.tmp-{live}", directory=True),
        _touch(lay.scratch / f"index-{live}-1"),
        _touch(cfg.cache / "artifacts" / f".download-{live}-x.whl"),
        _touch(cfg.cache / "artifacts" / "tmpyoung", directory=True),
        _touch(cfg.workdir / "tmp" / f"verify-{live}-1", directory=True),
        _touch(cfg.workdir / "bench-2", directory=True),
        _touch(tmp_path / "systmp" / "dsadapt-verify-2", directory=True),
    ]
    found = {Path(lo.path): lo.kind for lo in leftovers.find(cfg, sizes=True)}
    assert found == expected
    assert not set(kept) & set(found)
    assert leftovers.remove(leftovers.find(cfg)) == []
    assert not any(p.exists() for p in expected) and all(p.exists() for p in kept)


def test_nothing_is_found_where_nothing_was_ever_written(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "none"))
    cfg = SimpleNamespace(project=tmp_path / "p", patches_root=tmp_path / "p" / "patches",
                          reports_root=tmp_path / "p" / "reports", dist_dir=tmp_path / "p" / "dist",
                          workdir=tmp_path / "w", cache=tmp_path / "c")
    assert leftovers.find(cfg) == []


def test_the_cleans_before_a_write_take_dead_runs_leftovers_and_leave_live_ones(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    engine_dir, arts, scratch, stack = (tmp_path / n for n in ("checkouts", "artifacts", "tmp", "stack"))
    gone = [_touch(engine_dir / f".v1.tmp-{dead}", directory=True), _touch(arts / f".download-{dead}-a.whl"),
            _touch(arts / f".b.whl.tmp-{dead}", directory=True), _touch(scratch / f"verify-{dead}-1", directory=True),
            _touch(stack / f".series.tmp-{dead}")]
    stay = [_touch(engine_dir / f".v2.tmp-{live}", directory=True), _touch(arts / f".download-{live}-a.whl"),
            _touch(arts / "a.whl"), _touch(scratch / f"verify-{live}-1", directory=True),
            _touch(stack / f".series.tmp-{live}"), _touch(stack / "series")]
    leftovers.clean_checkout_tmps(engine_dir)
    leftovers.clean_downloads(arts)
    leftovers.clean_scratch(scratch)
    leftovers.clean_tmp_files(stack)
    for missing in (tmp_path / "none",):  # a folder not made yet: nothing to clean, no error
        leftovers.clean_checkout_tmps(missing), leftovers.clean_downloads(missing), leftovers.clean_scratch(missing)
        leftovers.clean_tmp_files(missing)
    assert [p for p in gone if p.exists()] == [] and all(p.exists() for p in stay)
