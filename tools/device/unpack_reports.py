"""What a device call brought back, into the project's committed reports/ (`reports_h200.sh unpack`).

    python tools/device/unpack_reports.py DIR [--into REPORTS] [--dry-run]

DIR is the call's result folder (its reports.tgz) or the archive itself. Every check and speed-gate
report the call published (the bundle's reports/<engine>/<tag>/, with each check's recorded inputs
and per-module report) goes to the same place under REPORTS (default: this checkout's reports/):

- the device's paths become relative to the bundle ("<bundle>/..."): a committed report names no
  machine's folders, and `report_path` / `plot_path` name the committed files;
- what the call did not carry is made again here from the JSON, with the product's own functions:
  each check's plot (`plots.plot_deltas` of its stored comparison, titled by its configuration) and
  Markdown twin, each per-module heat map, each speed-gate plot.

Then it lists what reports/plan.txt asks of the H200 and no report answers. Exit 0 when every h200
check line has its report, 1 when one has none (the summary says which), 2 for bad input.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import io
import json
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = "<bundle>"


def _refresh_tool():
    spec = importlib.util.spec_from_file_location("refresh_reports", ROOT / "tools" / "refresh_reports.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def relocate(value, device_root: str):
    """Pure: `value` (JSON) with every string's `device_root` replaced by "<bundle>"."""
    if isinstance(value, str):
        return value.replace(device_root, BUNDLE)
    if isinstance(value, list):
        return [relocate(v, device_root) for v in value]
    if isinstance(value, dict):
        return {k: relocate(v, device_root) for k, v in value.items()}
    return value


def is_report(doc) -> bool:
    return isinstance(doc, dict) and str(doc.get("schema", "")).startswith(("dsadapt.check-report/",
                                                                               "dsadapt.perf-report/"))


def device_root(doc: dict, member: str) -> str | None:
    """Pure: the bundle's path on the device, from a report's own `report_path` and where the
    archive holds it (reports/<engine>/<tag>/NAME.json)."""
    rp = str(doc.get("report_path") or "")
    return rp[: -len(member)].rstrip("/") if rp.endswith(member) and len(rp) > len(member) else None


def unpack(archive: Path, into: Path, dry_run: bool = False) -> list[dict]:
    """Write the archive's published reports under `into`; returns one row per check or perf report."""
    rows = []
    with tarfile.open(archive) as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}
        reports = {}
        for name, m in sorted(members.items()):
            if not name.startswith("reports/") or not name.endswith(".json") or name.endswith("-bisect.json"):
                continue
            f = tar.extractfile(m)
            try:
                doc = json.loads(f.read()) if f else None
            except ValueError:
                continue
            if is_report(doc):
                reports[name] = doc

        def read(name: str) -> bytes | None:
            m = members.get(name)
            f = tar.extractfile(m) if m else None
            return f.read() if f else None

        for name, doc in reports.items():
            root = device_root(doc, name)
            rel = name.removeprefix("reports/")
            dest = into / rel
            if root:
                doc = relocate(doc, root)
            doc["report_path"] = f"reports/{rel}"
            row = {"file": f"reports/{rel}", "pin": doc.get("pin"), "verdict": doc.get("verdict"),
                   "config": _configuration(doc), "stack": (doc.get("provenance") or {}).get("stack_hash")}
            rows.append(row)
            if dry_run:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            stem = name[: -len(".json")]
            bisect = read(stem + "-bisect.json")
            if bisect is not None:
                bdoc = json.loads(bisect)
                bdoc = relocate(bdoc, root) if root else bdoc
                bdoc["report_path"] = f"reports/{rel[:-5]}-bisect.json"
                bdoc["plot_path"] = _draw_bisect(bdoc, doc, into / f"{rel[:-5]}-bisect.png", into)
                (into / f"{rel[:-5]}-bisect.json").write_text(json.dumps(bdoc, indent=2, sort_keys=True) + "\n")
                if isinstance(doc.get("bisect"), dict):
                    doc["bisect"] = {**doc["bisect"], "report_path": bdoc["report_path"], "plot_path": bdoc["plot_path"]}
            inputs = read(stem + ".inputs.json.gz")
            if inputs is not None:
                text = gzip.decompress(inputs).decode()
                if root:
                    text = text.replace(root, BUNDLE)
                buf = io.BytesIO()
                with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz:
                    gz.write(text.encode())
                (into / f"{rel[:-5]}.inputs.json.gz").write_bytes(buf.getvalue())
            doc["plot_path"] = _draw(doc, dest.with_suffix(".png"), into)
            dest.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
            if str(doc.get("schema", "")).startswith("dsadapt.check-report/"):
                _markdown(doc, dest.with_suffix(".md"))
    return rows


def _configuration(doc: dict) -> str:
    from patcher.rules.verdicts import configuration

    return configuration(doc)


def _draw(doc: dict, png: Path, into: Path) -> str | None:
    """The report's plot, drawn here from its JSON (None without matplotlib)."""
    try:
        from patcher.rules import plots
    except ImportError:
        return None
    try:
        if str(doc.get("schema", "")).startswith("dsadapt.perf-report/"):
            plots.plot_perf(doc, png)
        elif (doc.get("comparison") or {}).get("rule"):
            plots.plot_deltas(doc["comparison"], png, title=plots.title_of(str(doc.get("pin")), doc),
                              original_max=_original_max(doc))
        else:
            return None
    except ImportError:
        return None
    return f"reports/{png.relative_to(into)}"


def _draw_bisect(bdoc: dict, doc: dict, png: Path, into: Path) -> str | None:
    try:
        from patcher.rules import plots

        plots.plot_bisect(bdoc, png, title=plots.title_of(str(doc.get("pin")), doc) + ": per-module error vs HF")
    except ImportError:
        return None
    return f"reports/{png.relative_to(into)}"


def _original_max(doc: dict) -> int | None:
    prov = doc.get("provenance") or {}
    if "original_max_position_embeddings" in prov:
        return prov["original_max_position_embeddings"]
    from patcher.checkpoints import tiny
    from patcher.rules.prompts import rope_original_max

    return rope_original_max(tiny.deepseek_config(doc["model"])) if doc.get("model") in tiny.VARIANTS else None


def _markdown(doc: dict, path: Path) -> None:
    from patcher.gate.result import CheckResult, check_markdown

    path.write_text(check_markdown(CheckResult.from_json(doc)), encoding="utf-8")


def missing(rows: list[dict], plan_lines) -> list[str]:
    """Pure: the plan's h200 check lines no unpacked report answers (by pin, model and dtype)."""
    have = {(r["pin"], r["config"]) for r in rows}
    out = []
    for ln in plan_lines:
        if ln.machine != "h200" or ln.command != "check":
            continue
        args = list(ln.argv)
        model = args[args.index("--model") + 1] if "--model" in args else "v3"
        dtype = args[args.index("--dtype") + 1] if "--dtype" in args else None
        if not any(p == ln.pin and f" {model} " in f" {c} " and (dtype is None or f" {dtype}" in f" {c}")
                   for p, c in have):
            out.append(f"{ln.pin} {' '.join(ln.argv)} (reports/plan.txt:{ln.line})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="the device call's result folder (its reports.tgz), or the archive")
    ap.add_argument("--into", type=Path, default=ROOT / "reports", help="the reports folder (default: reports/)")
    ap.add_argument("--dry-run", action="store_true", help="list what would be written, write nothing")
    a = ap.parse_args(argv)
    archive = a.dir / "reports.tgz" if a.dir.is_dir() else a.dir
    if not archive.is_file():
        print(f"error: {archive}: no such archive\nhint: name the folder the device call's files came back in",
              file=sys.stderr)
        return 2
    try:
        rows = unpack(archive, a.into, dry_run=a.dry_run)
    except (tarfile.TarError, OSError, ValueError) as e:
        print(f"error: {archive}: {e}\nhint: fetch the call's reports.tgz again", file=sys.stderr)
        return 2
    for r in rows:
        print(f"{'would write' if a.dry_run else 'wrote'} {r['file']}: {r['pin']} {r['config']}: {r['verdict']} "
              f"(stack {str(r['stack'] or '-')[:12]})")
    lost = missing(rows, _refresh_tool().load_plan())
    for m in lost:
        print(f"no report for: {m}")
    print(f"{len(rows)} report(s); `dsadapt report` shows what they say")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
