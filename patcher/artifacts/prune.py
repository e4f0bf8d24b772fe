"""What `dsadapt gc` prunes besides the leftovers of killed runs: derived data no pin uses.

All of it is made again on demand (an environment from its lock, a wheel by `dsadapt build`, a
run's files by the next check), so pruning never loses work; it only frees disk:

- **engine environments** (the venvs root, when it is the work dir's own; a DSADAPT_VENVS elsewhere
  may be shared by several projects and is left alone): one whose pin is no longer in upstream.lock, whose
  variant the pin no longer has, a reference environment of another transformers version than
  the gate's, or one that was never finished (no install record) and is older than an hour;
- **dist/ wheels** dsadapt built (their `dsadapt.json` says for which pin, variant and stack): one
  of a pin or variant no longer pinned, or of a stack that is not the pin's current one, unless
  an environment still holds it;
- **runs/** (the work dirs of `check`, `bisect`, `perf`, `serve`): those of pins no longer pinned,
  and, with `runs=True`, every one (they hold engine logs and captures; the reports keep
  what the verdicts rest on).
"""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

from patcher.base.config import Config
from patcher.base.errors import DsadaptError
from patcher.base.leftovers import Leftover
from patcher.engines.registry import engine
from patcher.formats.lock import Lock
from patcher.formats.stackfiles import load_stack

INCOMPLETE_AGE_S = 3600


def _pins(lock: Lock) -> dict[str, set[str]]:
    """pin -> its variant names (all of them, pinned or derived)."""
    out: dict[str, set[str]] = {}
    for entry in lock.sorted_pins():
        try:
            eng = engine(entry.engine)
            out[str(entry.ref)] = {v.name for v in eng.pinned_variants(entry)}
        except DsadaptError:
            out[str(entry.ref)] = set()
    return out


def _marker(venv: Path) -> dict | None:
    try:
        return json.loads((venv / "dsadapt-install.json").read_text())
    except (OSError, ValueError):
        return None


def unused_environments(cfg: Config, lock: Lock) -> list[Leftover]:
    from patcher.rules.logits import REFERENCE_TRANSFORMERS

    root = cfg.venvs_root
    if not root.is_dir() or not root.resolve().is_relative_to(cfg.workdir.resolve()):
        return []  # DSADAPT_VENVS elsewhere may be shared with other projects: their pins are not ours to judge
    pins = _pins(lock)
    out = []
    for venv in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if venv.name.startswith("reference-transformers-"):
            if venv.name != f"reference-transformers-{REFERENCE_TRANSFORMERS}":
                out.append(Leftover(str(venv), "environment", f"reference environment of another transformers "
                                                                f"than the gate's {REFERENCE_TRANSFORMERS}"))
            continue
        m = _marker(venv)
        if m is None:
            try:
                old = time.time() - venv.stat().st_mtime > INCOMPLETE_AGE_S
            except OSError:
                old = False
            if old and (venv / "pyvenv.cfg").is_file():
                out.append(Leftover(str(venv), "environment", "an environment that was never finished (no install "
                                                              "record)"))
            continue
        ref, variant = m.get("ref"), m.get("variant")
        if ref not in pins:
            out.append(Leftover(str(venv), "environment", f"environment of {ref}, which is no longer pinned"))
        elif variant and pins[ref] and variant not in pins[ref]:
            out.append(Leftover(str(venv), "environment", f"environment of {ref} variant {variant}, no longer pinned"))
    return out


def _wheel_provenance(path: Path) -> dict | None:
    try:
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith(".dist-info/dsadapt.json")), None)
            return json.loads(z.read(name)) if name else None
    except (OSError, zipfile.BadZipFile, ValueError, KeyError):
        return None


def unused_wheels(cfg: Config, lock: Lock) -> list[Leftover]:
    d = cfg.dist_dir
    if not d.is_dir():
        return []
    pins = _pins(lock)
    held = set()
    if cfg.venvs_root.is_dir():
        for venv in cfg.venvs_root.iterdir():
            m = _marker(venv) if venv.is_dir() else None
            if m and m.get("artifact"):
                held.add(Path(m["artifact"]).name)
    current: dict[str, str | None] = {}
    for ref in pins:
        try:
            st = load_stack(cfg.patches_root, lock.pin(ref).ref, must_exist=False)
            current[ref] = st.hash if st.exists else None
        except DsadaptError:
            current[ref] = None
    out = []
    for whl in sorted(d.glob("*.whl")):
        prov = _wheel_provenance(whl)
        if prov is None or whl.name in held:
            continue  # not a dsadapt build (kept), or an environment holds it
        ref, variant = str(prov.get("pin")), prov.get("variant")
        if ref not in pins:
            why = f"a build of {ref}, which is no longer pinned"
        elif variant and pins[ref] and variant not in pins[ref]:
            why = f"a build of {ref} variant {variant}, no longer pinned"
        elif not prov.get("unpatched") and prov.get("stack_hash") and prov["stack_hash"] != current.get(ref):
            why = f"a build of an older stack of {ref} ({str(prov['stack_hash'])[:10]}); no environment holds it"
        else:
            continue
        out.append(Leftover(str(whl), "build", why))
    return out


def unused_runs(cfg: Config, lock: Lock, *, every: bool = False) -> list[Leftover]:
    root = cfg.workdir / "runs"
    if not root.is_dir():
        return []
    pins = _pins(lock)
    out = []
    for engine_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for tag_dir in sorted(p for p in engine_dir.iterdir() if p.is_dir()):
            ref = f"{engine_dir.name}@{tag_dir.name}"
            if ref not in pins:
                out.append(Leftover(str(tag_dir), "run files", f"work files of runs of {ref}, no longer pinned"))
            elif every:
                out.append(Leftover(str(tag_dir), "run files", f"work files of past runs of {ref} (--runs)"))
    return out


def find_unused(cfg: Config, lock: Lock, *, runs: bool = False) -> list[Leftover]:
    """Everything of the module docstring's list, in that order."""
    return unused_environments(cfg, lock) + unused_wheels(cfg, lock) + unused_runs(cfg, lock, every=runs)
