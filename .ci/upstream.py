#!/usr/bin/env python3
"""The upstream workflow's steps, runnable anywhere: carry the stacks onto new upstream releases and
assemble one pull request. `.github/workflows/upstream.yml` runs `plan` in one job, `cell` in one
job per matrix cell and `payload` in the last; `run` does all three in a row on one machine (what
tests/upstream/test_upstream_workflow.py runs, and what a person runs to see what CI would do).

  plan     `dsadapt matrix --json --only new`: one cell per (new release tag, variant), each with the
           pin whose stack it carries (`rebase_from`) and the gate configurations its patches ask
           for (`checks`: their Covered-By). --tags/--variants keep only some.
  cell     one cell, each step a `dsadapt` command and a JUnit case: rebase (--publish), lock, build,
           check in every configuration of `checks`, the parallel configurations, perf. A step that
           cannot run on this runner (exit 6: no GPU, no lock) is a skipped case with the reason; the
           checks after a failed or stopped step are skipped saying so. What the PR needs (the
           carried stack, upstream.lock, the environment locks made, the published reports) is
           copied into OUT/<cell>/files/, the step log into OUT/<cell>/cell.json and junit.xml.
           Exit 0 when no step failed.
  payload  the cells' results merged into one PR: OUT/files/ (patches/, upstream.lock with every new
           pin, env-locks/, reports/), OUT/body.md, OUT/junit.xml, OUT/pr.json (`ready`: every cell ran
           without a failure and the cells agree byte for byte on what they share). Exit 0 when ready.

dsadapt is run as $DSADAPT (default `dsadapt`; e.g. `python -m patcher.cli.main`). Reports are made
reproducible with SOURCE_DATE_EPOCH (the project's last commit time, when not set).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT_DEFAULT = Path.cwd()
#: exit codes of dsadapt (docs/user-guide.md): what a step's exit status means for its JUnit case
OK, FAILED, STOPPED, MISSING, CANNOT_RUN = 0, 1, 4, 5, 6


def dsadapt() -> list[str]:
    return shlex.split(os.environ.get("DSADAPT", "dsadapt"))


def run_dsadapt(project: Path, args: list[str], log: Path, timeout: float | None = None) -> tuple[int, dict | None, str]:
    """One dsadapt command with --json; (exit status, its JSON document, the tail of its stderr)."""
    cmd = [*dsadapt(), "--project", str(project), "--json", *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as err:
        err.write("$ " + shlex.join(cmd) + "\n")
        err.flush()
        try:
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout, cwd=project)
            rc, stdout = r.returncode, r.stdout
        except subprocess.TimeoutExpired as e:
            rc, stdout = 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    doc = None
    try:
        doc = json.loads(stdout) if stdout.strip() else None
    except json.JSONDecodeError:
        doc = None
    tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-12:]
    return rc, doc, "\n".join(tail)


def error_text(doc: dict | None, tail: str) -> str:
    """The one-line error of a failed command (its JSON error object), else its stderr's last line."""
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        e = doc["error"]
        return (e.get("message") or "") + (f" (hint: {e['hint']})" if e.get("hint") else "")
    return tail.splitlines()[-1] if tail else "no output"


def source_date_epoch(project: Path) -> str | None:
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return os.environ["SOURCE_DATE_EPOCH"]
    r = subprocess.run(["git", "-C", str(project), "log", "-1", "--format=%ct"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip().isdigit() else None


def cell_id(cell: dict) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{cell['pin']}-{cell['variant']}").strip("_")


# ---------------------------------------------------------------- plan


def plan(project: Path, tags: list[str], variants: list[str], log_dir: Path) -> dict:
    rc, doc, tail = run_dsadapt(project, ["matrix", "--only", "new"], log_dir / "plan.log")
    if rc != OK or not isinstance(doc, dict):
        raise SystemExit(f"upstream: `dsadapt matrix` failed ({rc}): {error_text(doc, tail)}")
    cells = [c for c in doc.get("include", [])
             if (not tags or c["tag"] in tags) and (not variants or c["variant"] in variants)]
    return {"include": cells}


# ---------------------------------------------------------------- one cell


class Steps:
    """The cell's steps as they happen: each one a JUnit case."""

    def __init__(self, cell: dict):
        self.cell = cell
        self.rows: list[dict] = []

    def add(self, name: str, status: str, rc: int | None, reason: str = "", seconds: float = 0.0, **extra) -> dict:
        row = {"name": name, "status": status, "rc": rc, "reason": reason, "seconds": round(seconds, 1), **extra}
        self.rows.append(row)
        mark = {"passed": "ok", "failed": "FAILED", "skipped": "skipped"}[status]
        print(f"  {self.cell['name']}: {name}: {mark}" + (f" ({reason})" if reason else ""), flush=True)
        return row

    @property
    def failed(self) -> bool:
        return any(r["status"] == "failed" for r in self.rows)


def _status(rc: int) -> str:
    return "passed" if rc == OK else "skipped" if rc == CANNOT_RUN else "failed"


def _same_rebase_done(project: Path, cell: dict) -> bool:
    """An earlier cell of the same tag (another variant, on this machine) carried the stack already:
    the published rebase report names OLD's current stack and NEW's stack is the one it wrote."""
    engine, old_tag = cell["rebase_from"].split("@", 1)
    new = project / "patches" / engine / cell["tag"]
    rep = project / "reports" / "rebase" / f"{engine}-{old_tag}-to-{cell['tag']}.json"
    if not (new / "series").is_file() or not rep.is_file():
        return False
    sys.path.insert(0, str(project))
    from patcher.formats.pinref import parse_pinref
    from patcher.formats.stackfiles import load_stack

    data = json.loads(rep.read_text(encoding="utf-8"))
    old = load_stack(project / "patches", parse_pinref(cell["rebase_from"]))
    now = load_stack(project / "patches", parse_pinref(cell["pin"]))
    return data.get("old_stack_hash") == old.hash and data.get("new_stack_hash") == now.hash


def run_cell(project: Path, cell: dict, out: Path, skip: tuple[str, ...] = ()) -> dict:
    """Every step of one cell; its record in OUT/<cell>/ (cell.json, junit.xml, files/). `skip`:
    steps left out on purpose (`perf`, `parallel`): skipped cases saying so, never passes."""
    here = out / cell_id(cell)
    if here.exists():
        shutil.rmtree(here)
    logs = here / "logs"
    steps = Steps(cell)
    pin, variant = cell["pin"], cell["variant"]
    made_locks: list[str] = []
    print(f"upstream: cell {cell['name']}", flush=True)
    blocked = ""  # why the steps after the current one cannot run

    # rebase (new cells) or apply (pinned cells)
    if "rebase" in cell["steps"]:
        t0 = time.monotonic()
        if _same_rebase_done(project, cell):
            steps.add("rebase", "passed", OK, f"{cell['rebase_from']} → {cell['tag']} carried by an earlier cell here")
        else:
            rc, doc, tail = run_dsadapt(project, ["--publish", "rebase", cell["rebase_from"], "--onto", cell["tag"],
                                                  "--no-lock"], logs / "rebase.log")
            if rc == OK and isinstance(doc, dict):
                counts = ", ".join(f"{n} {k}" for k, n in (doc.get("counts") or {}).items()) or "empty stack"
                steps.add("rebase", "passed", rc, counts, time.monotonic() - t0,
                          direction=doc.get("direction"), patches=[{k: p.get(k) for k in ("name", "outcome", "detail")}
                                                                   for p in doc.get("patches", [])])
            elif rc == STOPPED:
                blocked = "the rebase stopped on a conflict: a person resolves it (`dsadapt rebase … --continue`)"
                steps.add("rebase", "failed", rc, error_text(doc, tail), time.monotonic() - t0)
            else:
                blocked = "the rebase did not finish"
                steps.add("rebase", "failed" if rc != CANNOT_RUN else "skipped", rc, error_text(doc, tail),
                          time.monotonic() - t0)
    # lock
    if "lock" in cell["steps"] or "rebase" in cell["steps"]:
        t0 = time.monotonic()
        if blocked:
            steps.add("lock", "skipped", None, f"not run: {blocked}")
        else:
            rc, doc, tail = run_dsadapt(project, ["lock", pin, "--variant", variant], logs / "lock.log")
            if rc == OK and isinstance(doc, dict):
                words = []
                for d in doc.get("locks", []):
                    if d.get("path") and d.get("origin") == "project":
                        made_locks.append(d["path"])
                    words.append(f"{d['env']}: {d.get('state')} ({d.get('origin')})" if d.get("env")
                                 else f"no lock needed ({d.get('note') or 'host packages'})")
                steps.add("lock", "passed", rc, "; ".join(words), time.monotonic() - t0, locks=doc.get("locks", []))
            else:
                steps.add("lock", _status(rc), rc, error_text(doc, tail), time.monotonic() - t0)
                blocked = blocked or f"no environment lock ({error_text(doc, tail)})"
    # build
    if "build" in cell["steps"]:
        t0 = time.monotonic()
        if blocked:
            steps.add("build", "skipped", None, f"not run: {blocked}")
        else:
            rc, doc, tail = run_dsadapt(project, ["build", pin, "--variant", variant], logs / "build.log")
            steps.add("build", _status(rc) if rc != MISSING else "skipped", rc,
                      Path((doc or {}).get("artifact", "")).name if rc == OK else error_text(doc, tail),
                      time.monotonic() - t0)
            if rc != OK:
                blocked = f"no build ({error_text(doc, tail)})"
    # checks: every configuration the stack's patches ask for, then the parallel ones
    if "check" in cell["steps"]:
        runs = [(f"check {c['label']}", c["args"]) for c in cell.get("checks") or []] or [("check v3", ["--model", "v3"])]
        runs += [(f"check v3 {p['label']}", ["--model", "v3", *shlex.split(p["args"])]) for p in cell.get("parallel") or []]
        for name, args in runs:
            t0 = time.monotonic()
            if blocked:
                steps.add(name, "skipped", None, f"not run: {blocked}")
                continue
            if "parallel" in skip and "--tp" in args:
                steps.add(name, "skipped", None, "not run: left out on purpose (--skip parallel)")
                continue
            junit = logs / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}.xml"
            rc, doc, tail = run_dsadapt(project, ["--publish", "check", pin, "--variant", variant, *args, "--bisect",
                                                  "--junit", str(junit)], logs / f"{junit.stem}.log")
            verdicts = (doc or {}).get("dtypes") or ({(doc or {}).get("dtype"): (doc or {}).get("verdict")}
                                                      if isinstance(doc, dict) and doc.get("verdict") else {})
            reason = ", ".join(f"{d} {v}" for d, v in verdicts.items() if d) if rc in (OK, FAILED) and verdicts \
                else error_text(doc, tail)
            steps.add(name, _status(rc), rc, reason, time.monotonic() - t0, args=args)
    # perf
    if "perf" in cell["steps"]:
        t0 = time.monotonic()
        if blocked:
            steps.add("perf", "skipped", None, f"not run: {blocked}")
        elif "perf" in skip:
            steps.add("perf", "skipped", None, "not run: left out on purpose (--skip perf)")
        else:
            rc, doc, tail = run_dsadapt(project, ["--publish", "perf", pin, "--variant", variant, "--model", "v3",
                                                  "--config-style", "deepseek"], logs / "perf.log")
            steps.add("perf", _status(rc), rc, (doc or {}).get("verdict", "") if rc in (OK, FAILED)
                      else error_text(doc, tail), time.monotonic() - t0)
    for s in cell.get("skip") or []:  # what the plan left out, visible in the test report
        steps.add(f"planned out: {s.split(':', 1)[0]}", "skipped", None, s)
    record = {"cell": cell, "id": cell_id(cell), "steps": steps.rows, "ok": not steps.failed,
              "files": collect_files(project, cell, here / "files", made_locks)}
    (here / "cell.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    write_junit(here / "junit.xml", [record], project)
    return record


def collect_files(project: Path, cell: dict, dest: Path, made_locks: list[str]) -> list[str]:
    """What the PR takes from this cell, copied under `dest` (the project's layout)."""
    engine, tag = cell["engine"], cell["tag"]
    picked: list[Path] = []
    stack = project / "patches" / engine / tag
    if (stack / "series").is_file():
        picked += sorted(p for p in stack.iterdir() if p.is_file())
    picked.append(project / "upstream.lock")
    picked += [Path(p) for p in made_locks]
    for d in (project / "reports" / engine / tag, project / "reports" / "rebase"):
        if d.is_dir():
            picked += sorted(p for p in d.rglob("*") if p.is_file() and (d.name != "rebase" or f"-to-{tag}." in p.name))
    rels = []
    for p in dict.fromkeys(picked):
        rel = p.resolve().relative_to(project.resolve())
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dest / rel)
        rels.append(str(rel))
    return rels


def write_junit(path: Path, records: list[dict], project: Path) -> None:
    sys.path.insert(0, str(project))
    from patcher.cli.ci import Case, junit_xml

    cases = []
    for rec in records:
        for s in rec["steps"]:
            status = s["status"]
            cases.append(Case(f"{rec['cell']['name']}: {s['name']}", f"dsadapt.upstream.{rec['cell']['engine']}",
                              float(s.get("seconds") or 0), failure=s["reason"] or "failed" if status == "failed" else None,
                              skipped=(s["reason"] or "not run") if status == "skipped" else None,
                              output=f"exit status {s['rc']}" if s["rc"] is not None else "",
                              properties={"cell": rec["cell"]["name"], "step": s["name"]}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(junit_xml("dsadapt upstream", cases), encoding="utf-8")


# ---------------------------------------------------------------- the pull request


def payload(project: Path, cells_dir: Path, out: Path, base_lock: Path | None = None) -> dict:
    """Merge the cells' results into one PR payload; `ready` when every cell is ok and they agree.
    `base_lock`: upstream.lock as it was before the cells ran (default: the project's)."""
    sys.path.insert(0, str(project))
    from patcher.formats.lock import format_lock, load_lock, parse_lock

    records = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(cells_dir.glob("*/cell.json"))]
    if out.exists():
        shutil.rmtree(out)
    files = out / "files"
    problems: list[str] = []
    base = load_lock(base_lock or project / "upstream.lock")
    merged = base
    for rec in records:
        src = cells_dir / rec["id"] / "files"
        for rel in rec["files"]:
            if rel == "upstream.lock":
                cell_lock = parse_lock((src / rel).read_text(encoding="utf-8"), Path("upstream.lock"))
                for key, entry in sorted(cell_lock.pins.items()):
                    if key not in base.pins:
                        if key in merged.pins and merged.pins[key] != entry:
                            problems.append(f"cells pin {key} differently")
                        merged = merged.with_pin(entry)
                continue
            target = files / rel
            data = (src / rel).read_bytes()
            if target.exists() and target.read_bytes() != data and not rel.startswith("reports/ci/"):
                problems.append(f"{rel}: the cells wrote different bytes")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    if merged.pins != base.pins:
        (files / "upstream.lock").parent.mkdir(parents=True, exist_ok=True)
        (files / "upstream.lock").write_text(format_lock(merged), encoding="utf-8")
    failed = [f"{r['cell']['name']}: {s['name']}: {s['reason']}" for r in records for s in r["steps"]
              if s["status"] == "failed"]
    ready = bool(records) and not failed and not problems
    write_junit(out / "junit.xml", records, project)
    new_pins = sorted(set(merged.pins) - set(base.pins))
    doc = {"schema": "dsadapt.upstream-pr/1", "ready": ready, "title": "Carry patch stacks onto new upstream releases",
           "branch": "dsadapt/upstream", "new_pins": new_pins, "problems": problems, "failed": failed,
           "cells": [{"name": r["cell"]["name"], "ok": r["ok"], "steps": r["steps"]} for r in records],
           "files": sorted(str(p.relative_to(files)) for p in files.rglob("*") if p.is_file()) if files.is_dir() else []}
    (out / "body.md").write_text(body(doc, records, files), encoding="utf-8")
    (out / "pr.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return doc


def body(doc: dict, records: list[dict], files: Path) -> str:
    passed = [(r["cell"]["name"], s) for r in records for s in r["steps"] if s["status"] == "passed"
              and s["name"].startswith("check")]
    skipped = [(r["cell"]["name"], s) for r in records for s in r["steps"] if s["status"] == "skipped"]
    lines = ["Stacks carried onto new upstream releases by the scheduled upstream workflow "
             "(`.ci/upstream.py`; every step is a `dsadapt` command).", "",
             f"New pins: {', '.join(doc['new_pins']) or 'none'}. Checks passed: {len(passed)}; "
             f"steps not run here: {len(skipped)}; failed: {len(doc['failed'])}.", "",
             "| cell | step | result |", "|---|---|---|"]
    for r in records:
        for s in r["steps"]:
            lines.append(f"| {r['cell']['name']} | {s['name']} | {s['status']}"
                         + (f": {s['reason']}".replace("|", "\\|") if s["reason"] else "") + " |")
    for rep in sorted(files.glob("reports/rebase/*.md")):
        lines += ["", rep.read_text(encoding="utf-8").strip()]
    if skipped:
        lines += ["", "## Not run on these runners (never counted as passed)", ""]
        lines += [f"- {name}: {s['name']}: {s['reason']}" for name, s in skipped]
    if doc["failed"] or doc["problems"]:
        lines += ["", "## Failed", ""] + [f"- {x}" for x in doc["failed"] + doc["problems"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=".ci/upstream.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", type=Path, default=ROOT_DEFAULT)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_plan = sub.add_parser("plan", help="the matrix of new-release cells (JSON on stdout; GITHUB_OUTPUT too)")
    p_cell = sub.add_parser("cell", help="run one cell")
    p_cell.add_argument("--cell", required=True, help="the cell as JSON (one entry of the plan's include)")
    p_cell.add_argument("--out", type=Path, required=True)
    p_cell.add_argument("--skip", default="", help="steps to leave out on purpose: perf, parallel (comma-separated)")
    p_pay = sub.add_parser("payload", help="merge the cells into one PR payload")
    p_pay.add_argument("--cells", type=Path, required=True)
    p_pay.add_argument("--out", type=Path, required=True)
    p_pay.add_argument("--base-lock", type=Path, default=None,
                       help="upstream.lock before the cells ran (default: the project's)")
    p_run = sub.add_parser("run", help="plan, every cell, payload, one after the other")
    p_run.add_argument("--out", type=Path, required=True)
    for p in (p_plan, p_run):
        p.add_argument("--tags", default="", help="only these new tags (comma-separated)")
        p.add_argument("--variants", default="", help="only these variants (comma-separated)")
    p_run.add_argument("--skip", default="", help="steps to leave out on purpose: perf, parallel (comma-separated)")
    args = ap.parse_args(argv)
    project = args.project.resolve()
    epoch = source_date_epoch(project)
    if epoch:
        os.environ["SOURCE_DATE_EPOCH"] = epoch  # reproducible report dates
    split = (lambda s: [x for x in s.split(",") if x])  # noqa: E731
    if args.cmd == "plan":
        m = plan(project, split(args.tags), split(args.variants), Path(os.environ.get("RUNNER_TEMP", "/tmp")))
        print(json.dumps(m, sort_keys=True))
        if os.environ.get("GITHUB_OUTPUT"):
            with open(os.environ["GITHUB_OUTPUT"], "a", encoding="utf-8") as f:
                f.write("matrix=" + json.dumps(m, separators=(",", ":"), sort_keys=True) + "\n")
                f.write("any=" + ("true" if m["include"] else "false") + "\n")
        return 0
    if args.cmd == "cell":
        return 0 if run_cell(project, json.loads(args.cell), args.out, tuple(split(args.skip)))["ok"] else 1
    if args.cmd == "payload":
        doc = payload(project, args.cells, args.out, args.base_lock)
        print(f"upstream: payload {'ready' if doc['ready'] else 'NOT ready'}: {len(doc['files'])} file(s), "
              f"new pins {', '.join(doc['new_pins']) or 'none'}", flush=True)
        return 0 if doc["ready"] else 1
    out = args.out.resolve()
    m = plan(project, split(args.tags), split(args.variants), out / "plan")
    base_lock = out / "plan" / "upstream.lock.before"
    shutil.copyfile(project / "upstream.lock", base_lock)
    if not m["include"]:
        print("upstream: no new upstream release to carry", flush=True)
    for cell in m["include"]:
        run_cell(project, cell, out / "cells", tuple(split(args.skip)))
    doc = payload(project, out / "cells", out / "pr", base_lock)
    print(f"upstream: payload {'ready' if doc['ready'] else 'NOT ready'} in {out / 'pr'}: {len(doc['files'])} "
          f"file(s), new pins {', '.join(doc['new_pins']) or 'none'}", flush=True)
    return 0 if doc["ready"] else 1


if __name__ == "__main__":
    sys.exit(main())
