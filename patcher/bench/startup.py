"""The start-up benchmark: commands that run no engine, and the warm build, as a user runs them --
whole `dsadapt` commands in new processes -- next to `python3 -c pass` measured in the same run.

How (docs/benchmarks.md, "Start-up and warm build"): each command runs `repeat` times, each run
right after one run of the anchor, `python3 -c pass` (the python3 on PATH, as the goal says), and
one of dsadapt's own interpreter with `-c pass` (no launcher in between: the stricter anchor), so
load that comes and goes hits all of them alike; the wall times' medians are reported, with the
median CPU time (user + system of the child) beside them, which a loaded machine distorts less. `--help`, `list`, `status` and `report` run in the project itself;
`tags ENGINE` in a scratch copy of the project whose lock points the engine's git remote at a
local bare repository with a few tags (so the network is not what is timed: `git ls-remote` of a
local path takes milliseconds). The warm build is `dsadapt build PIN --variant VARIANT` in a copy
of the project (the user's cache) after one untimed build (checkout, release wheel and output all
there).

Goals: every start-up <= 0.12 s and <= 4x the anchor -- the stricter of the two anchors, dsadapt's
own interpreter, when `python3` on PATH is a slower launcher --; the warm build <= 1 s.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from patcher.base.config import Config
from patcher.formats.lock import Lock, format_lock

START_UP = (("--help",), ("list",), ("status",), ("report",))
GOALS = {"start-up": "≤ 0.12 s and ≤ 4× either anchor", "warm build": "≤ 1 s"}
COLUMNS = ["what", "command", "dsadapt", "CPU", "python3 -c pass", "ratio", "own python -c pass", "ratio to it", "goal",
           "met", "note"]


@dataclass
class StartRow:
    what: str                          # start-up | warm build
    command: str
    wall_s: float | None
    cpu_s: float | None = None
    anchor_s: float | None = None     # `python3 -c pass`, the python3 on PATH (the goal's anchor)
    anchor: str = ""
    note: str = ""
    runs_s: list[float] = field(default_factory=list)
    anchor_runs_s: list[float] = field(default_factory=list)
    own_s: float | None = None        # dsadapt's own interpreter `-c pass` (no launcher in between)

    @property
    def ratio(self) -> float | None:
        return round(self.wall_s / self.anchor_s, 2) if self.wall_s is not None and self.anchor_s else None

    @property
    def own_ratio(self) -> float | None:
        return round(self.wall_s / self.own_s, 2) if self.wall_s is not None and self.own_s else None

    @property
    def met(self) -> bool | None:
        if self.wall_s is None:
            return None
        if self.what == "warm build":
            return self.wall_s <= 1.0
        # against the stricter anchor: dsadapt's own interpreter (a `python3` on PATH may be a launcher
        # such as pyenv's shim, several times slower than the interpreter it starts)
        ratios = [r for r in (self.ratio, self.own_ratio) if r is not None]
        return self.wall_s <= 0.12 and (not ratios or max(ratios) <= 4.0)

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "own_ratio": self.own_ratio, "met": self.met}


def dsadapt_argv() -> list[str]:
    script = Path(sys.executable).with_name("dsadapt")
    return [str(script)] if script.exists() else [sys.executable, "-m", "patcher.cli.main"]


def anchor_argv() -> list[str]:
    """`python3 -c pass`: the python3 a user's shell finds, else this interpreter."""
    return [shutil.which("python3") or sys.executable, "-c", "pass"]


def timed(argv: list[str], env: dict[str, str], cwd: Path | None = None, ok=(0,)) -> tuple[float, float]:
    """(wall, CPU) seconds of one run of `argv` (CPU: user + system of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode not in ok:
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-2:])
        raise RuntimeError(f"{' '.join(argv[:4])} exited {r.returncode}: {tail}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def paired(argv: list[str], env: dict[str, str], repeat: int, cwd: Path | None = None) -> StartRow:
    """`argv` and the anchors alternately, `repeat` times each (one untimed run of `argv` first):
    `python3 -c pass` (the python3 on PATH, which may be a launcher such as pyenv's) and dsadapt's
    own interpreter with `-c pass`."""
    anchor, own = anchor_argv(), [sys.executable, "-c", "pass"]
    timed(argv, env, cwd)  # page cache, .pyc files
    runs, cpus, anchors, owns = [], [], [], []
    for _ in range(repeat):
        anchors.append(timed(anchor, env)[0])
        owns.append(timed(own, env)[0])
        wall, cpu = timed(argv, env, cwd)
        runs.append(wall)
        cpus.append(cpu)
    return StartRow("start-up", "", _median(runs), _median(cpus), _median(anchors), " ".join(["python3", *anchor[1:]]),
                    runs_s=[round(x, 4) for x in runs], anchor_runs_s=[round(x, 4) for x in anchors],
                    own_s=_median(owns))


def _tags_project(cfg: Config, lock: Lock, engine: str, root: Path) -> tuple[Path, dict[str, str]]:
    """A project copy whose lock points `engine`'s git remote at a local bare repo with three tags."""
    src, bare = root / "tags-src", root / "tags.git"
    env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.org",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.org"}
    subprocess.run(["git", "init", "-q", str(src)], check=True, env=env)
    subprocess.run(["git", "-C", str(src), "commit", "-q", "--allow-empty", "-m", "bench"], check=True, env=env)
    pins = [p.tag for p in lock.pins_of(engine)]
    for tag in pins + ["v999.0.0"]:
        subprocess.run(["git", "-C", str(src), "tag", tag], check=True, env=env)
    subprocess.run(["git", "clone", "-q", "--bare", str(src), str(bare)], check=True, env=env)
    proj = root / "tags-project"
    proj.mkdir()
    decl = replace(lock.engines[engine], git=str(bare))
    (proj / "upstream.lock").write_text(format_lock(replace(lock, engines={**lock.engines, engine: decl})),
                                        encoding="utf-8")
    if cfg.patches_root.is_dir():
        shutil.copytree(cfg.patches_root, proj / "patches")
    return proj, {**os.environ, "DSADAPT_PROJECT": str(proj), "DSADAPT_WORKDIR": str(root / "tags-work")}


def run_startup_bench(cfg: Config, lock: Lock, repeat: int = 10, build_pin: str | None = None,
                      build_variant: str = "cpu", progress=None) -> list[StartRow]:
    """Start-up rows (each next to its anchors) and the warm build of `build_pin` (default: the pin
    the stack-operations bench uses, `default_stack_pin`)."""
    say = progress or (lambda m: None)
    if build_pin is None:
        from patcher.bench.stack_ops import default_stack_pin

        build_pin = default_stack_pin(lock)[0]
    dsa = dsadapt_argv()
    env = {**os.environ, "DSADAPT_PROJECT": str(cfg.project), "DSADAPT_WORKDIR": str(cfg.workdir)}
    checkouts = len(list((cfg.workdir / "checkouts").glob("*/*"))) if (cfg.workdir / "checkouts").is_dir() else 0
    rows: list[StartRow] = []
    for args in START_UP:
        say(f"start-up: dsadapt {' '.join(args)} ({repeat} runs next to the anchor)")
        row = paired(dsa + list(args), env, repeat)
        row.command = "dsadapt " + " ".join(args)
        if args == ("status",):
            row.note = f"{checkouts} checkout(s) in the work dir"
        rows.append(row)
    engines = [e for e in sorted(lock.engines) if lock.pins_of(e)]
    engine = build_pin.split("@")[0] if build_pin and build_pin.split("@")[0] in engines else \
        (engines[0] if engines else None)
    if engine is not None:
        with tempfile.TemporaryDirectory(prefix="bench-tags-", dir=cfg.workdir) as tmp:
            proj, tenv = _tags_project(cfg, lock, engine, Path(tmp))
            say(f"start-up: dsadapt tags {engine} (against a local git remote)")
            row = paired(dsa + ["tags", engine], tenv, repeat, cwd=proj)
            row.command = f"dsadapt tags {engine}"
            row.note = "git remote: a local bare repository (the network is not timed)"
            rows.append(row)
    if build_pin and build_pin in lock.pins:
        with tempfile.TemporaryDirectory(prefix="bench-build-", dir=cfg.workdir) as tmp:
            rows.append(_warm_build(cfg, dsa, Path(tmp), build_pin, build_variant, max(3, repeat // 2), say))
    return rows


def _warm_build(cfg: Config, dsa: list[str], root: Path, pin: str, variant: str, repeat: int, say) -> StartRow:
    """`dsadapt build` in a copy of the project (its own work dir and dist/; the user's cache, artifact
    folders and sources), after one untimed build that makes the checkout and the output."""
    proj = root / "project"
    proj.mkdir()
    shutil.copy2(cfg.lock_path, proj / "upstream.lock")
    if cfg.patches_root.is_dir():
        shutil.copytree(cfg.patches_root, proj / "patches")
    env = {**os.environ, "DSADAPT_PROJECT": str(proj), "DSADAPT_WORKDIR": str(root / "work"),
           "DSADAPT_CACHE": str(cfg.cache), "DSADAPT_SOURCES": ",".join(cfg.sources),
           "DSADAPT_ARTIFACTS": ":".join(str(d) for d in cfg.artifact_dirs)}
    if cfg.mirrors:
        env["DSADAPT_MIRRORS"] = ";".join(f"{k}={','.join(map(str, v))}" for k, v in cfg.mirrors.items())
    argv = dsa + ["build", pin, "--variant", variant]
    cmd = f"dsadapt build {pin} --variant {variant}"
    say(f"warm build: {cmd} (one untimed build first)")
    try:
        timed(argv, env, cwd=proj)
        runs = [timed(argv, env, cwd=proj) for _ in range(repeat)]
    except RuntimeError as e:
        return StartRow("warm build", cmd, None, note=f"not measured: {e}")
    return StartRow("warm build", cmd, _median([w for w, _c in runs]), _median([c for _w, c in runs]),
                    note="the checkout, the release wheel and the output already there",
                    runs_s=[round(w, 3) for w, _c in runs])


# ---------------------------------------------------------------- formatting (pure)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def startup_table(rows: list[StartRow]) -> list[list[str]]:
    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}×"

    return [[r.what, r.command, _s(r.wall_s), _s(r.cpu_s), _s(r.anchor_s), x(r.ratio), _s(r.own_s), x(r.own_ratio),
             GOALS.get(r.what, "-"), {True: "yes", False: "NO", None: "-"}[r.met], r.note or "-"] for r in rows]
