"""dsadapt perf: run the patched and the unpatched build of one pin side by side and compare speed.

`run_perf` resolves the pin, the model and both environments (the same ones `dsadapt check`
and `dsadapt check --unpatched` use, lent by `hosts.RunHost`), then `measure` does the
engine-independent part with the engine's recipe (`Engine.perf_recipe`,
patcher/engines/<engine>/perf.py):

1. both servers start at once on 127.0.0.1 (free ports), each under the guard of
   `patcher.base.procs` in its own process group, pinned to the same CPU set; the run waits until both serve;
2. one load generator (the recipe's tool, from the baseline's environment, so both sides
   get the identical client) starts and stays up;
3. warm-up rounds, then measured rounds in the `perf.schedule` order (sides alternate);
   a sampler thread records each server group's resident memory (and GPU memory);
4. whatever happens (error, Ctrl-C, SIGTERM, time limit) the servers and the load generator
   are stopped, and if this process is killed outright their guards stop them.

Then `perf.build_points` / `perf.decide` give the verdict, and the report (JSON + PNG) is
written where `dsadapt check` writes its reports.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patcher.base.config import Config
from patcher.base.errors import EngineUnavailable, MachineError, UsageError
from patcher.base.machine import device_description
from patcher.base.procs import (
    Guarded,
    free_port,
    gpu_memory,
    group_members,
    group_rss,
    http_ok,
    log_tail,
    repin,
    start_guarded,
)
from patcher.engines.base import SINGLE, Parallel, VariantSpec
from patcher.engines.registry import engine
from patcher.engines.serving import LoadJob, PerfRecipe, ServeSettings
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.pinref import PinRef
from patcher.gate.result import GateRun
from patcher.rules import speed

#: Seconds a server may take to start serving (model load; vLLM on 2 CPU cores: 35-90 s).
SERVER_START_S = 900.0
SAMPLE_S = 0.5


class PerfRunError(MachineError):
    """The measurement could not be completed (load generator failure, time limit): no verdict (exit 7)."""


class BaselineUnavailable(EngineUnavailable):
    """The baseline (unpatched) engine cannot serve the model: nothing to compare with."""


class ServerFailed(MachineError):
    """A server exited before (or while) it served: for the build under test that is a verdict,
    for the baseline `BaselineUnavailable`, otherwise the machine's failure (exit 7)."""

    def __init__(self, side: str, message: str, log_path: Path, hint: str | None = None):
        super().__init__(message, hint)
        self.side = side
        self.log_path = log_path


@dataclass
class PerfResult(GateRun):
    mode: str                       # patched-vs-unpatched | aa
    sides: list[str]
    verdict: str
    reasons: list[str]
    threshold: float
    workload: dict
    points: list[dict]
    band: dict
    report_path: str
    plot_path: str | None
    provenance: dict
    timings: dict
    runs: list[dict] = field(repr=False, default_factory=list)
    #: each server's parallel configuration (`Parallel.to_json`): both sides run the same
    parallel: dict = field(default_factory=SINGLE.to_json)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_json(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- processes


@dataclass
class Server:
    side: str
    proc: Guarded
    url: str
    ready_url: str


class MemorySampler:
    """Peak resident memory of each side's server group, sampled in a thread every `SAMPLE_S`, and
    GPU memory, sampled between runs (a tiny model's GPU memory is what the server allocated at
    start: its KV cache and weights)."""

    def __init__(self, groups: dict[str, int]):
        self.groups = groups
        self.peak: dict[str, int] = {s: 0 for s in groups}
        self.window: dict[str, int] = {s: 0 for s in groups}
        self.gpu_peak: dict[str, int | None] = {s: None for s in groups}
        self.gpu_window: dict[str, int | None] = {s: None for s in groups}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def reset_window(self) -> None:
        with self._lock:
            self.window = {s: 0 for s in self.groups}
            self.gpu_window = {s: None for s in self.groups}

    def sample(self, gpu_too: bool = True) -> None:
        """Resident memory of every group now; GPU memory too unless `gpu_too` is False (the
        background loop: `nvidia-smi` takes driver locks, so it runs between runs, never during one)."""
        rss = {s: group_rss(g) for s, g in self.groups.items()}
        gpu: dict[str, int | None] = {}
        if gpu_too:
            for s, g in self.groups.items():
                try:
                    gpu[s] = gpu_memory(group_members(g))
                except (OSError, ValueError, TimeoutError):
                    gpu[s] = None
        with self._lock:
            for s, v in rss.items():
                self.peak[s] = max(self.peak[s], v)
                self.window[s] = max(self.window[s], v)
            for s, g_bytes in gpu.items():
                if g_bytes is not None:
                    self.gpu_peak[s] = max(self.gpu_peak[s] or 0, g_bytes)
                    self.gpu_window[s] = max(self.gpu_window[s] or 0, g_bytes)

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with contextlib.suppress(Exception):  # sampling must never break a run
                self.sample(gpu_too=False)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the run like Ctrl-C does (servers stopped in `finally`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: thread-pool tuning variables of the OpenMP runtimes engines use: a server gets the recipe's, never ours
THREAD_ENV_PREFIXES = ("OMP_", "KMP_", "GOMP_")


def _env(extra: dict[str, str], engine_prefixes: Sequence[str] = ()) -> dict[str, str]:
    """The environment of a server or load generator: ours without tuning variables (the engine's
    own, `Engine.env_prefixes`, and the OpenMP runtimes'), the recipe's `extra`, and the runner
    protocol (dsadapt_runner) on PYTHONPATH."""
    from patcher.runners.launch import kit_pythonpath

    drop = (*engine_prefixes, *THREAD_ENV_PREFIXES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    env["PYTHONPATH"] = kit_pythonpath(env)
    return env


def start_server(side: str, recipe: PerfRecipe, python: Path, settings: ServeSettings, work: Path,
                 cpus: Sequence[int], deadline_s: float, avoid: Sequence[int] = (),
                 env_prefixes: Sequence[str] = ()) -> Server:
    port = free_port(avoid=avoid)
    cmd = recipe.server_command(python, port, settings)
    proc = start_guarded(f"{side} server", cmd.argv, log_path=work / f"server-{side}.log",
                         env=_env(cmd.env, env_prefixes),
                         cwd=work, deadline_s=deadline_s, cpus=cpus, grace_s=10)
    url = f"http://127.0.0.1:{port}"
    return Server(side, proc, url, url + cmd.ready_path)


def wait_ready(servers: Sequence[Server], timeout_s: float, progress=None) -> None:
    """Until every server answers its ready URL; ServerFailed (with the log's root cause) when one exits."""
    from patcher.runners.launch import root_cause

    t0 = time.monotonic()
    pending = list(servers)
    while pending:
        for s in list(pending):
            if not s.proc.alive():
                text = Path(s.proc.log_path).read_text(errors="replace").splitlines()
                cause = root_cause(text) or next((ln for ln in reversed(text) if ln.strip()), "no output")
                raise ServerFailed(s.side, f"the {s.side} server exited before it served the model: {cause[:300]}",
                                   s.proc.log_path, hint=f"log: {s.proc.log_path}\n{log_tail(s.proc.log_path, 15)}")
            if http_ok(s.ready_url):
                pending.remove(s)
                if progress:  # a phase of its own only while another server is still loading
                    rest = " and ".join(x.side for x in pending)
                    progress(f"{s.side} server ready at {s.url} after {time.monotonic() - t0:.0f} s"
                             + (f"; waiting for the {rest} server" if rest else ""))
        if pending and time.monotonic() - t0 > timeout_s:
            names = ", ".join(s.side for s in pending)
            raise PerfRunError(f"the {names} server did not serve within {timeout_s:.0f} s",
                               hint=f"logs: {', '.join(str(s.proc.log_path) for s in pending)}")
        if pending:
            time.sleep(0.5)


class LoadDriver:
    """The recipe's long-lived load generator; one job at a time."""

    def __init__(self, recipe: PerfRecipe, python: Path, work: Path, cpus: Sequence[int], deadline_s: float,
                 env_prefixes: Sequence[str] = ()):
        cmd = recipe.driver_command(python)
        self.work = work
        self.proc = start_guarded("load generator", cmd.argv, log_path=work / "load.log",
                                  env=_env(cmd.env, env_prefixes),
                                  cwd=work, deadline_s=deadline_s, cpus=cpus, grace_s=5, stdin_pipe=True)
        self.n = 0

    def run(self, job_doc: dict, timeout_s: float) -> None:
        self.n += 1
        done = self.work / "jobs" / f"{self.n:04d}.done.json"
        done.parent.mkdir(parents=True, exist_ok=True)
        done.unlink(missing_ok=True)
        line = json.dumps({**job_doc, "done": str(done)}) + "\n"
        try:
            assert self.proc.proc.stdin is not None
            self.proc.proc.stdin.write(line.encode())
            self.proc.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None
        end = time.monotonic() + timeout_s
        while not done.exists():
            if not self.proc.alive():
                raise self._died()
            if time.monotonic() > end:
                raise PerfRunError(f"the load generator's run {self.n} took more than {timeout_s:.0f} s",
                                   hint=f"log: {self.proc.log_path} (raise --time-limit or shrink the workload)")
            time.sleep(0.05)
        result = json.loads(done.read_text())
        if not result.get("ok"):
            raise PerfRunError(f"the load generator failed: {result.get('error')}",
                               hint=f"log: {self.proc.log_path}\n{log_tail(self.proc.log_path, 15)}")

    def _died(self) -> PerfRunError:
        return PerfRunError("the load generator exited", hint=f"log: {self.proc.log_path}\n"
                            f"{log_tail(self.proc.log_path, 15)}")

    def stop(self) -> None:
        try:
            if self.proc.proc.stdin:
                self.proc.proc.stdin.close()
        except OSError:
            pass
        self.proc.stop(grace_s=5)


# ---------------------------------------------------------------- measuring


@dataclass
class Measurement:
    runs: list[speed.RunRecord]
    peak_rss: dict[str, int]
    peak_gpu: dict[str, int | None]
    timings: dict


@dataclass(frozen=True)
class MeasureSetup:
    """Where and how long `measure` runs: the two sides (the first is the build under test), the
    CPUs of the load generator and of this process (`cpus`), where both servers start
    (`server_cpus`; default `cpus` and the compute cores), the time limit of the whole measurement
    and of a server's start, and the environment variables of the engine's own that a server or the
    load generator must not inherit from this process (`Engine.env_prefixes`)."""

    sides: tuple[str, str] = (speed.PATCHED, speed.UNPATCHED)
    cpus: tuple[int, ...] = ()
    server_cpus: tuple[int, ...] | None = None
    time_limit_s: float = 3600.0
    server_start_s: float = SERVER_START_S
    env_prefixes: tuple[str, ...] = ()


def measure(recipe: PerfRecipe, pythons: dict[str, Path], settings: ServeSettings, workload: speed.Workload, work: Path,
            setup: MeasureSetup = MeasureSetup(), progress: Callable[[str], None] | None = None,
            on_servers: Callable[[dict[str, Server]], None] | None = None) -> Measurement:
    """Serve both sides, warm up, run the schedule; always stop every process it started.

    `pythons` maps each side to the interpreter of its environment; the load generator runs
    with the second side's (the baseline's). Both servers get the same CPUs (`Placement`):
    they start on `setup.server_cpus`; once they serve, on CPU builds each of their threads moves
    to `setup.cpus` except the compute threads the engine bound to `settings.compute_cpus` itself.
    The load generator -- and this process, while it measures -- run on `setup.cpus`. Every run
    (warm-up or measured) is preceded by an untimed wake-up request (`wakeup_requests`), so neither
    side is measured straight out of idling while the other ran. Raises ServerFailed (a side did
    not serve), PerfRunError (load generator, time limit) or KeyboardInterrupt (Ctrl-C, SIGTERM)."""
    t_start = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    timings: dict = {}
    with ExitStack() as stack, _sigterm_as_interrupt():
        # this thread and the sampler thread started from it stay off the servers' cores (every
        # process started below gets its CPUs from its guard, not from us)
        stack.enter_context(_pinned_self(setup.cpus))
        servers, sampler = _serve_both(stack, recipe, pythons, settings, work, setup, progress, on_servers)
        timings["servers_ready_s"] = round(time.monotonic() - t_start, 2)
        driver = LoadDriver(recipe, pythons[setup.sides[1]], work, setup.cpus, setup.time_limit_s + 60,
                            setup.env_prefixes)
        stack.callback(driver.stop)
        t_runs = time.monotonic()
        runs = _run_schedule(recipe, servers, sampler, driver, settings, workload, work,
                             t_start + setup.time_limit_s, setup, progress)
        timings["runs_s"] = round(time.monotonic() - t_runs, 2)
        sampler.sample()
        peak_rss, peak_gpu = dict(sampler.peak), dict(sampler.gpu_peak)
    timings["measure_s"] = round(time.monotonic() - t_start, 2)
    return Measurement(runs, peak_rss, peak_gpu, timings)


def _serve_both(stack: ExitStack, recipe: PerfRecipe, pythons: dict[str, Path], settings: ServeSettings, work: Path,
                setup: MeasureSetup, progress, on_servers) -> tuple[dict[str, Server], MemorySampler]:
    """Both servers started at once, each stopped when `stack` closes, serving, on their CPUs; the
    memory sampler running."""
    guard_deadline = setup.time_limit_s + 60  # the guards' own backstop, past our own limit
    servers: dict[str, Server] = {}
    start_cpus = tuple(sorted(set(setup.server_cpus) if setup.server_cpus
                              else set(setup.cpus) | set(settings.compute_cpus)))
    for side in setup.sides:  # CPU builds: start on every core (start-up is imports and loading), pinned once serving
        srv = start_server(side, recipe, pythons[side], settings, work, start_cpus, guard_deadline,
                           avoid=[int(s.url.rsplit(":", 1)[1]) for s in servers.values()],
                           env_prefixes=setup.env_prefixes)
        stack.callback(srv.proc.stop)
        servers[side] = srv
        if progress:
            progress(f"{side} server starting (pid group {srv.proc.pgid}, {srv.url}); log: {srv.proc.log_path}")
    if on_servers:
        on_servers(servers)
    if progress:
        progress(f"waiting for the {' and '.join(setup.sides)} servers to load the model and serve")
    sampler = MemorySampler({s: srv.proc.pgid for s, srv in servers.items()}).start()
    stack.callback(sampler.stop)
    wait_ready(list(servers.values()), min(setup.server_start_s, max(1.0, setup.time_limit_s)), progress)
    if settings.compute_cpus and setup.cpus and set(setup.cpus) != set(start_cpus):
        for srv in servers.values():
            repin(srv.proc.pgid, setup.cpus, keep=settings.compute_cpus)
    return servers, sampler


def _run_schedule(recipe: PerfRecipe, servers: dict[str, Server], sampler: MemorySampler, driver: LoadDriver,
                  settings: ServeSettings, workload: speed.Workload, work: Path, deadline: float,
                  setup: MeasureSetup, progress) -> list[speed.RunRecord]:
    """Every run of the schedule, warm-up first, each a job of the load generator; the measured ones."""
    workload_path = recipe.write_workload(workload.requests(), settings, work)
    plan = speed.schedule(workload.rounds, workload.concurrency, setup.sides, workload.warmup_rounds)
    step, done = _stepper(progress)
    runs: list[speed.RunRecord] = []
    for order, (rnd, conc, side) in enumerate(plan):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PerfRunError(f"the run passed its time limit of {setup.time_limit_s:.0f} s "
                               f"after {order} of {len(plan)} runs",
                               hint="raise --time-limit, or lower --rounds/--requests/--concurrency")
        tag = f"{side}-{'w' if rnd < 0 else 'r'}{abs(rnd)}-c{conc}"
        sent = workload.requests_at(conc)
        job = LoadJob(side, rnd, conc, servers[side].url, workload_path, len(sent),
                      work / "results" / f"{order:03d}-{tag}.json", settings, wakeup_requests(conc))
        job.out_path.parent.mkdir(parents=True, exist_ok=True)
        job.out_path.unlink(missing_ok=True)
        for s, srv in servers.items():
            if not srv.proc.alive():
                raise ServerFailed(s, f"the {s} server died during the run",
                                   srv.proc.log_path, hint=f"log: {srv.proc.log_path}")
        label = f"warm-up {rnd + workload.warmup_rounds + 1}/{workload.warmup_rounds}" if rnd < 0 \
            else f"round {rnd + 1}/{workload.rounds}"
        if step:
            step(f"{label}, concurrency {conc}, {side}")
        sampler.reset_window()
        driver.run(recipe.job(job), remaining)
        sampler.sample()
        parsed = recipe.parse(job, sent)
        rec = speed.RunRecord(side, rnd, conc, parsed.duration_s, parsed.requests, order, parsed.tool,
                              sampler.window.get(side) or None, sampler.gpu_window.get(side))
        if rnd >= 0:
            runs.append(rec)
        if done:
            m = speed.run_metrics(rec)
            done(f"{label}, concurrency {conc}, {side}: {_fmt(m['output_throughput'], '.1f')} tok/s, "
                 f"TTFT {_fmt(m['ttft_mean'], '.0f')} ms, TPOT {_fmt(m['tpot_mean'], '.1f')} ms"
                 + (f", {int(m['failed'] or 0)} failed" if m["failed"] else ""))
    return runs


def wakeup_requests(concurrency: int) -> int:
    """Untimed requests sent to a server right before each of its runs: the server measured next has
    been idle while the other side ran, and its first request would otherwise pay for waking up
    (threads, caches, the allocator) -- a cost the schedule would hand to one side more than to the
    other. One request (the workload's first) wakes every part a run uses; the levels' batch shapes
    were warmed by the warm-up rounds."""
    return 1


def _stepper(progress: Callable[[str], None] | None):
    """(start, done) for one line per run: a progress printer's `step`/`done` when it has them
    (the CLI's), else nothing at the start and the outcome as a plain message."""
    if progress is None:
        return None, None
    step, done = getattr(progress, "step", None), getattr(progress, "done", None)
    if callable(step) and callable(done):
        return step, done
    return None, progress


@contextmanager
def _pinned_self(cpus: Sequence[int]) -> Iterator[None]:
    """The calling thread (and the threads it starts) on `cpus` while it measures -- its waiting and
    memory sampling never run on a core a server computes on --, back on its CPUs afterwards."""
    try:
        before = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        yield
        return
    target = set(cpus) & before
    if not target or target == before:
        yield
        return
    os.sched_setaffinity(0, target)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, before)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


# ---------------------------------------------------------------- the command's core


def default_cpus() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return ()


@dataclass(frozen=True)
class Placement:
    """Which CPUs each process of a perf run gets. Both servers always get the same ones: a
    placement that differs between the sides is a speed difference between them."""

    compute: tuple[int, ...]   # the engine's compute threads (CPU builds; the engine binds them itself)
    servers: tuple[int, ...]   # where both servers start (CPU builds: moved to `load` but compute, once serving)
    load: tuple[int, ...]      # the load generator, and dsadapt itself while it measures


def place(cpus: Sequence[int], device: str, gpu_local: Sequence[int] = ()) -> Placement:
    """Pure: the CPU placement of a run on `cpus`.

    CPU builds: the engine's compute threads get all cores but the last and every other thread --
    each server's API and scheduler processes, the load generator, dsadapt -- the last one (vLLM's
    own CPU auto-binding reserves one core the same way), so the load generator's own CPU cost
    never lands on a compute core. GPU builds: the cores on the GPU's NUMA node (`gpu_local`, when
    known and among `cpus`), a quarter of them (at least one) for the load generator and dsadapt,
    the rest for both servers -- never left to the kernel, which may put one server of the pair
    on the far socket for the whole run."""
    cpus = tuple(cpus)
    if device == "cpu":
        if len(cpus) < 2:
            return Placement(cpus, cpus, cpus)
        return Placement(cpus[:-1], cpus, cpus[-1:])
    local = tuple(c for c in cpus if c in set(gpu_local)) or cpus
    if len(local) < 2:
        return Placement((), local, local)
    k = max(1, len(local) // 4)
    return Placement((), local[:-k], local[-k:])


def parse_cpus(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        out: list[int] = []
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                out += range(int(a), int(b) + 1)
            elif part:
                out.append(int(part))
    except ValueError:
        raise UsageError(f"--cpus {text!r} is not a CPU list", hint="e.g. --cpus 0,1 or --cpus 0-3") from None
    allowed = set(default_cpus())
    bad = [c for c in out if allowed and c not in allowed]
    if not out or bad:
        raise UsageError(f"--cpus {text!r}: {'no CPUs' if not out else f'CPU {bad[0]} is not available here'}",
                         hint=f"this process may use CPUs {','.join(map(str, sorted(allowed)))}")
    return tuple(sorted(set(out)))


def check_threshold(threshold: float) -> None:
    if not 0 < threshold <= 1:
        raise UsageError(f"--threshold {threshold:g} must be in (0, 1]", hint="0.95 means: fail beyond 5 % slower")


def preflight(lock: Lock, ref: PinRef, variant: str | None, dtype: str | None = None,
              command: str | None = None, parallel: Parallel = SINGLE,
              cpus: Sequence[int] | None = None) -> tuple[LockEntry, VariantSpec, PerfRecipe]:
    """What `perf` can tell before it touches anything: the pin, the variant, whether it can run
    here (exit 6; in `parallel`: the engine offers it, the machine has the devices, the recipe
    serves it, and on CPU builds there are that many compute cores besides the service core),
    whether the engine has a speed-gate recipe for it (exit 6) and whether that serves `dtype`
    (exit 2; checked after the machine, as `check` does)."""
    from patcher.gate.plan import runnable

    command = command or f"dsadapt perf {ref}"
    entry, spec = runnable(lock, ref, variant, command, parallel)
    recipe = engine(ref.engine).perf_recipe(entry, spec)
    if recipe is None:
        raise EngineUnavailable(f"{ref}: dsadapt perf has no recipe for {ref.engine} {entry.version} ({spec.name})",
                                hint="docs/speed.md lists the engines the speed gate can serve and load")
    if not parallel.single and not getattr(recipe, "serves_parallel", False):
        raise EngineUnavailable(f"{ref}: dsadapt perf serves {ref.engine} ({spec.name}) in one process only",
                                hint="docs/speed.md says which recipes serve tensor-parallel ranks")
    if not parallel.single and spec.device == "cpu":
        compute = place(tuple(cpus) if cpus else default_cpus(), spec.device).compute
        if len(compute) < parallel.tp:
            raise EngineUnavailable(
                f"{ref} ({spec.name}): dsadapt perf {parallel.describe()} needs {parallel.tp} compute cores, one a "
                f"rank, besides the core it keeps for the load generator and the servers' other processes "
                f"(this machine lends {len(compute) + 1})",
                hint=f"run `{command}` on a machine with at least {parallel.tp + 1} cores")
    if dtype is not None and dtype not in recipe.dtypes:
        raise UsageError(f"--dtype {dtype}: {ref.engine} ({spec.name}) serves {', '.join(recipe.dtypes)}",
                         hint=f"use --dtype {recipe.dtypes[0]}")
    return entry, spec, recipe


@dataclass(frozen=True)
class PerfRequest:
    """What one `dsadapt perf` run is asked to measure (the command line, validated by the CLI)."""

    ref: PinRef
    model: str = "v3"
    config_style: str | None = None
    dtype: str | None = None
    variant: str | None = None
    concurrency: tuple[int, ...] | None = None
    input_lens: tuple[int, ...] | None = None
    output_lens: tuple[int, ...] | None = None
    rounds: int = speed.DEFAULT_ROUNDS
    requests: int | tuple[int, ...] | None = None   # per run; a tuple: one per concurrency level
    warmup_rounds: int = 1
    max_model_len: int = 256
    threshold: float = speed.DEFAULT_THRESHOLD
    aa: bool = False                     # the patched build on both sides (A/A calibration)
    cpus: tuple[int, ...] | None = None
    time_limit_s: float = 3600.0
    parallel: Parallel = SINGLE
    command: str | None = None           # as the user typed it (the report's provenance)

    def workload(self, original_context: int | None) -> speed.Workload:
        return speed.build_workload(original_context=original_context, max_model_len=self.max_model_len,
                                    input_lens=self.input_lens, output_lens=self.output_lens,
                                    concurrency=self.concurrency, rounds=self.rounds, requests=self.requests,
                                    warmup_rounds=self.warmup_rounds)

    @property
    def sides(self) -> tuple[str, str]:
        return (speed.PATCHED, speed.PATCHED + "-2") if self.aa else (speed.PATCHED, speed.UNPATCHED)

    @property
    def mode(self) -> str:
        return "aa" if self.aa else "patched-vs-unpatched"


@dataclass
class _Prepared:
    """What `run_perf` knows before anything is served: the plan of the run and its report's frame."""

    recipe: PerfRecipe
    workload: speed.Workload
    settings: ServeSettings
    where: Placement
    cpus: tuple[int, ...]
    out: Path
    work: Path
    pythons: dict[str, Path]
    common: dict
    provenance: dict
    install_s: float
    env_prefixes: tuple[str, ...]


def run_perf(cfg: Config, lock: Lock, req: PerfRequest, *, progress: Callable[[str], None] | None = None,
             stream: bool = True, on_servers: Callable[[dict[str, Server]], None] | None = None) -> PerfResult:
    """Measure both builds of `req.ref` (or the patched one twice: `req.aa`), judge, write the report."""
    t_start = time.monotonic()
    p = _prepare(cfg, lock, req, progress, stream)
    sides = req.sides
    setup = MeasureSetup(sides, p.where.load, p.where.servers, req.time_limit_s, env_prefixes=p.env_prefixes)
    try:
        m = measure(p.recipe, p.pythons, p.settings, p.workload, p.work, setup, progress, on_servers)
    except ServerFailed as e:
        return _server_failed(req, p, e, t_start)
    points = speed.build_points(m.runs, p.workload.concurrency, sides)
    verdict, reasons = speed.decide(points, req.threshold, sides)
    w = p.workload
    first = speed.order_balance(speed.schedule(w.rounds, w.concurrency, sides, w.warmup_rounds), sides)
    prov = {**p.provenance, "load_average_after": _loadavg(), "peak_rss": m.peak_rss, "peak_gpu": m.peak_gpu,
            "logs": {"work": str(p.work)}, "went_first": {str(c): n for c, n in first.items()},
            "wakeup_requests": {str(c): wakeup_requests(c) for c in w.concurrency}}
    timings = {"install_s": p.install_s, **m.timings, "total_s": round(time.monotonic() - t_start, 2)}
    result = PerfResult(**p.common, verdict=verdict, reasons=reasons, points=[x.to_json() for x in points],
                        band=speed.band(points, req.threshold), plot_path=None, provenance=prov, timings=timings,
                        runs=[r.to_json() for r in m.runs])
    result.plot_path = _plot(result, p.out)
    _write(p.out, result)
    return result


def _prepare(cfg: Config, lock: Lock, req: PerfRequest, progress, stream: bool) -> _Prepared:
    """Preflight, the model and the workload, the placement, both environments, the report's frame."""
    from patcher.base.machine import gpu_local_cpus
    from patcher.formats.stackfiles import load_stack
    from patcher.gate.equivalence import model_fingerprint, report_paths, resolve_model
    from patcher.gate.hosts import RunHost
    from patcher.rules.prompts import rope_original_max

    ref = req.ref
    check_threshold(req.threshold)
    entry, spec, recipe = preflight(lock, ref, req.variant, req.dtype, parallel=req.parallel, cpus=req.cpus)
    eng = engine(ref.engine)
    dtype = req.dtype or recipe.dtypes[0]
    stack = load_stack(cfg.patches_root, ref)
    model_dir, label, style = resolve_model(cfg, req.model, req.config_style or "deepseek", progress)
    original = rope_original_max(json.loads((model_dir / "config.json").read_text()))
    workload = req.workload(original)
    cpus = tuple(req.cpus) if req.cpus else default_cpus()
    where = place(cpus, spec.device, gpu_local_cpus() if spec.device == "cuda" else ())
    settings = ServeSettings(model_dir=model_dir, dtype=dtype, max_model_len=req.max_model_len,
                             max_num_seqs=max(workload.concurrency), device=spec.device, compute_cpus=where.compute,
                             tp=req.parallel.tp, ep=req.parallel.ep)
    out = report_paths(cfg, ref, label, style, dtype, False, kind="perf-aa" if req.aa else "perf",
                       parallel=req.parallel)
    work = cfg.workdir / "runs" / out.relative_to(cfg.reports_root).with_suffix("")
    sides = req.sides
    t0 = time.monotonic()
    host = RunHost(cfg, lock, progress, stream)
    plan = eng.env_plan(entry, spec, lock)
    env_a = host.environment(plan)
    env_b = env_a if req.aa else host.environment(plan, unpatched=True)
    install_s = round(time.monotonic() - t0, 2)
    load_before = _loadavg()
    if progress:
        progress(f"{ref} ({spec.name}) {'A/A: the patched build against itself' if req.aa else 'patched vs unpatched'}"
                 f", model {label} ({style} config), {dtype}, concurrency {','.join(map(str, workload.concurrency))}, "
                 f"{workload.rounds} rounds of {_requests_words(workload)} requests; load average {load_before}")
    provenance = {
        "date": _now(), "device": device_description(), "command": req.command or f"dsadapt perf {ref}",
        "stack_hash": stack.hash, "patches": [e.name for e in stack.entries], "mode": req.mode,
        "installed": {sides[0]: env_a.provenance(), sides[1]: env_b.provenance()},
        "model_fingerprint": model_fingerprint(model_dir, cfg.cache), "model_dir": str(model_dir),
        "original_max_position_embeddings": original, "tool": recipe.tool, "cpus": list(cpus),
        "compute_cpus": list(where.compute), "service_cpus": list(where.load), "server_cpus": list(where.servers),
        "load_average_before": load_before,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
        "dsadapt": _dsadapt_version(),
    }
    common = dict(pin=str(ref), engine=ref.engine, variant=spec.name, model=label, config_style=style, dtype=dtype,
                  mode=req.mode, sides=list(sides), threshold=req.threshold, workload=workload.to_json(),
                  report_path=str(out), parallel=req.parallel.to_json())
    return _Prepared(recipe, workload, settings, where, cpus, out, work, {sides[0]: env_a.python, sides[1]: env_b.python},
                     common, provenance, install_s, tuple(getattr(eng, "env_prefixes", ())))


def _requests_words(w: speed.Workload) -> str:
    per = [len(w.requests_at(c)) for c in w.concurrency]
    return str(per[0]) if len(set(per)) == 1 else "/".join(map(str, per))


def _server_failed(req: PerfRequest, p: _Prepared, e: ServerFailed, t_start: float) -> PerfResult:
    """A side that did not serve: the build under test's failure is a verdict (as `check` says for a
    load failure); the baseline's means nothing to compare with (exit 6); anything else is raised."""
    if e.side == req.sides[0] and not req.aa:
        result = PerfResult(**p.common, verdict="fail", reasons=[e.message], points=[], band={}, plot_path=None,
                            provenance={**p.provenance, "load_average_after": _loadavg(), "server_log": str(e.log_path)},
                            timings={"install_s": p.install_s, "total_s": round(time.monotonic() - t_start, 2)})
        _write(p.out, result)
        return result
    if e.side == req.sides[1]:
        raise BaselineUnavailable(f"the unpatched {req.ref} cannot serve model {p.common['model']} "
                                  f"({p.common['config_style']} config): {e.message.split(': ', 1)[-1]}",
                                  hint="compare on a model both builds load (for vLLM 0.32: --config-style "
                                       f"deepseek); server log: {e.log_path}") from e
    raise e


def _plot(result: PerfResult, out: Path) -> str | None:
    try:
        from patcher.rules.plots import plot_perf

        return str(plot_perf(result.to_json(), out.with_suffix(".png")))
    except ImportError:  # matplotlib is optional
        return None


def rescore(path: Path, threshold: float | None = None, pin: str | None = None) -> PerfResult:
    """Recompute a saved perf report's ratios, verdict and band from its recorded runs with the
    current rule (and `threshold`, default the report's own), and rewrite it and its plot."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a readable perf report ({e})", hint="pass a reports/.../perf-*.json") from None
    if not isinstance(doc, dict) or doc.get("schema") != speed.SCHEMA or not isinstance(doc.get("runs"), list):
        raise UsageError(f"{path}: not a {speed.SCHEMA} report with recorded runs", hint="pass a reports/.../perf-*.json")
    if pin is not None and pin != doc.get("pin"):
        raise UsageError(f"{path} is a report of {doc.get('pin')}, not {pin}", hint=f"name {doc.get('pin')} or no pin")
    threshold = float(doc["threshold"] if threshold is None else threshold)
    check_threshold(threshold)
    sides = tuple(doc["sides"])
    runs = [speed.RunRecord(r["side"], r["round"], r["concurrency"], r["duration_s"],
                        [speed.RequestRecord(**q) for q in r["requests"]], r.get("order", 0), r.get("tool") or {},
                        r.get("peak_rss"), r.get("peak_gpu")) for r in doc["runs"]]
    conc = tuple(doc["workload"]["concurrency"])
    points = speed.build_points(runs, conc, sides) if runs else []
    verdict, reasons = speed.decide(points, threshold, sides) if runs else (doc["verdict"], doc["reasons"])
    prov = {**doc["provenance"], "rescored": {"date": _now(), "dsadapt": _dsadapt_version(), "threshold": threshold}}
    fields = {k: doc[k] for k in ("pin", "engine", "variant", "model", "config_style", "dtype", "mode", "sides",
                                  "workload", "report_path", "timings")}
    result = PerfResult(**fields, verdict=verdict, reasons=reasons, threshold=threshold,
                        points=[p.to_json() for p in points], band=speed.band(points, threshold) if points else {},
                        plot_path=None, provenance=prov, runs=doc["runs"],
                        parallel=doc.get("parallel") or SINGLE.to_json())
    out = Path(path)
    result.report_path = str(out)
    if points:
        result.plot_path = _plot(result, out)
    _write(out, result)
    return result


def _write(out: Path, result: PerfResult) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if result.plot_path is None:
        out.with_suffix(".png").unlink(missing_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"schema": speed.SCHEMA, **result.to_json()}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out)


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _dsadapt_version() -> str:
    from patcher import __version__

    return __version__


def perf_or_raise(result: PerfResult) -> None:
    from patcher.base.errors import CheckFailed

    if not result.passed:
        raise CheckFailed(f"{result.pin} failed the speed gate: {'; '.join(result.reasons[:2])}",
                          hint=f"report: {result.report_path}")

