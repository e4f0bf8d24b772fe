"""apply / continue / skip / abort: put a stack onto its pinned checkout, git-am style."""

from __future__ import annotations

import click

from patcher.base.errors import UsageError
from patcher.cli.commands import common


def _line(o) -> str:
    commit = (o.commit or "")[:12]
    return f"  {o.index:>3}  {o.outcome:<8} {o.name}  {commit}"


def _report(res, as_json: bool, verb: str) -> None:
    if as_json:
        common.emit_json({"status": "noop" if res.noop else "applied", **res.to_json()}, schema="dsadapt.apply/1")
        return
    for n in res.notes:
        common.out(f"  note: {n}")
    if res.noop:
        common.out(f"{res.ref}: already applied ({res.stack_hash[:10]}) at {res.head[:12] if res.head else '?'}; nothing to do")
        return
    src = res.source or {}
    common.out(f"{res.ref}: {verb} {common.plural(len(res.outcomes), 'patch')} onto {res.base[:12]} "
               f"(source: {src.get('kind')} {src.get('origin')}) → {res.checkout}")
    for why in src.get("passed_over") or []:  # the sources tried before it (the order: DSADAPT_SOURCES)
        common.out(f"  passed over {why}")
    if src.get("verified"):
        common.out(f"  verified: {src['verified']}")
    common.out(f"  head {res.head[:12] if res.head else '?'} on branch dsadapt/{res.ref.split('@', 1)[1]}, stack {res.stack_hash[:10]}")
    if res.backup_ref:
        common.out(f"  previous branch kept as {res.backup_ref} (git -C {res.checkout} log {res.backup_ref})")
    for b in res.backups:
        common.out(f"  uncommitted work kept as {b} (git -C {res.checkout} stash apply {b})")


def _op_ref(ctx: common.Context, pin):
    """The pin of continue/skip/abort: it must be pinned, unless its checkout holds an op (an op can
    outlive its pin: a rebase killed before pinning NEW, an abort killed after unpinning it)."""
    ref = common.to_ref(pin)
    if ref is not None and str(ref) not in ctx.lock.pins:
        from patcher.stack.checkout import has_op

        if not has_op(ctx.cfg, ref):
            ctx.lock.pin(ref)  # the usual "not pinned" error
    return ref


def _on_patch(as_json: bool):
    return None if as_json else (lambda o: common.out(_line(o)))


def _rebase_in_progress(ctx: common.Context, ref) -> bool:
    """Whether the op `continue` / `skip` would finish is a rebase (its NEW pin then gets its locks)."""
    from patcher.base.errors import DsadaptError
    from patcher.stack.checkout import in_progress

    try:
        op = in_progress(ctx.cfg, ref).load().op
    except DsadaptError:
        return False
    return op is not None and op.kind == "rebase"


def _lock_after_rebase(ctx: common.Context, res, as_json: bool) -> None:
    """A rebase finished by `continue` / `skip` makes NEW's environment locks, as `rebase` does."""
    from patcher.formats.pinref import parse_pinref

    ref = parse_pinref(res.ref)
    if str(ref) in ctx.reload_lock().pins:
        common.lock_for_new_pin(ctx, ref, as_json=as_json)


@click.command("apply")
@common.pinref_arg(required=False, pinned=False)
@click.option("--force", is_flag=True, help="Apply over uncommitted changes or unexported commits (kept in backup refs).")
@common.op_flags
@common.json_option
@common.pass_ctx
def apply_cmd(ctx: common.Context, pin: str, force: bool, op_continue: bool, op_skip: bool, op_abort: bool,
              as_json: bool) -> None:
    """Materialize + verify the pinned checkout, then apply the stack as commits.

    `apply --continue`, `--skip`, `--abort` are `dsadapt continue`, `skip`, `abort`."""
    from patcher.base.workdir import workdir_lock
    from patcher.formats.stackfiles import load_stack
    from patcher.stack.apply import apply_stack

    if common.run_op(click.get_current_context(), ctx, pin,
                     {"op_continue": op_continue, "op_skip": op_skip, "op_abort": op_abort}, "apply"):
        return
    if not pin:
        raise UsageError("missing argument 'ENGINE@TAG': the pin to apply", hint="e.g. dsadapt apply vllm@v0.32.0; "
                                                                    "`dsadapt apply --continue` goes on after a conflict")
    ref = common.ref_of(pin)
    ctx.lock.pin(ref)  # bad input fails before anything (even the work-dir lock file) is created
    stack = load_stack(ctx.cfg.patches_root, ref)  # parsed once, here: apply_stack takes it as it is
    with workdir_lock(ctx.cfg):
        res = apply_stack(ctx.cfg, ctx.lock, ref, force=force, stack=stack,
                          progress=common.progress_printer(), on_patch=_on_patch(as_json))
    _report(res, as_json, "applied")


def op_command(name: str):
    """`continue`, `skip`, `abort`: a command of that name taking [ENGINE@TAG] (an op can outlive its
    pin: a rebase killed before pinning NEW) and --json."""
    def make(f):
        return click.command(name)(common.pinref_arg(required=False, pinned=False)(common.json_option(common.pass_ctx(f))))
    return make


def _go_on(ctx: common.Context, pin: str | None, as_json: bool, step) -> None:
    """`continue` and `skip`: the op's pin checked before the work-dir lock (bad input leaves
    nothing behind), then `step` (the stack layer's continue or skip) under it, and a rebase it
    finishes gets NEW's environment locks."""
    from patcher.base.workdir import workdir_lock

    ref = _op_ref(ctx, pin)
    rebase = _rebase_in_progress(ctx, ref)
    with workdir_lock(ctx.cfg):
        res = step(ctx.cfg, ref, on_patch=_on_patch(as_json), progress=common.progress_printer())
        _report(res, as_json, "applied")
        if rebase:  # a rebase finished by continue / skip makes NEW's environment locks, as rebase does
            _lock_after_rebase(ctx, res, as_json)


@op_command("continue")
def continue_cmd(ctx: common.Context, pin: str | None, as_json: bool) -> None:
    """Commit the resolved patch and apply the rest of the stack (also finishes an interrupted run)."""
    from patcher.stack.apply import continue_apply

    _go_on(ctx, pin, as_json, continue_apply)


@op_command("skip")
def skip_cmd(ctx: common.Context, pin: str | None, as_json: bool) -> None:
    """Drop the patch that stopped the apply and go on with the rest."""
    from patcher.stack.apply import skip_patch

    _go_on(ctx, pin, as_json, skip_patch)


@op_command("abort")
def abort_cmd(ctx: common.Context, pin: str | None, as_json: bool) -> None:
    """Undo the whole apply (or rebase, or refresh): branches, HEAD, work tree and patches/ as they were."""
    from patcher.base.workdir import workdir_lock
    from patcher.stack.apply import abort_apply

    ref = _op_ref(ctx, pin)  # before the work-dir lock: bad input leaves nothing behind
    with workdir_lock(ctx.cfg):
        co = abort_apply(ctx.cfg, ref, progress=common.progress_printer())
    notes = getattr(co, "notes", [])
    if as_json:
        common.emit_json({"status": "aborted", "ref": str(co.ref), "checkout": str(co.path), "notes": notes},
                         schema="dsadapt.abort/1")
    else:
        common.out(f"{co.ref}: aborted; {co.path} is back where it was")
        for n in notes:
            common.out(f"  note: {n}")


COMMANDS = [apply_cmd, continue_cmd, skip_cmd, abort_cmd]
