"""Markdown tables of power reports (dsadapt.power-report/1), the ones docs/equivalence.md ("Power")
and docs/benchmarks.md ("Power") show.

    python tools/power_table.py mde  REPORTS_DIR_OR_FILE [...]   one row per (report, cell)
    python tools/power_table.py cost REPORTS_DIR_OR_FILE [...]   one row per report: what it took
    python tools/power_table.py publish REPORT DEST_DIR           copy a report (JSON, Markdown, plot) into
                                                                  the committed reports/, its paths there
                                                                  (the Markdown and the plot made from the
                                                                  JSON where only it came back)

For what comes back from the GPU machine: `tar xzf reports.tgz`, then this over `reports/lmdeploy`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def reports(paths: list[Path]) -> list[tuple[Path, dict]]:
    out = []
    for f in sorted(f for p in paths for f in (p.rglob("power-*.json") if p.is_dir() else [p])):
        try:
            d = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(d, dict) and str(d.get("schema", "")).startswith("dsadapt.power-report/"):
            out.append((f, d))
    return out


def _mde(c: dict, search: dict) -> str:
    status, hi, lo = c.get("status"), c.get("flagged_at"), c.get("clear_at")
    if status == "not flagged":
        return f"> {search['eps_max']:g}"
    if status == "below range":
        return f"≤ {search['eps_min']:g}"
    if hi is None:
        return status or "-"
    return f"{hi:.2g} (not {lo:.2g})" if lo is not None else f"{hi:.2g}"


def mde_rows(found: list[tuple[Path, dict]]) -> list[str]:
    out = ["| engine | model | dtype | family (point) | phase | MDE: flagged (not at) | flagged by | named first "
           "| change taken at the MDE |", "|---|---|---|---|---|---|---|---|---|"]
    for _f, d in found:
        for c in d.get("cells") or []:
            at = next((t for t in c.get("trials") or [] if t.get("flagged") and t.get("eps") == c.get("flagged_at")),
                      None)
            named = "-"
            if at and at.get("named"):
                n = at["named"]
                named = (f"L{n['layer']} " if n.get("layer") is not None else "") + str(n.get("label")) + \
                    (f" ({n['phase']})" if n.get("phase") else "")
            change = f"{at['change']:.2g}" if at and at.get("change") is not None else "-"
            out.append(f"| {d['pin']} ({d['variant']}) | {d['model']} | {d['dtype']} | {c['target']} ({c['point']}) | "
                       f"{c['phase']} | {_mde(c, d['search'])} | {', '.join(at['by']) if at else '-'} | {named} | "
                       f"{change} |")
    return out


def check_equivalent(d: dict) -> float | None:
    """What a plain `dsadapt check` of the same pin, model and dtype costs, measured inside the power
    run itself (the same machine, the same minute): the install, the HF reference, the runner's
    start to its first answer (the run without hooks: engine start and the gate's prompts once)
    and, in low precision, the control's capture pass and one reference capture (a check's
    per-module comparison)."""
    t, control = d.get("timings") or {}, d.get("control") or {}
    if t.get("first_job_s") is None:
        return None
    total = float(t.get("install_s") or 0) + float(t.get("reference_s") or 0) + float(t["first_job_s"])
    if t.get("reference_captures"):
        total += float(control.get("capture_s") or 0) + float(t.get("reference_capture_s") or 0) / t["reference_captures"]
    return total


def cost_rows(found: list[tuple[Path, dict]]) -> list[str]:
    out = ["| report | cells | engine runs | engine start | runner's first answer | s per run (median) | "
           "reference captures | total | a check, same run | total / check | load average (start, end) | date |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f, d in found:
        t, prov = d.get("timings") or {}, d.get("provenance") or {}
        secs = sorted(x["seconds"] for c in d.get("cells") or [] for x in c.get("trials") or []
                      if x.get("seconds") is not None)
        med = secs[len(secs) // 2] if secs else None
        check = check_equivalent(d)
        ratio = f"{t['total_s'] / check:.1f}x" if check and t.get("total_s") else "-"
        load = ", ".join(f"{(x or [None])[0]}" for x in (prov.get("loadavg"), prov.get("loadavg_end")) if x)
        out.append(f"| {f.name} | {len(d.get('cells') or [])} | {d.get('settings')} | {t.get('engine_start_s', '-')} s | "
                   f"{t.get('first_job_s', '-')} s | {'-' if med is None else f'{med:.1f} s'} | "
                   f"{t.get('reference_captures', 0)} ({t.get('reference_capture_s', 0)} s) | {t.get('total_s')} s | "
                   f"{'-' if check is None else f'{check:.0f} s'} | {ratio} | {load or '-'} | {prov.get('date', '-')} |")
    return out


def publish(report: Path, dest: Path) -> Path:
    """Copy a power report and its twins into `dest` (the committed reports/<engine>/<tag>/), its
    `report_path` / `plot_path` rewritten to where they now are, relative to the project."""
    d = json.loads(report.read_text(encoding="utf-8"))
    bundle = (d.get("provenance") or {}).get("bundle")
    if bundle:  # made on a machine through a bundle: its folder reads <bundle>, as unpacked check reports do
        sys.path.insert(0, str(Path(__file__).resolve().parent / "device"))
        from unpack_reports import relocate

        d = relocate(d, str(bundle))
    dest.mkdir(parents=True, exist_ok=True)
    for suffix in (".md", ".png"):
        if report.with_suffix(suffix).is_file():
            shutil.copyfile(report.with_suffix(suffix), dest / report.with_suffix(suffix).name)
    # what a device call brings back has the JSON only: the Markdown and the plot are made from it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from patcher.gate.detection import markdown, result_from_json

    if not (dest / report.with_suffix(".md").name).is_file():
        (dest / report.with_suffix(".md").name).write_text(markdown(result_from_json(d)), encoding="utf-8")
    if not (dest / report.with_suffix(".png").name).is_file():
        try:
            from patcher.rules.plots import plot_power

            plot_power(result_from_json(d), dest / report.with_suffix(".png").name)
        except ImportError:  # matplotlib is optional
            pass
    root = next((p for p in [dest, *dest.parents] if (p / "upstream.lock").is_file()), dest)
    rel = (dest / report.name).resolve().relative_to(root.resolve())
    d["report_path"] = str(rel)
    d["plot_path"] = str(rel.with_suffix(".png")) if (dest / report.with_suffix(".png").name).is_file() else None
    (dest / report.name).write_text(json.dumps(d, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return dest / report.name


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] not in ("mde", "cost", "publish"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[1] == "publish":
        print(publish(Path(argv[2]), Path(argv[3])))
        return 0
    found = reports([Path(a) for a in argv[2:]])
    print("\n".join(mde_rows(found) if argv[1] == "mde" else cost_rows(found)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
