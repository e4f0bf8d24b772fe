"""tags / rebase / matrix: find new upstream releases, carry a stack onto one, and plan CI."""

from __future__ import annotations

import click

from patcher.base.errors import DsadaptError, UsageError
from patcher.cli.commands.common import (
    Context,
    emit_json,
    json_option,
    pass_ctx,
    pinref_arg,
    progress_printer,
    publish_option,
    ref_of,
    say,
    table,
)
from patcher.formats.pinref import check_tag, parse_pinref
from patcher.upstream.tags import upstream_tags

# `tags` starts in well under a tenth of a second: the stack, rebase and matrix modules are
# imported by the commands that use them


@click.command("tags")
@click.argument("engine")
@click.option("--pre", is_flag=True, help="Include pre-releases (rc, dev, alpha, beta).")
@json_option
@pass_ctx
def tags_cmd(ctx: Context, engine: str, pre: bool, as_json: bool) -> None:
    """Upstream release tags newer than ENGINE's newest stack, each marked pinned / unpinned."""
    res = upstream_tags(ctx.cfg, ctx.lock, engine, pre=pre)
    if as_json:
        emit_json(res.to_json())
        return
    for p in res.passed_over:
        say(f"  passed over: {p}")
    say(f"{engine}: {len(res.tags)} tag(s) newer than {res.baseline or '(no pin)'}, from {res.source}")
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
@pinref_arg()
@click.option("--onto", "onto", required=True, metavar="TAG", help="The upstream tag to carry the stack onto.")
@publish_option
@json_option
@pass_ctx
def rebase_cmd(ctx: Context, pin: str, onto: str, as_json: bool) -> None:
    """Carry ENGINE@OLD's stack onto --onto NEW: pin and fetch NEW, replay patch by patch (3-way),
    classify each patch, write patches/ENGINE/NEW and reports/rebase/ENGINE-OLD-to-NEW.{md,json}.

    On a conflict it stops; resolve, then `dsadapt continue`, `skip` or `abort`, as for apply."""
    from patcher.stack import workspace
    from patcher.stack.rebase import load_report, rebase_stack, report_paths

    old = ref_of(pin)
    new_tag = _onto(old.engine, onto)
    if new_tag == old.tag:
        raise UsageError(f"--onto {new_tag} is the tag {old} is already on", hint="name the newer upstream tag to carry the stack onto")
    ctx.lock.pin(old)  # an unpinned OLD fails before anything (even the work-dir lock file) is created
    on_patch = None if as_json else (lambda o: say(f"  {o.index:>3}  {o.outcome:<8} {o.name}"))
    with workspace.workdir_lock(ctx.cfg):
        res, notes = rebase_stack(ctx.cfg, ctx.lock, old, new_tag, progress=progress_printer(not as_json),
                                  on_patch=on_patch)
    report = load_report(ctx.cfg, old.engine, old.tag, new_tag)
    md, js = report_paths(ctx.cfg, old.engine, old.tag, new_tag)
    if as_json:
        emit_json({"status": "rebased", "notes": notes, "checkout": res.checkout, "report": str(js), **report})
        return
    counts = ", ".join(f"{n} {k}" for k, n in report["counts"].items()) or "empty stack"
    say(f"{old} → {old.engine}@{new_tag}: {counts}; stack written to patches/{old.engine}/{new_tag}/")
    say(f"  report: {_rel(md, ctx.cfg.project)} (+ .json)")


def _rel(path, root) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


@click.command("matrix")
@click.option("--only", type=click.Choice(["pinned", "new"]), default=None,
              help="Only the pinned cells, or only the new-upstream-tag cells.")
@click.option("--pre", is_flag=True, help="Count pre-release tags as new.")
@json_option
@pass_ctx
def matrix_cmd(ctx: Context, only: str | None, pre: bool, as_json: bool) -> None:
    """The CI matrix: one cell per (pin, variant) and per newer upstream tag not yet pinned.

    --json prints {"include": [...]}, ready for a GitHub Actions strategy.matrix."""
    from patcher.upstream.matrix import blocker_here, build_matrix, github_matrix

    tags = {}
    if only != "pinned":
        for engine in sorted(e for e in ctx.lock.engines if ctx.lock.pins_of(e)):
            try:
                tags[engine] = upstream_tags(ctx.cfg, ctx.lock, engine, pre=pre)
            except DsadaptError as e:  # no source answered: that engine gets no new-tag cells
                say(f"  {engine}: no new-tag cells ({e.message})")
    cells = build_matrix(ctx.cfg, ctx.lock, tags, only)
    if as_json:
        emit_json(github_matrix(cells))
        return
    table("CI matrix", ["cell", "runs on", "python", "steps", "skipped", "check here"],
          [[c.name, ",".join(c.runs_on), c.python, " → ".join(c.steps), "; ".join(c.skip) or "-",
            blocker_here(c, ctx.lock) or "yes"] for c in cells])


COMMANDS = [tags_cmd, rebase_cmd, matrix_cmd]
