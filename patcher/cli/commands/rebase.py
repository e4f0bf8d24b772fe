"""tags / rebase / matrix: find new upstream releases, carry a stack onto one, and plan CI."""

from __future__ import annotations

import click

from patcher.base.errors import DsadaptError, UsageError
from patcher.base.workdir import workdir_lock
from patcher.cli.commands.common import (
    Context,
    complete_engine,
    complete_tag,
    emit_json,
    json_option,
    lock_for_new_pin,
    note,
    op_flags,
    out,
    pass_ctx,
    pinref_arg,
    progress_printer,
    publish_option,
    ref_of,
    rel_path,
    run_op,
    table,
    warn,
)
from patcher.formats.pinref import check_tag, parse_pinref
from patcher.upstream.tags import upstream_tags

# `tags` starts in well under a tenth of a second: the stack, rebase and matrix modules are
# imported by the commands that use them


@click.command("tags")
@click.argument("engine", shell_complete=complete_engine)
@click.option("--pre", is_flag=True, help="Include pre-releases (rc, dev, alpha, beta).")
@json_option
@pass_ctx
def tags_cmd(ctx: Context, engine: str, pre: bool, as_json: bool) -> None:
    """Upstream release tags newer than ENGINE's newest stack, each marked pinned / unpinned."""
    res = upstream_tags(ctx.cfg, ctx.lock, engine, pre=pre)
    if as_json:
        emit_json(res.to_json(), schema="dsadapt.tags/1")
        return
    for p in res.passed_over:
        note(f"  passed over: {p}")
    if not res.tags:
        out(f"{engine}: nothing newer than {res.baseline or '(no pin)'} (asked {res.source})")
        return
    out(f"{engine}: {len(res.tags)} tag(s) newer than {res.baseline or '(no pin)'}, from {res.source}")
    table(None, ["tag", "version", "state", "seen on"],
          [[t.tag, t.version, "pinned" if t.pinned else "unpinned",
            (t.commit or "")[:12] or ", ".join(t.dists)] for t in res.tags])


def _onto(engine: str, onto: str) -> str:
    """--onto TAG (or ENGINE@TAG), validated as a tag before any git or PyPI query."""
    if "@" not in onto:
        return check_tag(onto, "--onto")
    ref = parse_pinref(onto)
    if ref.engine != engine:
        raise UsageError(f"--onto {onto} names engine {ref.engine}, not {engine}",
                         hint="a stack is rebased within one engine")
    return ref.tag


@click.command("rebase")
@pinref_arg(required=False, pinned=False)
@click.option("--onto", "onto", default=None, metavar="TAG", shell_complete=complete_tag,
              help="The upstream tag to carry the stack onto.")
@click.option("--force", is_flag=True,
              help="Replace patches/ENGINE/NEW when it exists already (the stack there is kept in a backup ref "
                   "of the NEW checkout, named in the output).")
@click.option("--no-lock", "no_lock", is_flag=True,
              help="Do not make the hash locks of NEW's environments when the rebase is done (`dsadapt lock`).")
@op_flags
@publish_option
@json_option
@pass_ctx
def rebase_cmd(ctx: Context, pin: str | None, onto: str | None, force: bool, no_lock: bool, op_continue: bool,
               op_skip: bool, op_abort: bool, as_json: bool) -> None:
    """Carry ENGINE@OLD's stack onto --onto NEW: pin and fetch NEW, replay patch by patch (3-way),
    classify each patch, write patches/ENGINE/NEW and reports/rebase/ENGINE-OLD-to-NEW.{md,json}.

    On a conflict it stops; resolve, then `dsadapt rebase --continue` (or `dsadapt continue`),
    `--skip` or `--abort`, as for apply. NEW may be older than OLD (a backport): the output and
    the report say so (`direction`). When done, NEW's environments get their hash locks
    (`dsadapt lock NEW`; --no-lock leaves that)."""
    if run_op(click.get_current_context(), ctx, pin,
              {"op_continue": op_continue, "op_skip": op_skip, "op_abort": op_abort}, "rebase"):
        return
    if not pin or not onto:
        raise UsageError("missing argument 'ENGINE@TAG' or option '--onto': the stack to carry and the tag to carry it onto",
                         hint="e.g. dsadapt rebase vllm@v0.32.0 --onto v0.33.0; after a conflict: "
                              "dsadapt rebase --continue")
    from patcher.stack.rebase.carry import load_report, rebase_stack, report_paths

    old = ref_of(pin)
    new_tag = _onto(old.engine, onto)
    if new_tag == old.tag:
        raise UsageError(f"--onto {new_tag} is the tag {old} is already on", hint="name the newer upstream tag to carry the stack onto")
    ctx.lock.pin(old)  # an unpinned OLD fails before anything (even the work-dir lock file) is created
    on_patch = None if as_json else (lambda o: out(f"  {o.index:>3}  {o.outcome:<8} {o.name}"))
    with workdir_lock(ctx.cfg):
        res, notes = rebase_stack(ctx.cfg, ctx.lock, old, new_tag, progress=progress_printer(),
                                  on_patch=on_patch, force=force)
        notes = [*notes, *[n for n in getattr(res, "notes", []) if n not in notes]]
        report = load_report(ctx.cfg, old.engine, old.tag, new_tag)
        md, js = report_paths(ctx.cfg, old.engine, old.tag, new_tag)
        from patcher.cli.ci import step_summary

        if md.is_file():
            step_summary(md.read_text(encoding="utf-8"))
        if not as_json:
            counts = ", ".join(f"{n} {k}" for k, n in report["counts"].items()) or "empty stack"
            back = " (backward: onto an older release)" if report.get("direction") == "backward" else ""
            out(f"{old} → {old.engine}@{new_tag}{back}: {counts}; stack written to patches/{old.engine}/{new_tag}/")
            out(f"  report: {rel_path(md, ctx.cfg.project)} (+ .json)")
            for n in notes:
                out(f"  note: {n}")
        new_ref = ref_of(f"{old.engine}@{new_tag}")
        locks = {} if no_lock else lock_for_new_pin(ctx, new_ref, as_json=as_json)
    if as_json:
        emit_json({"status": "rebased", "notes": notes, "checkout": res.checkout, "report": str(js), **report,
                   **locks}, schema="dsadapt.rebase/1")


@click.command("matrix")
@click.option("--only", type=click.Choice(["pinned", "new"]), default=None,
              help="Only the pinned cells, or only the new-upstream-tag cells.")
@click.option("--pre", is_flag=True, help="Count pre-release tags as new.")
@json_option
@pass_ctx
def matrix_cmd(ctx: Context, only: str | None, pre: bool, as_json: bool) -> None:
    """The CI matrix: one cell per (pin, variant) and per newer upstream tag not yet pinned.

    --json prints {"include": [...]}, ready for a GitHub Actions strategy.matrix."""
    from patcher.engines.registry import engine as engine_of
    from patcher.upstream.matrix import blocker_here, build_matrix, cell_python, github_matrix

    tags = {}
    if only != "pinned":
        for engine in sorted(e for e in ctx.lock.engines if ctx.lock.pins_of(e)):
            try:
                tags[engine] = upstream_tags(ctx.cfg, ctx.lock, engine, pre=pre)
            except DsadaptError as e:  # no source answered: that engine gets no new-tag cells
                warn(f"  {engine}: no new-tag cells ({e.message})")
    from patcher.artifacts.envlocks import lock_blocker

    cells = build_matrix(ctx.cfg, ctx.lock, tags, only,
                         lambda entry, v: lock_blocker(ctx.cfg.project, ctx.lock, entry, v, cell_python(entry)))
    if as_json:
        emit_json(github_matrix(cells), schema="dsadapt.matrix/1")
        return
    missing = {c.name: lock_blocker(ctx.cfg.project, ctx.lock, ctx.lock.pin(c.pin), engine_of(c.engine).variant(c.variant),
                                    c.python) for c in cells if c.kind == "pinned" and "lock" in c.steps}
    for c in cells:  # a missing lock first, one line each: the cell's `lock` step makes it
        if missing.get(c.name):
            warn(f"{c.pin} ({c.variant}): {missing[c.name]}")
    table("CI matrix", ["cell", "runs on", "python", "steps", "checks", "parallel", "skipped", "check here"],
          [[c.name, ",".join(c.runs_on), c.python, " → ".join(c.steps), ", ".join(k["label"] for k in c.checks) or "-",
            ", ".join(f"{p['label']} ({p['needs']})" for p in c.parallel) or "-", "; ".join(c.skip) or "-",
            blocker_here(c, ctx.lock) or (f"no ({missing[c.name]})" if missing.get(c.name) else "yes")]
           for c in cells])


COMMANDS = [tags_cmd, rebase_cmd, matrix_cmd]
