"""A pin's checkout as engines see it (`engines.base.Tree`): applied, or just its verified base."""

from __future__ import annotations

from patcher.base.config import Config
from patcher.engines.base import Progress, Tree
from patcher.formats.lock import Lock
from patcher.formats.pinref import PinRef
from patcher.stack.workspace import Checkout, apply_stack, ensure_checkout


def checkout_tree(cfg: Config, lock: Lock, ref: PinRef, *, patched: bool = True,
                  progress: Progress | None = None) -> Tree:
    """The checkout of `ref` with its stack applied (a no-op when it already is), or, with
    `patched` false, the checkout's verified upstream base (the checkout is left as it is)."""
    if patched:
        apply_stack(cfg, lock, ref, progress=progress)
        co = Checkout(cfg, ref)
        head = co.git.rev(f"refs/heads/{co.branch}")
        assert head, f"{ref}: the applied branch {co.branch} is missing"
        return Tree(ref, co.path, head, True)
    co, _ = ensure_checkout(cfg, lock, lock.pin(ref), progress)
    return Tree(ref, co.path, co.base(), False)
