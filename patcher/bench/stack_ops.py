"""The stack-operations benchmark: dsadapt's apply, verify, refresh, rebase and start-up next to raw
git doing the same work, measured in the same run on the same tree.

How (docs/benchmarks.md, "Stack operations"): in a scratch project holding only the benchmark pin
(by default vllm@v0.32.0, whose tree comes from the pinned release wheel), N small patches are
made with git itself (`fast-import` commits on the base, exported with dsadapt's own
`format-patch` settings), one per Python file, for each N of `sizes`. Then, `repeat` times each:

- apply: `dsadapt apply PIN` re-applying a stack of N patches over the previous one (the
  checkout exists, the branch holds another stack); anchor: `git am -3` of the same N patch
  files onto the same base in a clone (the clone is reset outside the timing).
- verify: `dsadapt verify PIN` of a stack whose diffs are unchanged (one commit message differs
  from the last run: its apply and compiles remembered), of one whose last diff is new (git apply
  runs, one file compiles), and cold (every memory removed first, its compile time stated);
  anchor: one `git apply --cached` of the whole stack in a temporary index and object directory
  (`read-tree` of the base before, `write-tree` after).
- refresh: `dsadapt refresh PIN` of the applied branch; anchor: `git format-patch` of the same
  commits into a directory.
Every dsadapt time is a whole command (a new Python process), medians are reported. Start-up:
`dsadapt --help`, `list`, `status` in the real project. Warm rebase OLD -> NEW of the real
stack (both checkouts made beforehand); verify of every pinned stack of the real project.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from patcher.base.config import Config
from patcher.base.errors import UsageError, plural
from patcher.formats.lock import Lock, format_lock, version_key

SIZES = (1, 10, 100, 500, 1000)
ANCHOR_ENV = {**os.environ, "LC_ALL": "C", "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.org"}
TARGETS = {"apply": "≤ 2× anchor from N = 100", "verify": "≤ 2× anchor from N = 100",
           "verify, diff changed": "≤ 2× anchor from N = 100", "verify cold": "stated",
           "refresh": "≤ 3× anchor", "rebase": "≤ 1.5 s", "verify all": "≤ 2 s", "start-up": "≤ 0.12 s"}


@dataclass
class OpRow:
    op: str
    n: int | None
    dsadapt_s: float | None
    anchor_s: float | None = None
    anchor: str = ""
    note: str = ""
    runs_s: list[float] = field(default_factory=list)
    anchor_runs_s: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        if self.dsadapt_s is None or not self.anchor_s:
            return None
        return round(self.dsadapt_s / self.anchor_s, 2)

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


def dsadapt_argv() -> list[str]:
    script = Path(sys.executable).with_name("dsadapt")
    return [str(script)] if script.exists() else [sys.executable, "-m", "patcher.cli.main"]


def _timed(argv: list[str], env: dict[str, str], cwd: Path | None = None, ok=(0,)) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode not in ok:
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-2:])
        raise RuntimeError(f"{' '.join(argv[:4])} exited {r.returncode}: {tail}")
    return dt


def _git(cwd: Path, *args: str, input: bytes | None = None) -> str:
    r = subprocess.run(["git", *args], cwd=cwd, input=input, capture_output=True, check=True,
                       env={**os.environ, "LC_ALL": "C", "GIT_CONFIG_NOSYSTEM": "1"})
    return r.stdout.decode("utf-8", "replace").strip()


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def make_patches(co_path: Path, base: str, n: int) -> str:
    """n commits on `base`, each inserting one comment line into its own Python file (fast-import);
    returns the head commit."""
    candidates = [f for f in _git(co_path, "ls-tree", "-r", "--name-only", base).splitlines()
                  if f.endswith(".py") and "/" in f]
    blobs = subprocess.run(["git", "cat-file", "--batch"], cwd=co_path, capture_output=True, check=True,
                           input="".join(f"{base}:{f}\n" for f in candidates).encode()).stdout
    contents: dict[str, bytes] = {}
    pos = 0
    for f in candidates:
        nl = blobs.index(b"\n", pos)
        size = int(blobs[pos:nl].split()[2])
        data = blobs[nl + 1:nl + 1 + size]
        pos = nl + 1 + size + 1
        if b"\r" not in data and data.count(b"\n") >= 2:  # CRLF files are refused as patches (patch-format.md)
            contents[f] = data
    files = list(contents)[: max(n, 1)]
    if len(files) < n:
        files = (files * (n // max(len(files), 1) + 1))[:n]
    out = []
    for i, f in enumerate(files, 1):
        lines = contents[f].split(b"\n")
        lines.insert(1, f"# dsadapt bench patch {i}".encode())
        contents[f] = b"\n".join(lines)
        msg = (f"bench: patch {i} of {n} ({f.rsplit('/', 1)[-1]})\n\nA small change made by dsadapt bench.\n\n"
               "Upstream-Status: Inappropriate benchmark\nCovered-By: tests/test_bench.py::none\n").encode()
        out.append(b"commit refs/heads/bench-gen\n")
        out.append(b"author Bench <bench@example.org> 1700000000 +0000\n")
        out.append(b"committer Bench <bench@example.org> 1700000000 +0000\n")
        out.append(b"data %d\n%s\n" % (len(msg), msg))
        if i == 1:
            out.append(f"from {base}\n".encode())
        out.append(f"M 100644 inline {f}\n".encode())
        out.append(b"data %d\n%s\n" % (len(contents[f]), contents[f]))
    subprocess.run(["git", "fast-import", "--quiet", "--force"], cwd=co_path, input=b"".join(out), check=True,
                   capture_output=True)
    return _git(co_path, "rev-parse", "refs/heads/bench-gen")


def _apply_anchor(co_path: Path, base: str, files: list[Path], scratch: Path) -> float:
    """One temporary-index `git apply --cached` of the whole stack onto the base (read-tree before,
    write-tree after), in a temporary object directory: what verify's own apply step is."""
    shutil.rmtree(scratch, ignore_errors=True)
    (scratch / "objects").mkdir(parents=True)
    env = {**ANCHOR_ENV, "GIT_INDEX_FILE": str(scratch / "index"), "GIT_OBJECT_DIRECTORY": str(scratch / "objects"),
           "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(co_path / ".git" / "objects")}
    t0 = time.perf_counter()
    for argv in (["read-tree", base], ["apply", "--cached", *map(str, files)], ["write-tree"]):
        subprocess.run(["git", "-C", str(co_path), *argv], env=env, check=True, capture_output=True)
    dt = time.perf_counter() - t0
    shutil.rmtree(scratch, ignore_errors=True)
    return dt


def _verify_cold(argv: list[str], env: dict[str, str], work: Path) -> tuple[float, float, int]:
    """verify with every memory of earlier runs removed first (what compiled, what `git apply` made,
    the parsed patch files): (seconds, of them compiling, files compiled)."""
    import json

    for memory in ("compiled", "verified", "parsed"):
        shutil.rmtree(work / memory, ignore_errors=True)
    t0 = time.perf_counter()
    r = subprocess.run(argv + ["--json"], env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(argv[:4])} exited {r.returncode}: {r.stderr.strip()[-200:]}")
    st = (json.loads(r.stdout).get("stacks") or [{}])[0]
    return dt, float(st.get("compile_s") or 0.0), int(st.get("compiled_now") or 0)


def _verify_changed_diff(argv: list[str], env: dict[str, str], last: Path, n: int, rnd: int) -> float:
    """verify after the last patch's added line changed (a diff no run has seen: git apply runs, the
    changed file is compiled), the file put back afterwards."""
    text = last.read_text(encoding="utf-8")
    line = f"+# dsadapt bench patch {n}\n"
    if line not in text:
        raise RuntimeError(f"{last.name}: the added line {line.strip()!r} is not there")
    last.write_text(text.replace(line, f"+# dsadapt bench patch {n}, changed in round {rnd}\n", 1), encoding="utf-8")
    try:
        return _timed(argv, env, ok=(0, 1))
    finally:
        last.write_text(text, encoding="utf-8")


def _scratch_project(cfg: Config, lock: Lock, pins: list[str], root: Path, stacks: bool) -> tuple[Path, dict]:
    """A project dir with only `pins` (and their engines), its own work dir, the user's cache."""
    proj = root / "project"
    proj.mkdir(parents=True)
    engines = {lock.pins[p].engine for p in pins}
    small = replace(lock, engines={k: v for k, v in lock.engines.items() if k in engines},
                    pins={k: v for k, v in lock.pins.items() if k in pins})
    (proj / "upstream.lock").write_text(format_lock(small), encoding="utf-8")
    if stacks:
        for p in pins:
            e = lock.pins[p]
            src = cfg.patches_root / e.engine / e.tag
            if src.is_dir():
                shutil.copytree(src, proj / "patches" / e.engine / e.tag)
    env = {**os.environ, "DSADAPT_PROJECT": str(proj), "DSADAPT_WORKDIR": str(root / "work"),
           "DSADAPT_CACHE": str(cfg.cache), "DSADAPT_SOURCES": ",".join(cfg.sources),
           "DSADAPT_ARTIFACTS": ":".join(str(d) for d in cfg.artifact_dirs), "DSADAPT_LOCK_TIMEOUT": "60"}
    if cfg.mirrors:
        env["DSADAPT_MIRRORS"] = ";".join(f"{k}={','.join(map(str, v))}" for k, v in cfg.mirrors.items())
    return proj, env


def default_stack_pin(lock: Lock) -> tuple[str, str | None]:
    """(pin, tag to rebase it to) the stack benchmark runs on by default: preferring a pin whose tree
    comes from a release artifact (no GitHub needed), then one with a newer pin of the same engine
    to rebase onto, then the largest source artifact (the largest tree: git's own speed matters
    most there)."""
    pins = lock.sorted_pins()
    if not pins:
        raise UsageError("upstream.lock has no pin to run the stack benchmark on",
                         hint="pin one first (`dsadapt pin ENGINE@TAG`), or pass --stack-pin ENGINE@TAG")

    def newer(e) -> str | None:
        later = [o for o in lock.pins_of(e.engine) if version_key(o.tag) > version_key(e.tag)]
        return min(later, key=lambda o: version_key(o.tag)).tag if later else None

    best = max(pins, key=lambda e: (bool(e.artifacts), newer(e) is not None,
                                    max((a.size or 0 for a in e.artifacts), default=0)))
    return str(best.ref), newer(best)


def run_stack_bench(cfg: Config, lock: Lock, pin: str | None = None, sizes=SIZES, repeat: int = 3,
                    rebase_to: str | None = None, progress=None) -> tuple[list[OpRow], dict]:
    """Rows for the stack-operations table and facts about the tree (files, source)."""
    from patcher.base.config import load_config
    from patcher.formats.pinref import parse_pinref
    from patcher.stack.checkout import Checkout

    if pin is None:
        pin, rebase_to = default_stack_pin(lock)
    rows: list[OpRow] = []
    facts: dict = {"pin": pin}
    dsa = dsadapt_argv()
    say = progress or (lambda m: None)
    # start-up, in the real project (no git work for --help; list/status read the lock and checkouts)
    real_env = {**os.environ, "DSADAPT_PROJECT": str(cfg.project), "DSADAPT_WORKDIR": str(cfg.workdir)}
    for args in (["--help"], ["list"], ["status"]):
        runs = [_timed(dsa + args, real_env) for _ in range(max(repeat, 5))]
        rows.append(OpRow("start-up", None, _median(runs), note=f"dsadapt {' '.join(args)}", runs_s=runs))
    if pin not in lock.pins:
        rows.append(OpRow("apply", None, None, note=f"not measured: {pin} is not pinned"))
        return rows, facts
    ref = parse_pinref(pin)
    root = cfg.workdir / f"bench-stack-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        proj, env = _scratch_project(cfg, lock, [pin], root, stacks=False)
        scfg = load_config(proj, env=env)
        (proj / "patches" / ref.engine / ref.tag).mkdir(parents=True)
        (proj / "patches" / ref.engine / ref.tag / "series").write_text("")
        say(f"materializing {pin} (untimed)")
        _timed(dsa + ["apply", pin], env)
        co = Checkout(scfg, ref)
        base = co.base()
        facts["files"] = len(_git(co.path, "ls-tree", "-r", "--name-only", base).splitlines())
        facts["source"] = (co.load().source or {}).get("kind")
        nmax = max(sizes)
        say(f"making {plural(nmax, 'patch')} with git fast-import (untimed)")
        head = make_patches(co.path, base, nmax)
        from patcher.base.gitutil import Git
        from patcher.formats.stackfiles import write_stack
        from patcher.stack.refresh import export_commits

        patches = export_commits(Git(co.path), base, head)
        _git(co.path, "update-ref", "-d", "refs/heads/bench-gen")
        anchor = root / "anchor"
        _git(root, "clone", "-q", "--shared", "--no-checkout", str(co.path), str(anchor))
        d = proj / "patches" / ref.engine / ref.tag
        for n in sorted(sizes):
            say(f"N = {n}")
            stacks = []
            for variant in ("a", "b"):  # two stacks that differ in one word of the last message
                vp = list(patches[:n])
                last = vp[-1]
                vp[-1] = replace(last, body=last.body + f" (variant {variant})")
                stacks.append(vp)
            write_stack(d, stacks[1])
            _timed(dsa + ["apply", pin], env)  # the checkout now holds the other stack: each apply re-applies
            _timed(dsa + ["verify", pin], env, ok=(0, 1))  # the stack's blobs compiled once (untimed)
            apply_runs, am_runs, verify_runs, refresh_runs, fp_runs = [], [], [], [], []
            cold_runs, compile_runs, anchor_runs, changed_runs = [], [], [], []
            compiled = 0
            for r in range(repeat):
                write_stack(d, stacks[r % 2])
                files = [d / name for name in sorted(p.name for p in d.glob("*.patch"))]
                apply_runs.append(_timed(dsa + ["apply", pin], env))
                verify_runs.append(_timed(dsa + ["verify", pin], env, ok=(0, 1)))
                cold, comp, compiled = _verify_cold(dsa + ["verify", pin], env, root / "work")
                cold_runs.append(cold)
                compile_runs.append(comp)
                anchor_runs.append(_apply_anchor(co.path, base, files, root / "anchor-index"))
                refresh_runs.append(_timed(dsa + ["refresh", pin], env))
                _git(anchor, "checkout", "-q", "-f", "--detach", base)
                am_runs.append(_timed(["git", "-C", str(anchor), "am", "-3", "-q", *map(str, files)], ANCHOR_ENV))
                out = root / f"fp-{n}-{r}"
                fp_runs.append(_timed(["git", "-C", str(co.path), "format-patch", "-q", "--full-index", "--binary",
                                       "--no-stat", "--zero-commit", "--no-signature", "-o", str(out),
                                       f"{base}..refs/heads/{co.branch}"], ANCHOR_ENV))
                shutil.rmtree(out, ignore_errors=True)
                changed_runs.append(_verify_changed_diff(dsa + ["verify", pin], env, files[-1], n, r))
            am = _median(am_runs)
            rows.append(OpRow("apply", n, _median(apply_runs), am, "git am -3 of the same files", runs_s=apply_runs,
                              anchor_runs_s=am_runs))
            apply_anchor = _median(anchor_runs)
            rows.append(OpRow("verify", n, _median(verify_runs), apply_anchor,
                              "one temp-index git apply --cached of the whole stack",
                              note="unchanged diffs (one message reworded): the apply remembered, nothing compiled",
                              runs_s=verify_runs, anchor_runs_s=anchor_runs))
            rows.append(OpRow("verify, diff changed", n, _median(changed_runs), apply_anchor,
                              "one temp-index git apply --cached of the whole stack",
                              note="the last patch's diff new: git apply runs, one file compiled",
                              runs_s=changed_runs, anchor_runs_s=anchor_runs))
            rows.append(OpRow("verify cold", n, _median(cold_runs), apply_anchor,
                              "one temp-index git apply --cached of the whole stack",
                              note=f"no memory (apply, parses, compiles): {_median(compile_runs):.2f} s of it compile "
                                   f"{compiled} file(s)", runs_s=cold_runs, anchor_runs_s=anchor_runs))
            rows.append(OpRow("refresh", n, _median(refresh_runs), _median(fp_runs), "git format-patch of the same commits",
                              runs_s=refresh_runs, anchor_runs_s=fp_runs))
        if rebase_to:
            rows += _bench_rebase(cfg, lock, pin, rebase_to, root, repeat, say)
        rows += _bench_verify_all(cfg, lock, root, repeat, say)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows, facts


def _bench_rebase(cfg: Config, lock: Lock, pin: str, to_tag: str, root: Path, repeat: int, say) -> list[OpRow]:
    from patcher.formats.pinref import parse_pinref

    old = parse_pinref(pin)
    new = f"{old.engine}@{to_tag}"
    if new not in lock.pins:
        return [OpRow("rebase", None, None, note=f"not measured: {new} is not pinned")]
    dsa = dsadapt_argv()
    sub = root / "rebase"
    try:
        proj, env = _scratch_project(cfg, lock, [pin, new], sub, stacks=True)
        shutil.rmtree(proj / "patches" / old.engine / to_tag, ignore_errors=True)
        say(f"making the checkouts of {pin} and {new} (untimed)")
        _timed(dsa + ["apply", pin], env)
        (proj / "patches" / old.engine / to_tag).mkdir(parents=True)
        (proj / "patches" / old.engine / to_tag / "series").write_text("")
        _timed(dsa + ["apply", new], env)
        shutil.rmtree(proj / "patches" / old.engine / to_tag)
        runs = []
        for _ in range(repeat):
            runs.append(_timed(dsa + ["rebase", pin, "--onto", to_tag], env))
            shutil.rmtree(proj / "patches" / old.engine / to_tag)
        n = len([x for x in (cfg.patches_root / old.engine / old.tag / "series").read_text().splitlines()
                 if x.strip() and not x.startswith("#")])
        return [OpRow("rebase", n, _median(runs), note=f"warm: {pin} → {to_tag}, both checkouts made beforehand",
                      runs_s=runs)]
    except (RuntimeError, OSError) as e:
        return [OpRow("rebase", None, None, note=f"not measured: {e}")]


def _bench_verify_all(cfg: Config, lock: Lock, root: Path, repeat: int, say) -> list[OpRow]:
    dsa = dsadapt_argv()
    sub = root / "verify-all"
    pins = sorted(lock.pins)
    proj, env = _scratch_project(cfg, lock, pins, sub, stacks=True)
    say("verify of every stack: first run makes the checkouts (untimed)")
    try:
        _timed(dsa + ["verify"], env, ok=(0, 1, 6))
        runs = [_timed(dsa + ["verify"], env, ok=(0, 1, 6)) for _ in range(repeat)]
    except RuntimeError as e:
        return [OpRow("verify all", None, None, note=f"not measured: {e}")]
    r = subprocess.run(dsa + ["verify", "--json"], env=env, capture_output=True, text=True)
    import json

    try:
        data = json.loads(r.stdout)
        stacks = len(data["stacks"])
        unverifiable = data.get("unverifiable") or []
        ok = sum(1 for x in data["stacks"] if x.get("ok"))
    except (ValueError, KeyError):
        stacks, unverifiable, ok = 0, [], 0
    note = f"{stacks} stacks ({ok} verified ok), warm"
    if unverifiable:
        note += f"; not verifiable here (no source): {', '.join(unverifiable)}"
    return [OpRow("verify all", stacks, _median(runs), note=note, runs_s=runs)]


# ---------------------------------------------------------------- formatting (pure)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def stack_table(rows: list[OpRow]) -> list[list[str]]:
    starts = [r.dsadapt_s for r in rows if r.op == "start-up" and r.dsadapt_s is not None]
    start = min(starts) if starts else None
    out = []
    for r in rows:
        ratio = f"{r.ratio:.2f}×" if r.ratio is not None else "-"
        note = r.note
        if not note and start is not None and r.anchor_s is not None and r.anchor_s < start:
            note = f"start-up bound: raw git takes less than dsadapt's start-up ({start:.2f} s)"
        out.append([r.op, "-" if r.n is None else str(r.n), _s(r.dsadapt_s), _s(r.anchor_s), r.anchor or "-", ratio,
                    TARGETS.get(r.op, "-"), note or "-"])
    return out


STACK_COLUMNS = ["operation", "N", "dsadapt", "raw git", "raw git does", "ratio", "target", "note"]
