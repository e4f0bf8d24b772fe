"""dsadapt bench on the fixture project: measured rows, skipped rows with reasons, check timings, markdown."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import REF1, REPO_ROOT, TAG2
from overlay_support import pin_wheel

from patcher.bench.builds import BuildBench
from patcher.bench.driver import BenchReport, CheckTimings, read_check_timings
from patcher.bench.page import build_table, format_markdown

TIMINGS = {"install_s": 0.74, "reference_s": 5.29, "engine_import_s": 6.093, "engine_engine_start_s": 18.727,
           "engine_generate_s": 7.197, "engine_s": 38.38, "compare_s": 0.002, "total_s": 47.37}


def write_report(root: Path, name: str, **extra) -> None:
    d = root / "reports" / "vllm" / "v1.0.0"
    d.mkdir(parents=True, exist_ok=True)
    body = {"pin": REF1, "variant": "cpu", "model": "v3", "dtype": "float32", "verdict": "pass",
            "provenance": {"date": "2026-11-29T12:45:00Z", "device": "CPU fixture (2 cores)"}, "timings": TIMINGS,
            **extra}
    (d / name).write_text(json.dumps(body))


def test_bench_measures_builds_and_alternative_and_writes_markdown(project, tmp_path):
    pin_wheel(project)
    write_report(project.root, "v3-float32.json")
    write_report(project.root, "v3-float32-unpatched.json", unpatched=True)
    out = tmp_path / "bench.md"
    r = project.run("bench", "--only", "builds", "--repeat", "2", "--out", str(out), "--json")
    assert r.rc == 0, r
    data = r.json()
    rows = {(b["pin"], b["variant"]): b for b in data["builds"]}
    assert set(rows) == {(REF1, "cpu"), (f"vllm@{TAG2}", "cpu")}
    b = rows[(REF1, "cpu")]
    assert b["status"] == "measured" and b["kind"] == "overlay" and len(b["runs_s"]) == 2
    assert 0 < b["build_s"] < 30 and b["first_s"] > 0 and b["reproducible"] is True
    assert b["cached"] is True and b["fetch_s"] >= 0  # the fixture wheel sits in DSADAPT_ARTIFACTS
    assert b["files"] == 4 and b["size"] > 0 and b["artifact"].startswith("vllm-1.0.0+ds.")
    assert b["alternative_s"] > 0 and b["alternative_size"] > 0 and "pip wheel" in b["alternative"]
    assert "several minutes" in b["alternative"] and "gpu.cuda.inc.md" in b["alternative_source"]
    skipped = rows[(f"vllm@{TAG2}", "cpu")]
    assert skipped["status"] == "skipped" and "no stack" in skipped["reason"]
    assert [c["report"] for c in data["checks"]] == ["reports/vllm/v1.0.0/v3-float32.json"]
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu"]
    assert not (project.root / "dist").exists()  # bench builds in a temporary work dir
    assert not (project.workdir / "checkouts").exists()
    md = out.read_text()
    assert md.startswith("# Benchmarks") and data["date"] in md and "| pin | variant |" in md
    assert "| reports/vllm/v1.0.0/v3-float32.json | pass | 0.74 s | 5.29 s |" in md and "47.37 s" in md
    assert f"{data['machine']['cores']} cores" in md


def test_bench_table_prints_and_defaults_to_docs(project):
    pin_wheel(project)
    r = project.run("bench", "--repeat", "1", "--no-alternative", "--sizes", "1,3")
    assert r.rc == 0, r
    assert r.out.startswith("builds (") and "wrote " in r.out
    md = (project.root / "docs" / "benchmarks.md").read_text()
    assert "`dsadapt bench --repeat 1 --no-alternative --sizes 1,3`" in md and "No check report" in md


def test_read_check_timings_skips_reports_without_timings(tmp_path):
    write_report(tmp_path, "a.json")
    (tmp_path / "reports" / "vllm" / "v1.0.0" / "rebase.json").write_text(json.dumps({"pin": REF1}))
    (tmp_path / "reports" / "vllm" / "v1.0.0" / "broken.json").write_text("{")
    got = read_check_timings(tmp_path / "reports")
    assert [c.report for c in got] == ["reports/vllm/v1.0.0/a.json"] and got[0].timings == TIMINGS


def test_build_table_flags_a_non_reproducible_build():
    rows = [BuildBench("vllm@v1", "cpu", "overlay", "measured", cached=True, fetch_s=0.25, first_s=2.0, build_s=1.5,
                       runs_s=[1.5], artifact="x.whl", size=2_500_000, files=1, reproducible=False),
            BuildBench("vllm@v2", "cuda", "full", "skipped", reason="full build needs nvcc")]
    report = BenchReport("2026-11-29 13:00 UTC", {"cores": 2, "cpu": "X", "memory_gib": 24, "python": "3.11",
                                                  "os": "Linux"}, 1, rows,
                         [CheckTimings("r.json", "vllm@v1", "cpu", "v3", "float32", "pass", None, None, {})])
    table = build_table(report)
    assert table[0][:8] == ["vllm@v1", "cpu", "overlay", "cached (0.25 s sha256)", "2.00 s", "1.50 s", "2.5 MB", "1"]
    assert table[0][8] == "NOT reproducible"
    assert table[1][8] == "skipped: full build needs nvcc" and table[1][2] == "full"
    md = format_markdown(report)
    assert "| vllm@v2 | cuda | full | - | - | - | - | - | skipped: full build needs nvcc | - |" in md


def test_sections_bench_does_not_write_are_kept():
    """docs/benchmarks.md holds sections measured by other tools (the checkpoint costs): regenerating
    the file keeps them as they were."""
    report = BenchReport("2026-11-29 13:00 UTC", {"cores": 2, "cpu": "X", "memory_gib": 24, "python": "3.11",
                                                  "os": "Linux"}, 1, [], [])
    old = "# Benchmarks\n\nold\n\n## Check wall time\n\nold checks\n\n## Checkpoints\n\n| a | b |\n|---|---|\n"
    md = format_markdown(report, old=old)
    assert "## Checkpoints\n\n| a | b |\n|---|---|" in md and "old checks" not in md


def test_bench_skips_a_full_build_it_cannot_run_and_says_why(project, monkeypatch):
    from overlay_support import COMPILED_EDITS, with_variants

    with_variants(monkeypatch, toolchain=("dsadapt-no-such-nvcc",))
    pin_wheel(project, COMPILED_EDITS)
    r = project.run("bench", "--repeat", "1", "--sizes", "1,3", "--json", "--out", str(project.tmp / "b.md"))
    assert r.rc == 0, r
    row = {b["pin"]: b for b in r.json()["builds"]}[REF1]
    assert row["status"] == "skipped" and row["kind"] == "full"
    assert row["reason"] == "full build needs dsadapt-no-such-nvcc" and row["build_s"] is None
    assert "| vllm@v1.0.0 | cpu | full |" in (project.tmp / "b.md").read_text()


def test_stack_ops_bench_measures_dsadapt_next_to_raw_git_and_keeps_the_builds_section(project, clean_stack):
    """`bench --only stack-ops` on the fixture tree: apply/verify/refresh rows with their raw-git
    anchors measured in the same run; the builds section of the file is kept as it was."""
    out = project.root / "docs" / "benchmarks.md"
    out.parent.mkdir(parents=True)
    out.write_text("# Benchmarks\n\nold header\n\n## Builds\n\nold builds table\n\n## Check wall time\n\nold\n")
    r = project.run("bench", "--only", "stack-ops", "--stack-pin", REF1, "--sizes", "1,3", "--repeat", "1",
                    "--rebase-to", "", "--json", env={"PYTHONPATH": str(REPO_ROOT)})  # the timed runs: this code
    assert r.rc == 0, r
    rows = r.json()["stack_ops"]
    by = {(x["op"], x["n"]): x for x in rows}
    for op in ("apply", "verify", "verify, diff changed", "verify cold", "refresh"):
        for n in (1, 3):
            row = by[(op, n)]
            assert row["dsadapt_s"] > 0 and row["anchor_s"] > 0 and row["ratio"] > 0, row
    assert by[("verify", 3)]["anchor"] == "one temp-index git apply --cached of the whole stack"
    # three patches over the fixture's two multi-line modules: two distinct files to compile, cold
    assert "compile 2 file(s)" in by[("verify cold", 3)]["note"], by[("verify cold", 3)]
    assert [x["note"] for x in rows if x["op"] == "start-up"] == ["dsadapt --help", "dsadapt list", "dsadapt status"]
    assert by[("verify all", 1)]["dsadapt_s"] > 0
    md = out.read_text()
    assert "## Builds\n\nold builds table" in md and "## Stack operations" in md
    assert "| apply | 3 |" in md and "git am -3 of the same files" in md
    assert not list(project.workdir.glob("bench-stack-*"))


def test_startup_bench_times_commands_next_to_the_anchor_and_the_warm_build(project):
    """`bench --only start-up`: every start-up command and the warm build as whole processes, the
    anchor (`python3 -c pass`) measured in the same run, the goals judged; other sections kept."""
    pin_wheel(project)
    out = project.root / "docs" / "benchmarks.md"
    out.parent.mkdir(parents=True)
    out.write_text("# Benchmarks\n\nold header\n\n## Builds\n\nold builds table\n\n## Stack operations\n\nold ops\n")
    r = project.run("bench", "--only", "start-up", "--stack-pin", REF1, "--repeat", "1", "--json")
    assert r.rc == 0, r
    rows = {x["command"]: x for x in r.json()["startup"]}
    assert set(rows) == {"dsadapt --help", "dsadapt list", "dsadapt status", "dsadapt report", "dsadapt tags vllm",
                         f"dsadapt build {REF1} --variant cpu"}
    for row in rows.values():
        assert row["wall_s"] is not None and row["wall_s"] > 0 and row["cpu_s"] > 0, row["note"]
        if row["what"] == "start-up":
            assert row["anchor_s"] > 0 and row["ratio"] == round(row["wall_s"] / row["anchor_s"], 2) and row["own_s"] > 0
            assert len(row["runs_s"]) == len(row["anchor_runs_s"]) == 5
            assert row["met"] == (row["wall_s"] <= 0.12 and max(row["ratio"], row["own_ratio"]) <= 4)
    assert rows[f"dsadapt build {REF1} --variant cpu"]["met"] == (rows[f"dsadapt build {REF1} --variant cpu"]["wall_s"] <= 1)
    md = out.read_text()
    assert "## Start-up and warm build" in md and "| start-up | dsadapt tags vllm |" in md
    assert "## Builds\n\nold builds table" in md and "## Stack operations\n\nold ops" in md
