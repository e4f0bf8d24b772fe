"""stack: the user's checkout and every change to a stack, through one transaction.

The transaction over `git am -3` (transaction: record, act, roll back or forward), the checkout
and the apply / refresh op kinds with status (workspace), a pin's tree as engines see it (trees),
`verify` in a temporary index (verify), and the rebase op kind with its report (rebase). Nothing
outside this package writes a checkout's branch, work tree or state, or a stack's files. May
import upstream and everything below it.
"""
