"""Runners of the equivalence gate: standalone scripts run in their own environment.

A runner is one script (stdlib + its engine + the runner protocol ``dsadapt_runner``, never
`patcher`) with the common command line

    PYTHON SCRIPT --model DIR --prompts prompts.json --dtype DTYPE \
        --top-k K --max-tokens N --out report.json [--fingerprint SHA]

that writes a ``dsadapt.logit-report/1`` document (`dsadapt_runner.py` says what it holds;
`patcher.rules.logits` reads it). The HF reference's runner lives here (`REFERENCE_RUNNER`);
each engine's runner lives in its engine's package and is declared once, by its adapter
(`Engine.runner`). `run_runner` executes a `RunnerSpec` with a given interpreter, puts the
protocol module on its PYTHONPATH, captures its log next to the report, and turns every
failure into a typed `RunnerError`.
"""

from __future__ import annotations

import json
import os
import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from patcher.base.errors import DsadaptError, EngineRunFailed, EngineUnavailable
from patcher.base.procs import run_logged

if TYPE_CHECKING:
    from patcher.rules.logits import LogitReport
    from patcher.rules.prompts import Prompt

HERE = Path(__file__).resolve().parent
#: The directory of the runner protocol module (dsadapt_runner.py): first on every runner's PYTHONPATH.
KIT_DIR = HERE
LOG_TAIL_LINES = 30


class RunnerError(DsadaptError):
    """A runner did not produce a usable report. `log_tail` holds its last lines."""

    def __init__(self, message: str, hint: str | None = None, log_tail: str = "", log_path: Path | None = None):
        super().__init__(message, hint)
        self.log_tail = log_tail
        self.log_path = log_path


class RunnerFailed(RunnerError, EngineRunFailed):
    """The runner exited with a non-zero status (engine failed to load or run)."""


class RunnerTimeout(RunnerError):
    """The runner ran past its time limit and was killed."""


class RunnerOutputError(RunnerError):
    """The runner exited 0 but its report is missing, malformed or inconsistent."""


class RunnerUnavailable(EngineUnavailable):
    """The interpreter or the script for a runner does not exist."""


@dataclass(frozen=True)
class RunnerSpec:
    """How to run one runner: its script, fixed environment, extra arguments, and the
    dtypes it supports (first = default)."""

    name: str
    script: Path
    env: Mapping[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("float32",)

    def argv(self, python: Path, model_dir: Path, prompts_path: Path, dtype: str, top_k: int, max_tokens: int,
             out: Path, fingerprint: str | None = None) -> list[str]:
        args = [str(python), str(self.script), "--model", str(model_dir), "--prompts", str(prompts_path),
                "--dtype", dtype, "--top-k", str(top_k), "--max-tokens", str(max_tokens), "--out", str(out)]
        if fingerprint:
            args += ["--fingerprint", fingerprint]
        return args + list(self.extra_args)


#: The reference side of the gate: HF transformers on CPU (not an engine; it runs in the
#: reference environment, patcher.gate.equivalence.reference_python).
REFERENCE_RUNNER = RunnerSpec("hf_reference", HERE / "hf_reference.py",
                              dtypes=("float32", "float64", "bfloat16", "float16", "fp8"))

#: The reference keeps this many top logprobs per position (wider than any engine's k).
REFERENCE_TOP_K = 20


_ERROR_LINE = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (.*)$")
#: Wrapper errors that only say "see above"; the cause is an earlier error line.
_WRAPPERS = ("Engine core initialization failed", "See root cause above", "Worker failed")


def kit_pythonpath(env: Mapping[str, str]) -> str:
    """PYTHONPATH for a script that imports the runner protocol: KIT_DIR first, then `env`'s own."""
    return os.pathsep.join([str(KIT_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])


def root_cause(lines: Sequence[str]) -> str | None:
    """The most telling exception line of a runner's log: the first ``XError: ...`` line
    that is not a wrapper saying "see above" (vLLM's engine-core failure), else the last
    error line, else None. Worker-process prefixes such as ``(Worker pid=1) ERROR ...]``
    are stripped."""
    found = [m for m in (_ERROR_LINE.search(ln) for ln in lines) if m]
    real = [m for m in found if not any(w in m.group(2) for w in _WRAPPERS)]
    pick = real[0] if real else (found[-1] if found else None)
    return f"{pick.group(1)}: {pick.group(2)}".strip() if pick else None


@dataclass(frozen=True)
class RunnerJob:
    """What a runner is asked to do (its protocol's common arguments): the model, the prompts (the
    set itself, or a prompts.json path), the dtype, how many logprobs each position reports, how
    many tokens to generate, and where its report goes."""

    model_dir: Path
    prompts: Sequence[Prompt] | Path
    dtype: str
    top_k: int
    max_tokens: int
    out: Path
    fingerprint: str | None = None   # the model's, recorded in the report


def run_runner(spec: RunnerSpec, python: Path, job: RunnerJob, *, env: Mapping[str, str] | None = None,
               timeout: float = 900.0, on_line: Callable[[str], None] | None = None) -> LogitReport:
    """Run `spec` with interpreter `python` on `job`; return the validated report written to `job.out`.

    A prompt set (not a path) is written to ``<out>.prompts.json``. The child's stdout+stderr
    go to ``<out>.log`` and, line by line, to `on_line`. Environment: this process's, then
    `spec.env`, then `env`. The child runs in its own session; on timeout its whole process
    group is killed. The report's ``timings.wall_s`` is set to the subprocess' wall time."""
    from patcher.rules.logits import LogitReport, ReportError
    from patcher.rules.prompts import prompts_from_json, write_prompts_json

    python, out, prompts, dtype = Path(python), Path(job.out), job.prompts, job.dtype
    if dtype not in spec.dtypes:
        raise DsadaptError(f"runner {spec.name} does not support dtype {dtype}",
                           hint=f"supported: {', '.join(spec.dtypes)}")
    if not python.exists():
        raise RunnerUnavailable(f"interpreter {python} for runner {spec.name} does not exist",
                                hint="install the engine environment first (`dsadapt install`)")
    if not spec.script.is_file():
        raise RunnerUnavailable(f"runner script {spec.script} is missing")
    out.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(prompts, (str, Path)):
        prompts_path = Path(prompts)
        expected = [p.id for p in prompts_from_json(json.loads(prompts_path.read_text()))]
    else:
        prompts_path = write_prompts_json(list(prompts), out.with_name(out.name + ".prompts.json"))
        expected = [p.id for p in prompts]
    log_path = out.with_name(out.name + ".log")
    out.unlink(missing_ok=True)
    argv = spec.argv(python, job.model_dir, prompts_path, dtype, job.top_k, job.max_tokens, out, job.fingerprint)
    child_env = {**os.environ, **spec.env, **(env or {})}
    child_env["PYTHONPATH"] = kit_pythonpath(child_env)
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    errors: list[str] = []

    def each_line(line: str) -> None:
        tail.append(line)
        if _ERROR_LINE.search(line):
            errors.append(line)
        if on_line:
            on_line(line)

    with open(log_path, "w") as log:
        ran = run_logged(argv, log, timeout, env=child_env, on_line=each_line)
    rc, wall = ran.returncode, ran.wall_s
    tail_text = "\n".join(tail)
    if ran.timed_out:
        raise RunnerTimeout(f"runner {spec.name} ran past {timeout:.0f}s and was killed",
                            hint=f"log: {log_path}\n{tail_text}", log_tail=tail_text, log_path=log_path)
    if rc != 0:
        cause = root_cause(errors) or next((ln for ln in reversed(tail) if ln.strip()), "no output")
        raise RunnerFailed(f"runner {spec.name} exited with status {rc}: {cause[:300]}",
                           hint=f"log: {log_path}\n{tail_text}", log_tail=tail_text, log_path=log_path)
    if not out.is_file():
        raise RunnerOutputError(f"runner {spec.name} exited 0 but wrote no report at {out}",
                                hint=f"log: {log_path}", log_tail=tail_text, log_path=log_path)
    try:
        report = LogitReport.load(out)
    except ReportError as e:
        raise RunnerOutputError(f"runner {spec.name}: {e.message}", hint=f"log: {log_path}",
                                log_tail=tail_text, log_path=log_path) from e
    got = [p.id for p in report.prompts]
    if got != expected or report.dtype != dtype:
        raise RunnerOutputError(f"runner {spec.name} reported prompts {got} in {report.dtype}; "
                                f"asked for {expected} in {dtype}", hint=f"log: {log_path}",
                                log_tail=tail_text, log_path=log_path)
    report.timings["wall_s"] = round(wall, 3)
    return report
