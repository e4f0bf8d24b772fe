"""report: one table over all pins (stack, Upstream-Status, last check, last perf, drop candidates)."""

from __future__ import annotations

import click

from patcher.cli.commands.common import Context, emit_json, json_option, pass_ctx, table
from patcher.gate.summary import build_report


@click.command("report")
@json_option
@pass_ctx
def report_cmd(ctx: Context, as_json: bool) -> None:
    """Every pin: stack size, patches by Upstream-Status, last check and speed-gate verdicts, patches to drop."""
    rows = build_report(ctx.cfg, ctx.lock)
    if as_json:
        emit_json({"pins": [r.to_json() for r in rows]})
        return
    table("dsadapt report", ["pin", "patches", "upstream status", "last check", "last perf", "drop candidates"],
          [[r.pin,
            str(r.patches) if r.stack_exists else "no stack",
            ", ".join(f"{k} {n}" for k, n in r.upstream_status.items()) or "-",
            r.error or r.check,
            r.perf,
            _drops(r.drop_candidates)]
           for r in rows])


COMMANDS = [report_cmd]


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
