"""list / status: what is pinned, and where each checkout stands."""

from __future__ import annotations

from collections import Counter

import click

from ..engines import engine
from ..errors import DsadaptError
from ..stack import load_stack
from ..workspace import checkout_status
from .common import Context, emit_json, json_option, pass_ctx, plural, table


def _stack_info(ctx: Context, entry):
    try:
        st = load_stack(ctx.cfg.patches_root, entry.ref, must_exist=False)
    except DsadaptError as e:
        return None, f"broken: {e.message}"
    return st, None


@click.command("list")
@json_option
@pass_ctx
def list_cmd(ctx: Context, as_json: bool) -> None:
    """Engines, pins, patch counts, build kind, and whether each pin can run here."""
    rows, data = [], []
    for name in sorted(ctx.lock.engines):
        ad = engine(name)
        for entry in ctx.lock.pins_of(name):
            st, err = _stack_info(ctx, entry)
            kind = ad.build_kind(st) if st is not None else None
            statuses = Counter(p.upstream_status or "?" for p in st.patches) if st else Counter()
            # every variant the pin can be built as (lmdeploy's pytorch variant overlays the cuda wheel)
            variants = ad.pinned_variants(entry)
            blockers = {v.name: ad.run_blocker(entry, v) for v in variants}
            runs = ", ".join(f"{v}: {'yes' if b is None else 'no (' + b + ')'}" for v, b in blockers.items()) or "no artifact"
            d = {"pin": str(entry.ref), "engine": name, "tag": entry.tag, "version": entry.version,
                 "patches": len(st) if st else 0, "stack_exists": bool(st and st.exists),
                 "stack_hash": st.hash if st else None, "build_kind": kind.kind if kind else None,
                 "full_build_reasons": list(kind.reasons) if kind else [], "upstream_status": dict(statuses),
                 "variants": [v.name for v in variants], "runs_here": {v: b is None for v, b in blockers.items()},
                 "run_blockers": {v: b for v, b in blockers.items() if b}, "serves": entry.serves, "error": err}
            data.append(d)
            rows.append([str(entry.ref), str(d["patches"]) if st and st.exists else "no stack",
                         kind.kind if kind else err or "?", ", ".join(v.name for v in variants) or "-", runs])
    if as_json:
        emit_json({"engines": {n: {"git": e.git, "pypi": list(e.pypi)} for n, e in sorted(ctx.lock.engines.items())},
                   "pins": data})
    else:
        table("dsadapt pins", ["pin", "patches", "build", "variants", "runs here"], rows)


@click.command("status")
@json_option
@pass_ctx
def status_cmd(ctx: Context, as_json: bool) -> None:
    """Where each checkout stands: not fetched / clean base / stack applied / mid-apply / dirty."""
    sts = [checkout_status(ctx.cfg, ctx.lock, e) for e in ctx.lock.sorted_pins()]
    if as_json:
        emit_json({"checkouts": [s.to_json() for s in sts]})
        return
    rows = []
    for s in sts:
        src = f"{s.source['kind']}" if s.source else "-"
        rows.append([s.ref, s.state, src, s.detail + (f" ({plural(len(s.backups), 'backup ref')})" if s.backups else "")])
    table("checkouts", ["pin", "state", "source", "detail"], rows)


COMMANDS = [list_cmd, status_cmd]
