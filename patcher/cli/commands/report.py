"""report: one table over all pins (stack, Upstream-Status, the gates' verdicts, drop candidates),
then the newest verdict of each configuration the pins' current stacks were judged in."""

from __future__ import annotations

from pathlib import Path

import click

from patcher.cli.commands.common import Context, emit_json, json_option, out, pass_ctx, table
from patcher.gate.report import SCHEMA, build_report, machine_name


@click.command("report")
@click.option("--configs/--no-configs", "configs", default=True, show_default=True,
              help="Also list the newest verdict of every configuration (variant, model, config style, dtype, "
                   "parallel config) behind each pin's verdict.")
@json_option
@pass_ctx
def report_cmd(ctx: Context, configs: bool, as_json: bool) -> None:
    """Every pin: stack size, patches by Upstream-Status, last check and speed-gate verdicts, patches to drop.

    A pin's check verdict is the worst of the newest verdict per configuration (variant, model,
    config style, dtype, parallel config) of its current stack; the speed gate's is its
    calibrated runs' (a quicker run is shown next to it). A verdict the current rule would not
    give is flagged (`dsadapt check --rescore REPORT`). Exit 0 whatever the verdicts say: the
    report is the result."""
    rows = build_report(ctx.cfg, ctx.lock)
    if as_json:
        emit_json({"schema": SCHEMA, "pins": [r.to_json() for r in rows]})
        return
    table("dsadapt report", ["pin", "patches", "upstream status", "check", "perf", "drop candidates"],
          [[r.pin,
            str(r.patches) if r.stack_exists else "no stack",
            ", ".join(f"{k} {n}" for k, n in r.upstream_status.items()) or "-",
            r.error or _short_check(r),
            _short_perf(r),
            _drops(r.drop_candidates)]
           for r in rows])
    if not configs:
        return
    lines = [[r.pin, c["config"], "check: " + c["verdict"] + (" (stale)" if c.get("stale") else "") + _earlier(r, c),
              c["date"][:10], c["machine"], Path(c["file"]).name] for r in rows for c in r.checks]
    lines += [[r.pin, c["config"], "perf: " + c["verdict"] + ("" if c["workload"] == "calibrated" else " (quick run)")
               + _earlier(r, c), c["date"][:10], c["machine"], Path(c["file"]).name] for r in rows for c in r.perfs]
    if lines:
        table("newest verdict per configuration, of the current stack (of an earlier version where it has none)",
              ["pin", "configuration", "gate: verdict", "date", "machine", "report"], lines)
    for r in rows:
        for c in r.checks:
            if c.get("stale"):
                out(f"  {r.pin} {c['config']}: {c['stale']}")


def _earlier(r, c: dict) -> str:
    """' (earlier stack)' for a verdict of another version of the pin's stack than the one in patches/."""
    return " (earlier stack)" if r.stack_hash and c.get("stack_hash") != r.stack_hash else ""


COMMANDS = [report_cmd]


def _where(rows: list[dict]) -> str:
    """The machines of the verdicts behind a cell ('CPU', 'H200', 'CPU, H200')."""
    return ", ".join(dict.fromkeys(c.get("machine") or machine_name(c.get("device") or "") for c in rows))


def _short_check(r) -> str:
    """The table's cell: the worst configuration's verdict, the newest date among the configurations
    and the machines they were judged on, how many configurations, what is stale (the words in full:
    --json's `check`, and the configurations table below)."""
    v = r.last_check
    if not v:
        return r.check
    n, bad = len(r.checks), sum(c["verdict"] != "pass" for c in r.checks)
    word = "GPU-verified" if v["verdict"] == "pass" and all(c["machine"] != "CPU" for c in r.checks) else v["verdict"]
    cell = f"{word} {max(c['date'] for c in r.checks)[:10]} ({_where(r.checks)})"
    if n > 1:
        cell += f", {bad} of {n} configs fail" if bad else f", {n} configs"
    if r.stale:
        cell += f", {r.stale} stale"
    if "stack changed since" in r.check:
        cell += ", stack changed since"
    return cell


def _short_perf(r) -> str:
    v = r.last_perf
    if not v:
        return r.perf
    rows = [c for c in r.perfs if c.get("workload") == v.get("workload")] or [v]
    cell = f"{v['verdict']} {max(c['date'] for c in rows)[:10]} ({_where(rows)})"
    if v.get("workload") != "calibrated":
        cell += ", quick run only"
    elif "newer quick run" in r.perf:
        cell += ", newer quick run: " + r.perf.split("newer quick run ", 1)[1].split(": ", 1)[1].split(" (")[0]
    return cell


def _drops(cands) -> str:
    """Compact: patch numbers grouped by (spec, newer pin), e.g. '0001-0006: vllm>=0.5.1 (vllm@v0.32.0)'."""
    if not cands:
        return "-"
    groups: dict[tuple[str, str], list[str]] = {}
    for d in cands:
        groups.setdefault((d.spec, d.satisfied_by), []).append(d.patch[:4])
    parts = []
    for (spec, pin), nums in groups.items():
        span = nums[0] if len(nums) == 1 else f"{nums[0]}-{nums[-1]}" if len(nums) > 2 else ", ".join(nums)
        parts.append(f"{span}: {spec} holds for {pin}")
    return "; ".join(parts)
