"""Running a bisect: the engine's capture, the reference's capture, the report.

The pure comparison is `patcher.rules.modules`; this module has the side effects: capture specs
written next to the run, the HF reference run in capture mode (cached by its inputs), the
bisect report (JSON) and heat map (PNG) next to the check report. `patcher.gate.equivalence` calls in
here when a check captures (``--bisect``, every low-precision check) and `dsadapt bisect`
goes through `run_check` with ``bisect="always"``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from patcher.base.config import Config
from patcher.checkpoints.model_dir import Checkpoint
from patcher.engines.base import Engine
from patcher.rules.divergence import ModuleVerdict, PointAbove
from patcher.rules.logits import REFERENCE_TRANSFORMERS
from patcher.rules.modules import (
    CAPTURE_DECODE_STEPS,
    LOW_PRECISION_DTYPES,
    REFERENCE_TABLE,
    BisectError,
    BisectResult,
    CaptureTable,
    compare_captures,
    first_divergence,
)

ENGINE_CAPTURE = "engine-capture.pt"
REFERENCE_TIMEOUT = 900.0
#: Modes of `run_check(bisect=...)`: capture and compare only when the gate fails, or always.
MODES = ("on-fail", "always")


def table_for(eng: Engine) -> CaptureTable | None:
    """The engine's capture table (its name mapping), or None when it has none."""
    return getattr(eng, "bisect_table", None)


def wanted(dtype: str, mode: str | None) -> str | None:
    """When a check captures: every low-precision check compares modules (part of its verdict),
    float32 checks only on request."""
    if dtype in LOW_PRECISION_DTYPES:
        return "always"
    return mode


def write_spec(table: CaptureTable, config: dict, dtype: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table.spec(config, dtype), indent=1, sort_keys=True) + "\n")
    return path


def capture_args(work: Path, table: CaptureTable, config: dict, dtype: str) -> tuple[str, ...]:
    """Extra runner arguments that make an engine runner capture (its --capture protocol)."""
    spec = write_spec(table, config, dtype, work / f"{table.name}-capture-spec.json")
    out = work / ENGINE_CAPTURE
    for old in [out, *out.parent.glob(out.name + ".rank*")]:  # never read an earlier run's ranks
        old.unlink(missing_ok=True)
    return ("--capture", str(out), "--capture-spec", str(spec), "--capture-decode-steps", str(CAPTURE_DECODE_STEPS))


def load_capture(path: Path) -> dict:
    """A capture document; an engine that ran on several ranks saved one per rank
    (``<path>.rank<r>``, capture.py's `rank_path`): rank 0's document then carries every rank's
    under ``ranks`` (the ones that are there: the comparison says what a missing rank costs)."""
    import torch

    def read(p: Path):
        try:
            return torch.load(p, weights_only=False)
        except (OSError, RuntimeError, EOFError) as e:
            raise BisectError(f"cannot read the capture {p}: {e}",
                              hint="the engine run that should have written it failed; see its log") from e

    doc = read(path)
    world = int(((doc.get("meta") or {}) if isinstance(doc, dict) else {}).get("world_size") or 1)
    if world > 1:
        others = [path.with_name(f"{path.name}.rank{r}") for r in range(1, world)]
        doc["ranks"] = [doc] + [read(p) for p in others if p.is_file()]
    return doc


def _runner_script() -> Path:
    from patcher.runners.launch import REFERENCE_RUNNER

    return REFERENCE_RUNNER.script


def reference_capture(cfg: Config, checkpoint: Checkpoint, fingerprint: str, engine_doc: dict, dtype: str, work: Path,
                      python: Callable[[], Path], progress: Callable[[str], None] | None = None,
                      on_line: Callable[[str], None] | None = None, device: str = "cpu") -> dict[str, dict]:
    """The HF reference, teacher-forced on exactly the engine's token sequences, captured in
    float32 (and in `dtype` when the engine ran in low precision: its noise yardstick; for fp8,
    HF with the FP8 GEMMs' activation rounding emulated). Cached by (model, sequences, dtypes,
    spec, runner, transformers version); the `checkpoint` is the one the check opened. `python`
    gives the reference's interpreter (made on first use) when the cache misses; it runs on
    `device` if it fits there (exit 6 if not)."""
    from patcher.checkpoints.model_dir import reference_slot, run_time_limit

    model_dir, config = Path(checkpoint.path).resolve(), checkpoint.config
    dtypes = ["float32"] + ([dtype] if dtype in LOW_PRECISION_DTYPES else [])
    spec = REFERENCE_TABLE.spec(config, "float32")
    sequences = engine_doc["sequences"]
    script = _runner_script()
    key = hashlib.sha256(json.dumps({
        "model": fingerprint, "sequences": sequences, "dtypes": dtypes, "spec": spec,
        "runner": hashlib.sha256(script.read_bytes()).hexdigest(),
        "capture": hashlib.sha256((script.parent / "capture.py").read_bytes()).hexdigest(),
        "transformers": REFERENCE_TRANSFORMERS}, sort_keys=True).encode()).hexdigest()
    cached = cfg.cache / "reference-capture" / f"{key}.pt"
    if cached.is_file():
        if progress:
            progress("bisect: reusing the cached HF reference capture")
        docs = load_capture(cached)
        if isinstance(docs, dict) and all(d in docs for d in dtypes):
            return docs
    ckpt = checkpoint
    with reference_slot(ckpt, device, cfg.cache / "locks", progress):  # the memory check comes first
        if cached.is_file():  # made meanwhile by the check this one waited for
            docs = load_capture(cached)
            if isinstance(docs, dict) and all(d in docs for d in dtypes):
                return docs
        py = python()
        if progress:
            progress(f"bisect: HF transformers {REFERENCE_TRANSFORMERS} teacher-forced on the engine's "
                     f"{len(sequences)} sequences ({', '.join(dtypes)}) with capture hooks on {device.upper()}")
        work.mkdir(parents=True, exist_ok=True)
        spec_path = work / "reference-capture-spec.json"
        spec_path.write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
        seq_path = work / "capture-sequences.json"
        seq_path.write_text(json.dumps(sequences) + "\n")
        out = work / "reference-capture.pt"
        out.unlink(missing_ok=True)
        log = work / "reference-capture.log"
        argv = [str(py), str(script), "--model", str(model_dir), "--capture", str(out), "--capture-spec",
                str(spec_path), "--capture-sequences", str(seq_path), "--capture-dtypes", ",".join(dtypes)] \
            + (["--device", device] if device != "cpu" else [])
        rc = _run_logged(argv, log, max(REFERENCE_TIMEOUT, run_time_limit(ckpt)), on_line)
        if rc != 0 or not out.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.is_file() else ""
            raise BisectError(f"the HF reference capture failed (status {rc})", hint=f"log: {log}\n{tail}")
        docs = load_capture(out)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        try:  # one copy on disk for the run's capture and the cache's (captures reach gigabytes)
            os.link(out, tmp)
        except OSError:
            shutil.copyfile(out, tmp)
        os.replace(tmp, cached)
        return docs


def _run_logged(argv: list[str], log: Path, timeout: float, on_line=None) -> int:
    """Run argv with its output in `log` (and `on_line`); status 124 when it timed out."""
    from patcher.base.procs import run_logged

    with open(log, "w") as f:
        return run_logged(argv, f, timeout, on_line=on_line).returncode


def compare(engine_doc: dict, reference_docs: dict[str, dict], config: dict, dtype: str, engine_name: str,
            table: CaptureTable | None) -> BisectResult:
    return compare_captures(engine_doc, reference_docs["float32"], config, dtype, engine_name=engine_name,
                            reference_lp=reference_docs.get(dtype) if dtype in LOW_PRECISION_DTYPES else None,
                            engine_table=table)


def report_paths(check_report: Path) -> tuple[Path, Path]:
    """The bisect report and heat map next to a check report (same stem + '-bisect')."""
    stem = check_report.with_suffix("")
    return stem.with_name(stem.name + "-bisect.json"), stem.with_name(stem.name + "-bisect.png")


def write_report(result: BisectResult, check_report: Path, meta: dict, title: str) -> ModuleVerdict:
    """Write the bisect report (JSON) and heat map (PNG); returns what the check keeps of it."""
    json_path, png_path = report_paths(check_report)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    plot = None
    try:
        from patcher.rules.plots import plot_bisect

        plot_bisect(result, png_path, title=title)
        plot = str(png_path)
    except ImportError:  # matplotlib is optional
        png_path.unlink(missing_ok=True)
    doc = {**result.to_json(), **meta, "report_path": str(json_path), "plot_path": plot}
    json_path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return summary(result, str(json_path), plot)


def summary(result: BisectResult, report_path: str | None, plot_path: str | None) -> ModuleVerdict:
    """What a check keeps of a per-module comparison: its verdict, first divergence, the points above
    their limits, the margin and routing flips, and where its report is."""
    return ModuleVerdict(
        passed=result.passed, rule=result.rule, dtype=result.dtype, reasons=list(result.reasons),
        explanation=list(result.explanation), report_path=report_path, plot_path=plot_path,
        first=None if result.first is None else first_divergence(result.first),
        above=[PointAbove(p.layer, p.point, p.error, p.limit, p.phase, p.ratio, p.rank)
               for p in result.points if p.above],
        compared=sum(p.status != "not compared" for p in result.points),
        margin=result.margin, routing_flips=dict(result.routing_flips))


def command(pin: str, model: str, style: str | None, dtype: str, unpatched: bool, variant: str | None = None) -> str:
    """The `dsadapt bisect` command line that reproduces a check's configuration."""
    return (f"dsadapt bisect {pin} --model {model}" + (f" --config-style {style}" if style else "")
            + f" --dtype {dtype}" + (f" --variant {variant}" if variant else "") + (" --unpatched" if unpatched else ""))
