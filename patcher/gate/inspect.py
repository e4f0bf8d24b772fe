"""`dsadapt model inspect`: the structure a checkpoint's activations have, measured by the reference.

HF transformers (the gate's reference environment) runs the gate's own prompts through the
checkpoint in float32 and in each low-precision dtype the gate would judge it in
(patcher/runners/activation_stats.py, through hf_reference.py's ``--inspect`` mode); each property
is then held to its target (`patcher.checkpoints.structure.judge_structure`). Cached by the
checkpoint's fingerprint, the prompts, the dtypes, the device and the scripts, like the reference.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patcher.base.config import Config
from patcher.base.errors import DsadaptError, UsageError
from patcher.checkpoints.structure import judge_structure

SCHEMA = "dsadapt.model-structure/1"
INSPECT_DTYPES = ("bfloat16", "float16", "fp8")


class InspectFailed(DsadaptError):
    """The reference could not measure the checkpoint."""


def default_dtypes(fp8: bool) -> list[str]:
    """What the gate judges the checkpoint in: fp8 for a block-FP8 one, else bfloat16 and float16."""
    return ["fp8"] if fp8 else ["bfloat16", "float16"]


def check_dtypes(dtypes: list[str], fp8: bool) -> None:
    for d in dtypes:
        if d not in INSPECT_DTYPES:
            raise UsageError(f"--dtype {d}: model inspect compares float32 with {', '.join(INSPECT_DTYPES)}",
                             hint="pass bfloat16, float16 or (block-FP8 checkpoints) fp8")
        if d == "fp8" and not fp8:
            raise UsageError("--dtype fp8 needs a block-FP8 checkpoint (quantization_config quant_method fp8)",
                             hint="leave --dtype out: bfloat16 and float16 are measured")


def inspect_model(cfg: Config, model_dir: Path, dtypes: list[str] | None = None, device: str = "cpu",
                  progress: Callable[[str], None] | None = None,
                  on_line: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The `dsadapt.model-structure/1` document of the checkpoint in `model_dir`, with its
    properties judged (``properties``). Bad input (not a checkpoint, a dtype it has no path for)
    is refused before anything runs; the reference's memory is checked first (exit 6)."""
    from patcher.base.procs import run_logged
    from patcher.checkpoints.fingerprint import fingerprint
    from patcher.checkpoints.model_dir import open_checkpoint, reference_slot, run_time_limit
    from patcher.gate.equivalence import REFERENCE_TRANSFORMERS, reference_python
    from patcher.rules.prompts import build_prompt_set, prompts_to_json
    from patcher.runners.launch import REFERENCE_RUNNER

    ckpt = open_checkpoint(model_dir)
    fp8 = ckpt.fp8 is not None
    dtypes = list(dtypes) if dtypes else default_dtypes(fp8)
    check_dtypes(dtypes, fp8)
    fp = fingerprint(ckpt, cfg.cache, progress).sha256
    prompts = prompts_to_json(build_prompt_set(model_dir))
    script = REFERENCE_RUNNER.script
    probe = script.parent / "activation_stats.py"
    key = hashlib.sha256(json.dumps({
        "model": fp, "prompts": prompts, "dtypes": dtypes, "device": device, "transformers": REFERENCE_TRANSFORMERS,
        "runner": hashlib.sha256(script.read_bytes()).hexdigest(),
        "probe": hashlib.sha256(probe.read_bytes()).hexdigest()}, sort_keys=True).encode()).hexdigest()
    cached = cfg.cache / "model-structure" / f"{key}.json"
    if cached.is_file():
        if progress:
            progress("inspect: reusing the cached measurement")
        doc = json.loads(cached.read_text())
    else:
        with reference_slot(ckpt, device, cfg.cache / "locks", progress):
            py = reference_python(cfg, progress)
            work = cfg.workdir / "runs" / "inspect" / key[:16]
            work.mkdir(parents=True, exist_ok=True)
            prompts_path = work / "prompts.json"
            prompts_path.write_text(json.dumps(prompts) + "\n")
            out = work / "structure.json"
            out.unlink(missing_ok=True)
            log = work / "inspect.log"
            if progress:
                progress(f"inspect: HF transformers {REFERENCE_TRANSFORMERS} on {device.upper()}, float32 and "
                         f"{', '.join(dtypes)}, {len(prompts['prompts'])} prompts")
            argv = [str(py), str(script), "--model", str(model_dir), "--prompts", str(prompts_path),
                    "--inspect", str(out), "--inspect-dtypes", ",".join(dtypes), "--device", device]
            with open(log, "w") as f:
                rc = run_logged(argv, f, run_time_limit(ckpt), on_line=on_line).returncode
            if rc != 0 or not out.is_file():
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:]) if log.is_file() else ""
                raise InspectFailed(f"the reference could not measure {model_dir} (status {rc})",
                                    hint=f"log: {log}\n{tail}")
            doc = json.loads(out.read_text())
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps(doc) + "\n")
    doc["model"] = {"path": str(model_dir), "fingerprint": fp, "fp8": fp8}
    doc["properties"] = judge_structure(doc, fp8=fp8)
    return doc


def render(doc: dict[str, Any]) -> list[str]:
    """The properties as lines of text (the CLI prints them)."""
    lines = [f"{doc['model']['path']}: {doc['rows']} rows of {doc['sequences']} prompts, float32 and "
             f"{', '.join(doc['dtypes'])} (HF transformers {doc.get('transformers', '?')}, {doc.get('device', '?')})"]
    for p in doc["properties"]:
        v = p["value"]
        val = "not measured" if v is None else (f"{v:.3g}" if abs(v) < 1e4 else f"{v:.2e}")
        mark = "-" if p["ok"] is None else ("ok" if p["ok"] else "BELOW")
        lines.append(f"  {p['property']:<26} {val:>10}  (target >= {p['target']:g})  {mark}: {p['measured']}")
    return lines
