"""list / status / gc: what is pinned, where each checkout stands, and what killed runs left behind."""

from __future__ import annotations

from pathlib import Path

import click

from patcher.base.errors import UsageError
from patcher.cli.commands.common import Context, emit_json, json_option, note, out, pass_ctx, plural, table, warn


def checkout_status(cfg, lock, entry, running=None):
    """One pin's status (stack.status.checkout_status, imported when a status is asked for)."""
    import patcher.stack.status

    return patcher.stack.status.checkout_status(cfg, lock, entry, running)


def _stack_info(ctx: Context, entry):
    from patcher.base.errors import DsadaptError
    from patcher.formats.parsecache import ParseCache
    from patcher.formats.stackfiles import load_stack

    try:
        st = load_stack(ctx.cfg.patches_root, entry.ref, must_exist=False,
                        cache=ParseCache.in_workdir(ctx.cfg.workdir))
    except DsadaptError as e:
        return None, f"broken: {e.message}"
    return st, None


@click.command("list")
@json_option
@pass_ctx
def list_cmd(ctx: Context, as_json: bool) -> None:
    """Engines, pins, patch counts, build kind, and whether each pin can run here."""
    from patcher.engines.registry import engine

    rows, data = [], []
    probed: dict[str, str | None] = {}
    for name in sorted(ctx.lock.engines):
        ad = engine(name)
        for entry in ctx.lock.pins_of(name):
            d, row = _pin_line(ctx, ad, entry, probed)
            data.append(d)
            rows.append(row)
    from patcher.formats.parsecache import ParseCache

    ParseCache.in_workdir(ctx.cfg.workdir).save()
    if as_json:
        emit_json(schema="dsadapt.list/1", data={"engines": {n: {"git": e.git, "pypi": list(e.pypi)} for n, e in sorted(ctx.lock.engines.items())},
                   "pins": data})
    else:
        table("dsadapt pins", ["pin", "patches", "build", "variants", "runs here"], rows)


def _pin_line(ctx: Context, ad, entry, probed: dict[str, str | None]) -> tuple[dict, list[str]]:
    """One pin of `list`: its JSON record and its table row (stack, build kind, variants, whether
    each can run here: the machine, then whether a source can provide its tree)."""
    from collections import Counter

    st, err = _stack_info(ctx, entry)
    kind = ad.build_kind(st) if st is not None else None
    statuses = Counter(p.upstream_status or "?" for p in st.patches) if st else Counter()
    # every variant the pin can be built as (lmdeploy's pytorch variant overlays the cuda wheel)
    variants = ad.pinned_variants(entry)
    blockers = _run_blockers(ctx, ad, entry, variants, probed)
    runs = ", ".join(f"{v}: {'yes' if b is None else 'no (' + b + ')'}" for v, b in blockers.items()) or "no artifact"
    d = {"pin": str(entry.ref), "engine": entry.engine, "tag": entry.tag, "version": entry.version,
         "patches": len(st) if st else 0, "stack_exists": bool(st and st.exists),
         "stack_hash": st.hash if st else None, "build_kind": kind.kind if kind else None,
         "full_build_reasons": list(kind.reasons) if kind else [], "upstream_status": dict(statuses),
         "variants": [v.name for v in variants], "runs_here": {v: b is None for v, b in blockers.items()},
         "run_blockers": {v: b for v, b in blockers.items() if b},
         # what each variant's gate runner offers in parallel (`Engine.parallel_support`)
         "parallel": {v.name: {"tp": ad.parallel_support(entry, v).tp, "ep": ad.parallel_support(entry, v).ep,
                               "unit": ad.parallel_support(entry, v).unit} for v in variants},
         "serves": entry.serves, "error": err,
         "config_style": ad.model_config_style}
    row = [str(entry.ref), str(d["patches"]) if st and st.exists else "no stack",
           kind.kind if kind else err or "?", ", ".join(v.name for v in variants) or "-", runs]
    return d, row


def _run_blockers(ctx: Context, ad, entry, variants, probed: dict[str, str | None]) -> dict[str, str | None]:
    """Why each variant of the pin cannot run here (None: it can): the machine, a missing
    environment lock (said first, one line each), then whether a source can provide its tree."""
    from patcher.artifacts.envlocks import lock_blocker

    blockers = {v.name: ad.run_blocker(entry, v) or lock_blocker(ctx.cfg.project, ctx.lock, entry, v)
                for v in variants}
    for v, b in blockers.items():
        if b and b.startswith("no hash lock"):
            warn(f"{entry.ref} ({v}): {b}")
    if any(b is None for b in blockers.values()):  # it could run here: can its tree be had here?
        src = _source_blocker(ctx, entry, probed)
        blockers = {v: b or src for v, b in blockers.items()}
    return blockers


def _source_blocker(ctx: Context, entry, probed: dict[str, str | None]) -> str | None:
    """Why no source can provide the pin's tree here (one probe of a git remote per command)."""
    from patcher.upstream.sources import source_blocker

    decl = ctx.lock.engine(entry.engine)
    key = f"{entry.engine}@{entry.tag}" if entry.source_artifact() is not None else decl.git or entry.engine
    if key not in probed:
        probed[key] = source_blocker(ctx.cfg, decl, entry)
    return probed[key]


@click.command("status")
@json_option
@pass_ctx
def status_cmd(ctx: Context, as_json: bool) -> None:
    """Where each checkout stands (not fetched, clean base, stack applied, stack outdated, dirty, diverged;
    stopped on a conflict, interrupted, running) and the command that moves it on."""
    from patcher.base import leftovers
    from patcher.stack.status import status_all

    sts = status_all(ctx.cfg, ctx.lock, checkout_status)
    left = leftovers.find(ctx.cfg)
    if as_json:
        emit_json({"checkouts": [s.to_json() for s in sts], "leftovers": [lo.to_json() for lo in left]},
                  schema="dsadapt.status/1")
        return
    rows = []
    for s in sts:
        src = f"{s.source['kind']}" if s.source else "-"
        detail = s.detail + (f" ({plural(len(s.backups), 'backup ref')})" if s.backups else "")
        rows.append([s.ref + ("" if s.pinned else " (not pinned)"), s.state, src, detail, s.next or "-"])
    table("checkouts", ["pin", "state", "source", "detail", "next"], rows)
    if left:
        note(f"{len(left)} leftover(s) of killed runs: {', '.join(lo.path for lo in left[:3])}"
            f"{' …' if len(left) > 3 else ''}; `dsadapt gc` removes them")


@click.command("gc")
@click.option("--dry-run", "-n", is_flag=True, help="Only list what would be removed.")
@click.option("--runs", is_flag=True, help="Also remove the work files of every past run (runs/: engine logs, "
                                           "captures); the reports keep what the verdicts rest on.")
@click.option("--leftovers-only", is_flag=True, help="Only what killed runs left behind, nothing that is merely unused.")
@json_option
@pass_ctx
def gc_cmd(ctx: Context, dry_run: bool, runs: bool, leftovers_only: bool, as_json: bool) -> None:
    """Remove what killed runs left behind (half-made checkouts, partial downloads, temporary files,
    stale temporary worktrees) and derived data no pin uses (engine environments, dist/ wheels of
    other stacks, runs/ of unpinned pins). Never your work, reports or backups."""
    from patcher.artifacts.prune import find_unused
    from patcher.base import leftovers
    from patcher.base.workdir import workdir_lock

    if runs and leftovers_only:  # --runs removes what is merely unused, which --leftovers-only keeps
        raise UsageError("pass --runs or --leftovers-only, not both",
                         hint="--leftovers-only keeps runs/; `dsadapt gc --runs` also removes it")
    lock = ctx.lock  # a broken project (malformed lock) is refused before anything is removed
    with workdir_lock(ctx.cfg):
        found = leftovers.find(ctx.cfg)
        if not leftovers_only:
            found += find_unused(ctx.cfg, lock, runs=runs)
        for lo in found:
            lo.bytes = leftovers.disk_bytes(Path(lo.path))
        failed = [] if dry_run else leftovers.remove(found)
    freed = sum(lo.bytes or 0 for lo in found if lo not in failed)
    if as_json:
        emit_json(schema="dsadapt.gc/1", data={"dry_run": dry_run, "leftovers": [lo.to_json() for lo in found],
                   "failed": [lo.path for lo in failed], "bytes": freed})
        return
    if not found:
        out("nothing to remove")
        return
    verb = "would remove" if dry_run else "removed"
    for lo in found:
        if lo not in failed:
            out(f"  {verb} {lo.path} ({lo.kind}, {(lo.bytes or 0) / 1e6:.1f} MB): {lo.why}")
    for lo in failed:
        out(f"  could not remove {lo.path}")
    out(f"{verb} {len(found) - len(failed)} item(s), {freed / 1e6:.1f} MB")


COMMANDS = [list_cmd, status_cmd, gc_cmd]
