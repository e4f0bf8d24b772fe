"""stack: the user's checkout and every change to a stack, through one transaction.

The transaction over `git am -3` (transaction: record, act, roll back or forward; the record
itself is plain data in state), the checkout made from a verified source, its refs and its state on disk (checkout), the
op kinds that plug into the transaction -- apply (with continue / skip / abort and a pin's tree
as engines see it), refresh (with the export to patches/), rebase (with its report) -- then
where each checkout stands (status) and `verify` in a place of its own (verify). Nothing outside
this package writes a checkout's branch, work tree or state, or a stack's files. May import
upstream and everything below it.
"""
