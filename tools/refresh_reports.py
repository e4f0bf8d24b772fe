"""Regenerate the committed report sets one machine can make (`make reports`): every line of
reports/plan.txt for that machine, run through the product (`dsadapt ... --publish --json`, this
checkout's code), one after the other, with a summary at the end.

    python tools/refresh_reports.py [--machine cpu] [--only PIN] [--start N] [--fresh] [--lock FILE]
                                    [--dry-run] [--plan FILE]

Each command's --json output and stderr are kept in the work dir (`<work dir>/reports-refresh/`,
named in the summary), with its exit status, seconds and the 1-minute load average before and
after it: speed figures from a shared machine are only as good as the load they ran under, and
every perf report records it too. Exit 0 when every command gave the verdict the plan expects (a
pass, or the `=> fail` of a control run), 1 when one gave another verdict, and otherwise the first
error's own exit code (6: cannot run here, e.g. Triton without a mirror of vllm_backend,
`DSADAPT_MIRRORS='triton=/path/to/vllm_backend.git'`); a command that fails never stops the rest.

A run that stops (killed, the machine rebooted) is resumed by running it again: each command that
gave its planned verdict is recorded in `reports-refresh/state.json` as soon as it ends, with a
fingerprint of what its reports depend on (patcher/, patches/, upstream.lock, pyproject.toml, the
plan line), and a later run skips it while that fingerprint holds and its reports are still
there; the command that was running when the run stopped starts again from its beginning (its
reports are each written whole). `--fresh` forgets the record. Every command's seconds are kept
too (`reports-refresh/durations.json`, across fingerprints): `--dry-run` lists the commands with
the time each took last, and a run says at its start how long the remaining ones took then.
The reports a command published are rewritten with every path inside the checkout written from its
root (`--relativize` does it alone, to everything under reports/). `--lock FILE` holds FILE's lock (flock) while each command runs, so that on a shared machine other
engine work waits for the command running and not for the whole refresh.
"""

from __future__ import annotations

import argparse
import fcntl
import gzip
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "reports" / "plan.txt"
MACHINES = ("cpu", "h200", "none")
#: the commands that write a report (the plan's other lines prepare what they read)
REPORTING = ("check", "perf")
#: how a command runs: this checkout's dsadapt under this Python
DSADAPT = (sys.executable, "-m", "patcher.cli.main")


@dataclass(frozen=True)
class PlanLine:
    machine: str
    pin: str | None            # None: a command about no pin (`model make`)
    argv: tuple[str, ...]      # the dsadapt command and its arguments, the pin left out
    expect: str = "pass"
    note: str = ""
    line: int = 0

    @property
    def command(self) -> str:
        return self.argv[0] if self.argv else ""

    def dsadapt_args(self) -> list[str]:
        """The command line after `dsadapt`: COMMAND [PIN] ARGS; --publish and --json for the ones
        that write a report."""
        args = [self.argv[0], *([self.pin] if self.pin else []), *self.argv[1:]]
        return args + (["--publish", "--json"] if self.command in REPORTING else [])


class PlanError(ValueError):
    pass


def parse_plan(text: str) -> list[PlanLine]:
    """Pure: the plan's lines (comments and blank lines left out; `none` lines keep their reason)."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        body, _, comment = raw.partition("#")
        if not body.strip():
            continue
        expect = "pass"
        m = re.search(r"\s=>\s*(\w+)\s*$", body)
        if m:
            expect, body = m.group(1), body[:m.start()]
        words = shlex.split(body)
        if words[0] not in MACHINES:
            raise PlanError(f"line {n}: machine {words[0]!r} is none of {', '.join(MACHINES)}")
        if len(words) < 2 or (words[0] != "none" and len(words) < 3):
            raise PlanError(f"line {n}: MACHINE PIN COMMAND [ARGS...] expected")
        pin = None if words[1] == "-" else words[1]
        if pin is not None and "@" not in pin:
            raise PlanError(f"line {n}: {pin!r} is not ENGINE@TAG")
        if expect not in ("pass", "fail"):
            raise PlanError(f"line {n}: => {expect}: a verdict is pass or fail")
        out.append(PlanLine(words[0], pin, tuple(words[2:]), expect, comment.strip(), n))
    return out


def load_plan(path: Path = PLAN) -> list[PlanLine]:
    return parse_plan(path.read_text(encoding="utf-8"))


@dataclass
class Outcome:
    line: PlanLine
    rc: int
    seconds: float
    verdict: str                   # pass | fail | error | not run
    detail: str = ""
    reports: list[str] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)
    log: str = ""
    earlier: bool = False          # recorded by an earlier run of the same inputs, not run again

    @property
    def as_planned(self) -> bool:
        return self.verdict == self.line.expect


def outcome_of(line: PlanLine, rc: int, stdout: str) -> tuple[str, str, list[str]]:
    """Pure: (verdict, detail, report paths) from a command's exit status and --json output."""
    try:
        doc = json.loads(stdout) if stdout.strip() else {}
    except json.JSONDecodeError:
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    if doc.get("schema") == "dsadapt.error/1" or (rc not in (0, 1) and not doc.get("verdict")):
        err = doc.get("error") or {}
        verdict = "not run" if rc == 6 else "error"
        return verdict, f"{err.get('message') or f'exit {rc}'}" + (f" (hint: {err['hint']})" if err.get("hint") else ""), []
    if line.command not in REPORTING:
        return ("pass" if rc == 0 else "error"), doc.get("path") or "", []
    results = doc.get("results") if doc.get("schema") == "dsadapt.check-dtypes/1" else [doc]
    reports = [str(r.get("report_path")) for r in results or [] if isinstance(r, dict) and r.get("report_path")]
    dtypes = doc.get("dtypes") or {}
    margins = doc.get("margins") if isinstance(doc.get("margins"), dict) else {}
    detail = ", ".join(f"{d} {v}" for d, v in dtypes.items()) or str(margins.get("words") or "")
    if doc.get("verdict") == "fail" and doc.get("reasons"):
        detail = (detail + "; " if detail else "") + str(doc["reasons"][0])[:200]
    return str(doc.get("verdict") or ("pass" if rc == 0 else "fail")), detail, reports


BUILTIN_MODELS = ("v3", "v2-lite", "v2")


def made_models(lines: list[PlanLine]) -> set[str]:
    """Pure: the models the plan makes (`model make ... --out NAME`)."""
    out = set()
    for ln in lines:
        if ln.argv[:2] == ("model", "make") and "--out" in ln.argv:
            out.add(ln.argv[ln.argv.index("--out") + 1])
    return out


def _option(argv: tuple[str, ...], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else None


def chains(lines: list[PlanLine]) -> tuple[str, str, list[str]]:
    """Pure: a machine's lines as the device script runs them: (pin, variant, chain lines) for the
    checks of built-in models, one chain each so that they run side by side (the device script's
    format: CHAIN STACK COMMAND ARGS, the pin, --variant, --publish and --json added by it). The
    lines about made models are `made_commands`'."""
    made = made_models(lines)
    pins = {ln.pin for ln in lines if ln.pin}
    variants = {_option(ln.argv, "--variant") for ln in lines if ln.command in REPORTING}
    if len(pins) != 1 or len(variants) != 1 or None in variants:
        raise PlanError(f"one pin and one --variant per device call, not {sorted(map(str, pins))} / "
                        f"{sorted(map(str, variants))}")
    out = []
    for ln in lines:
        if ln.command not in REPORTING or _option(ln.argv, "--model") in made:
            continue
        args = list(ln.argv[1:])
        i = args.index("--variant")
        del args[i:i + 2]
        out.append(f"c{len(out) + 1} main {ln.command} " + " ".join(args))
    return pins.pop(), variants.pop(), out


def more_chains(mine: list[str], more: str) -> tuple[list[str], list[str]]:
    """Pure: another device chains file's lines (`MORE_CHAINS`, e.g. another measurement sharing the
    call) after the plan's: a line that runs what one of the plan's lines runs (the same command on
    the bundle's own stack) is left out, that report is the plan's and serves both; a chain whose
    name the plan's chains use is renamed NAME-more. Returns (lines, the lines left out)."""
    ours = {tuple(c.split()[1:]) for c in mine}
    names = {c.split()[0] for c in mine}
    out, reused = list(mine), []
    for raw in more.splitlines():
        words = raw.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) < 3:
            raise PlanError(f"chains line {raw.strip()!r}: CHAIN STACK COMMAND [ARGS...] expected")
        if tuple(words[1:]) in ours:
            reused.append(raw.strip())
            continue
        name = f"{words[0]}-more" if words[0] in names and words[0] != "first" else words[0]
        out.append(" ".join([name, *words[1:]]))
    return out, reused


def made_commands(lines: list[PlanLine], models_dir: str) -> list[list[str]]:
    """Pure: the lines that make a model and those that check one, in order, as dsadapt arguments,
    a made model's name put under `models_dir`."""
    made = made_models(lines)
    out = []
    for ln in lines:
        uses = _option(ln.argv, "--model") in made or ln.argv[:2] == ("model", "make")
        if not uses:
            continue
        args = ln.dsadapt_args() + (["--json"] if ln.argv[:2] == ("model", "make") else [])
        for flag in ("--model", "--out"):
            if flag in args and args[args.index(flag) + 1] in made:
                args[args.index(flag) + 1] = f"{models_dir}/{args[args.index(flag) + 1]}"
        out.append(args)
    return out


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def work_dir() -> Path:
    return Path(os.environ.get("DSADAPT_WORKDIR") or ROOT / ".dsadapt")


def run_line(line: PlanLine, index: int, logs: Path, held: tuple[int, ...] = ()) -> Outcome:
    """One command through this checkout's dsadapt. `held`: lock fds the command inherits, so that a
    command outliving a killed refresh keeps them held (no second refresh, no other engine work, starts
    beside it)."""
    args = line.dsadapt_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"]
                                                   if os.environ.get("PYTHONPATH") else "")}
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", " ".join([line.pin or "-", *line.argv]))[:80]
    log = logs / f"{index:02d}-{slug}"
    t0, before = time.monotonic(), _load()
    with open(f"{log}.log", "w", encoding="utf-8") as err:
        proc = subprocess.run([*DSADAPT, "--project", str(ROOT), *args],
                              stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT, pass_fds=held)
    Path(f"{log}.json").write_text(proc.stdout, encoding="utf-8")
    try:
        verdict, detail, reports = outcome_of(line, proc.returncode, proc.stdout)
    except Exception as e:  # noqa: BLE001 - an output this tool cannot read ends nothing but this line
        verdict, detail, reports = "error", f"unreadable --json output ({e.__class__.__name__}: {e})", []
    return Outcome(line, proc.returncode, time.monotonic() - t0, verdict, detail, reports, (before, _load()),
                   f"{log}.log")


#: what a committed report depends on, besides its plan line: a change to any of them is a new run
INPUTS = ("patcher", "patches", "upstream.lock", "pyproject.toml")


def inputs_fingerprint(root: Path = ROOT) -> str:
    """sha256 over the files the reports depend on (INPUTS: names and contents, caches left out)."""
    h = hashlib.sha256()
    for top in INPUTS:
        base = root / top
        files = [base] if base.is_file() else sorted(f for f in base.rglob("*") if f.is_file()
                                                       and "__pycache__" not in f.parts)
        for f in files:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def line_key(line: PlanLine) -> str:
    """Pure: a plan line as the record knows it (its words, not its line number)."""
    return " ".join([line.machine, line.pin or "-", *line.argv, "=>", line.expect])


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _write_json(path: Path, doc: dict) -> None:
    """Written whole: a kill leaves the old record or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def done_earlier(state: dict, fingerprint: str, line: PlanLine, root: Path = ROOT) -> Outcome | None:
    """Pure but for reading whether reports exist: the recorded outcome of `line` when the record is
    of these inputs, it gave its planned verdict and every report it wrote is still there."""
    if state.get("inputs") != fingerprint:
        return None
    rec = (state.get("done") or {}).get(line_key(line))
    if not isinstance(rec, dict) or rec.get("verdict") != line.expect:
        return None
    reports = [str(r) for r in rec.get("reports") or []]
    if not all((root / r).is_file() for r in reports):
        return None
    load = rec.get("load") or [0.0, 0.0]
    return Outcome(line, int(rec.get("rc") or 0), float(rec.get("seconds") or 0.0), str(rec["verdict"]),
                   str(rec.get("detail") or ""), reports, (float(load[0]), float(load[1])), str(rec.get("log") or ""),
                   earlier=True)


def record(state: dict, fingerprint: str, o: Outcome, root: Path = ROOT) -> dict:
    """Pure: the record with `o` in it (a record of other inputs is started again)."""
    if state.get("inputs") != fingerprint:
        state = {"inputs": fingerprint, "done": {}}
    reports = []
    for r in o.reports:
        try:
            reports.append(Path(r).resolve().relative_to(root).as_posix())
        except ValueError:
            reports.append(r)
    done = dict(state.get("done") or {})
    done[line_key(o.line)] = {"verdict": o.verdict, "rc": o.rc, "seconds": round(o.seconds, 1), "detail": o.detail,
                              "reports": reports, "load": list(o.load), "log": o.log}
    return {**state, "done": done}


def estimate(lines: list[PlanLine], durations: dict) -> tuple[float, list[PlanLine]]:
    """Pure: (seconds the lines took when last run here, the lines never run here)."""
    known = [durations[line_key(ln)] for ln in lines if isinstance(durations.get(line_key(ln)), dict)]
    return (sum(float(d.get("seconds") or 0.0) for d in known),
            [ln for ln in lines if not isinstance(durations.get(line_key(ln)), dict)])


def _estimate_words(lines: list[PlanLine], durations: dict) -> str:
    """Pure: what the lines took when last run here, in words."""
    total, unknown = estimate(lines, durations)
    if not lines:
        return "nothing left to do"
    if len(unknown) == len(lines):
        return "none of them has run here yet (no time to go by)"
    return f"{_minutes(total)} when last run here" + (f", and {len(unknown)} never run here" if unknown else "")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


class _Held:
    """FILE's flock while one command runs (`--lock`), said when it has to be waited for."""

    def __init__(self, path: Path | None):
        self.path, self.fd = path, -1

    def __enter__(self) -> _Held:
        if self.path is None:
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"      waiting for {self.path} (other engine work holds it)", flush=True)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *_exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def relative_text(text: str, root: Path = ROOT) -> str:
    """Pure: a report's JSON with every path inside the checkout written from its root
    ("reports/vllm/...", ".dsadapt/venvs/..."): committed reports name no machine's folders."""
    return text.replace(json.dumps(str(root) + "/")[:-1], '"')


def relativize(folder: Path, since: float = 0.0, root: Path = ROOT) -> list[Path]:
    """Rewrite (whole: written beside, then moved) the JSON reports under `folder` changed since
    `since` (their recorded inputs, .json.gz, too) with `relative_text`; returns those it changed."""
    changed = []
    for f in sorted(folder.rglob("*.json")) + sorted(folder.rglob("*.json.gz")):
        if f.stat().st_mtime < since:
            continue
        gz = f.suffix == ".gz"
        raw = f.read_bytes()
        text = (gzip.decompress(raw) if gz else raw).decode("utf-8")
        new = relative_text(text, root)
        if new == text:
            continue
        tmp = f.with_name(f".{f.name}.{os.getpid()}.tmp")
        tmp.write_bytes(gzip.compress(new.encode("utf-8"), mtime=0) if gz else new.encode("utf-8"))
        os.replace(tmp, f)
        changed.append(f)
    return changed


def summary(outcomes: list[Outcome]) -> str:
    """Pure: one line per command, then the count."""
    lines = []
    for o in outcomes:
        mark = "ok " if o.as_planned else "!! "
        lines.append(f"{mark} {o.line.pin or '-':16} {' '.join(o.line.argv):55} {o.verdict:8} "
                     f"(expected {o.line.expect}) {o.seconds:6.0f} s  load {o.load[0]:.1f} -> {o.load[1]:.1f}"
                     + ("  (an earlier run's)" if o.earlier else "")
                     + (f"\n      {o.detail}" if o.detail else ""))
    bad = [o for o in outcomes if not o.as_planned]
    lines.append(f"{len(outcomes)} commands, {len(outcomes) - len(bad)} as planned"
                 + (f", {len(bad)} not: " + "; ".join(f"{o.line.pin or '-'} {' '.join(o.line.argv)}: {o.verdict}"
                                                        for o in bad) if bad else ""))
    return "\n".join(lines)


def exit_code(outcomes: list[Outcome]) -> int:
    """Pure: 0 when every command gave its planned verdict; the first error's exit code (not 0 or 1)
    when one could not give a verdict; 1 when one gave another verdict than planned."""
    for o in outcomes:
        if o.verdict in ("error", "not run"):
            return o.rc if o.rc not in (0, 1) else 7
    return 0 if all(o.as_planned for o in outcomes) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machine", default="cpu", choices=[m for m in MACHINES if m != "none"])
    ap.add_argument("--only", action="append", default=[], metavar="PIN", help="only this pin's lines (repeatable)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--start", type=int, default=1, metavar="N",
                    help="begin at the machine's N-th line (--dry-run numbers them); a run that stopped needs no --start: "
                         "run it again and it resumes")
    ap.add_argument("--fresh", action="store_true",
                    help="run every line again, forgetting what an earlier run of the same inputs finished")
    ap.add_argument("--lock", type=Path, metavar="FILE",
                    help="hold FILE's lock (flock) while each command runs (other engine work on the machine waits "
                         "for that command, not for the whole refresh)")
    ap.add_argument("--relativize", action="store_true",
                    help="only write the paths inside this checkout of every report under reports/ from its root "
                         "(what a run does to the reports it publishes)")
    ap.add_argument("--plan", type=Path, default=PLAN)
    ap.add_argument("--chains", action="store_true",
                    help="print the machine's checks of built-in models as device chains (PIN VARIANT on the first line)")
    ap.add_argument("--more", type=Path, metavar="FILE",
                    help="with --chains: another chains file's lines after the plan's (a line the plan runs too is left "
                         "out, a chain name the plan's use is renamed NAME-more)")
    ap.add_argument("--made", metavar="DIR", help="print the commands that make a model under DIR and check it, "
                                                  "one shell-quoted dsadapt command line each")
    a = ap.parse_args(argv)
    if a.relativize:
        for f in relativize(ROOT / "reports"):
            print(f.relative_to(ROOT))
        return 0
    try:
        lines = [ln for ln in load_plan(a.plan) if ln.machine == a.machine and (not a.only or ln.pin in a.only)]
    except (OSError, PlanError) as e:
        print(f"error: {a.plan}: {e}", file=sys.stderr)
        return 2
    if not lines:
        print(f"error: {a.plan} has no {a.machine} line" + (f" for {', '.join(a.only)}" if a.only else ""),
              file=sys.stderr)
        return 2
    if a.chains or a.made:
        try:
            if a.chains:
                pin, variant, out = chains(lines)
                reused: list[str] = []
                if a.more:
                    out, reused = more_chains(out, a.more.read_text(encoding="utf-8"))
                print(f"{pin} {variant}")
                print("\n".join(out + [f"# run once, by the plan's line: {r}" for r in reused]))
            else:
                for args in made_commands(lines, a.made):
                    print(" ".join(shlex.quote(x) for x in args))
        except (OSError, PlanError) as e:
            print(f"error: {a.plan}: {e}", file=sys.stderr)
            return 2
        return 0
    if not 1 <= a.start <= len(lines):
        print(f"error: --start {a.start}: the {a.machine} lines are 1 to {len(lines)}", file=sys.stderr)
        return 2
    logs = work_dir() / "reports-refresh"
    if a.dry_run:
        return _dry_run(lines[a.start - 1:], a.start, logs, a.fresh)
    logs.mkdir(parents=True, exist_ok=True)
    mine = os.open(logs / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(mine, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"error: another refresh runs in {logs} (or a command of one that was killed still does)",
              file=sys.stderr)
        print("hint: let it end (its commands' logs are there), then run this again: it resumes", file=sys.stderr)
        return 7
    return _run(a, lines, logs, mine)


def _dry_run(lines: list[PlanLine], start: int, logs: Path, fresh: bool) -> int:
    """The commands a run would give, numbered, each with the time it took when last run here (or that an
    earlier run of these inputs did it), and the sum of what is left."""
    durations = _read_json(logs / "durations.json")
    state = {} if fresh else _read_json(logs / "state.json")
    fingerprint = inputs_fingerprint() if state else ""
    left = []
    for i, ln in enumerate(lines, start):
        d = durations.get(line_key(ln))
        if done_earlier(state, fingerprint, ln) is not None:
            took = "  # done by an earlier run of these inputs"
        else:
            left.append(ln)
            took = (f"  # {_minutes(float(d.get('seconds') or 0))} last (load {float((d.get('load') or [0])[0]):.1f})"
                    if isinstance(d, dict) else "  # not run here yet")
        print(f"{i:2d}  dsadapt " + " ".join(shlex.quote(x) for x in ln.dsadapt_args()) + took)
    print(f"{len(left)} to run: " + _estimate_words(left, durations))
    return 0


def _run(a, lines: list[PlanLine], logs: Path, mine: int) -> int:
    state_file, durations_file = logs / "state.json", logs / "durations.json"
    fingerprint = inputs_fingerprint()
    state = {} if a.fresh else _read_json(state_file)
    durations = _read_json(durations_file)
    todo = [(i, ln) for i, ln in enumerate(lines, 1) if i >= a.start]
    earlier = {i: o for i, ln in todo if (o := done_earlier(state, fingerprint, ln)) is not None}
    left = [ln for i, ln in todo if i not in earlier]
    print(f"{len(left)} of {len(todo)} commands to run" + (f" ({len(earlier)} done by an earlier run of these "
                                                            "inputs; --fresh runs them again)" if earlier else "")
          + ": " + _estimate_words(left, durations), flush=True)
    outcomes = []
    for i, ln in todo:
        if i in earlier:
            print(f"[{i}/{len(lines)}] done earlier: dsadapt {' '.join(ln.dsadapt_args())} ({earlier[i].verdict})")
            outcomes.append(earlier[i])
            continue
        print(f"[{i}/{len(lines)}] dsadapt {' '.join(ln.dsadapt_args())}", flush=True)
        started = time.time()
        with _Held(a.lock) as held:
            o = run_line(ln, i, logs, (mine,) + ((held.fd,) if held.fd >= 0 else ()))
        relativize(ROOT / "reports", since=started)
        print(f"      {o.verdict}{' (as planned)' if o.as_planned else f' (planned: {ln.expect})'} in "
              f"{o.seconds:.0f} s, load {o.load[0]:.1f} -> {o.load[1]:.1f}; log {o.log}", flush=True)
        outcomes.append(o)
        if o.verdict in ("pass", "fail"):  # a command that could not run says nothing of how long it takes
            durations[line_key(ln)] = {"seconds": round(o.seconds, 1), "load": list(o.load)}
            _write_json(durations_file, durations)
        if o.as_planned:
            state = record(state, fingerprint, o)
            _write_json(state_file, state)
    print(summary(outcomes))
    print(f"reports published under {ROOT / 'reports'}; `dsadapt report` shows what they say")
    return exit_code(outcomes)


if __name__ == "__main__":
    sys.exit(main())
