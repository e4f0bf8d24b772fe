"""What a power run found: `PowerResult` (a `GateRun` with every cell searched), its JSON
(`dsadapt.power-report/1`, read back by `result_from_json`) and its Markdown twin. The search
and the cells are `patcher.rules.mde`; the run is `patcher.gate.power`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from patcher.gate.result import GateRun
from patcher.rules import mde as P
from patcher.rules.logits import _json_safe

SCHEMA = "dsadapt.power-report/1"


@dataclass
class PowerResult(GateRun):
    """One power run: a pin, a model, a dtype (`GateRun`), every cell searched."""

    unpatched: bool
    kind: str
    search: dict
    cells: list[P.Cell]
    #: the unperturbed run with every hook installed at eps 0, as the gate judged it
    control: dict
    #: the run without hooks next to the control: whether the hooks at eps 0 left every logprob as it was
    hooks: dict
    passed: bool
    reasons: list[str]
    require: float | None = None
    runner: str = ""
    settings: int = 0
    timings: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    report_path: str = ""
    plot_path: str | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["cells"] = [c.to_json() for c in self.cells]
        return {"schema": SCHEMA, **_json_safe(d)}


def result_from_json(d: dict) -> PowerResult:
    """A power report read back (its plot and Markdown can be made again from the JSON alone)."""
    trial_keys = set(P.Trial.__dataclass_fields__)
    cell_keys = set(P.Cell.__dataclass_fields__) - {"trials"}
    cells = [P.Cell(**{k: v for k, v in c.items() if k in cell_keys},
                    trials=[P.Trial(**{k: v for k, v in t.items() if k in trial_keys}) for t in c.get("trials") or []])
             for c in d.get("cells") or []]
    keys = set(PowerResult.__dataclass_fields__) - {"cells"}
    return PowerResult(**{k: v for k, v in d.items() if k in keys}, cells=cells)


def markdown(result: PowerResult) -> str:
    """The power report's Markdown twin: the verdict, the control, one row per cell."""
    c = result.control or {}
    lines = [f"# {result.pin} ({result.variant}{', unpatched' if result.unpatched else ''}): the gate's power "
             f"in {result.dtype} — {'PASS' if result.passed else 'FAIL'}", "",
             f"Model {result.model}" + (f" ({result.config_style} config)" if result.config_style else "")
             + f", {result.dtype}, perturbation `{result.kind}`, eps searched from {result.search['eps_min']:g} to "
               f"{result.search['eps_max']:g} until flagged / not flagged are within {result.search['resolution']:g}x; "
               f"{result.settings} engine runs after one engine start ({result.runner} runner).", ""]
    if result.reasons:
        lines += ["**Why it fails**", "", *(f"- {r}" for r in result.reasons), ""]
    lines += [f"**Control** (every hook installed at eps 0): {'passes' if c.get('passed') else 'FAILS'} the gate"
              + (f"; {c['margins']['words']}" if (c.get("margins") or {}).get("words") else "") + ".",
              f"**Hooks at eps 0**: {result.hooks.get('words', '-')}.", "",
              "| target | point | family | phase | MDE (eps flagged) | flagged by | named | change taken | trials |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cell in result.cells:
        at = next((t for t in cell.judged() if t.flagged and t.eps == cell.flagged_at), None)
        named = "-"
        if at is not None and at.named:
            n = at.named
            named = (f"layer {n.get('layer')} " if n.get("layer") is not None else "") + f"{n.get('label')}" + \
                (f" ({n.get('phase')})" if n.get("phase") else "")
        change = f"{at.change:.3g}" if at is not None and at.change is not None else "-"
        lines.append(f"| {cell.target} | {cell.point} | {cell.family} | {cell.phase} | {P.mde_text(cell, result.search)}"
                     + ("" if cell.monotone else " (not monotone)")
                     + f" | {', '.join(at.by) if at else '-'} | {named} | {change} | {len(cell.trials)} |")
    prov = result.provenance or {}
    lines += ["", "| provenance | |", "| --- | --- |", f"| date | {prov.get('date', '-')} |",
              f"| device | {prov.get('device', '-')} |", f"| load average (1 min) | {prov.get('loadavg', '-')} |",
              f"| engine | {prov.get('engine_version') or '-'} |", f"| command | `{prov.get('command', '-')}` |",
              f"| seconds | {result.timings.get('total_s', '-')} |"]
    return "\n".join(lines) + "\n"
