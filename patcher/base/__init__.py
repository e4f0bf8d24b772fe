"""base: what every other layer stands on, with no knowledge of stacks, engines or the gate.

Typed errors and exit codes (errors), configuration (config), exact text reading (textfile), the
path rules a patch or artifact must obey (paths), durable writes (fsutil), the git layer (gitutil),
process groups (procs), the work-dir lock (workdir), leftovers of killed runs (leftovers), the
machine in words (machine) and the fault-injection hook (faults). Imports only the standard
library, third-party packages and other modules of this package.
"""
