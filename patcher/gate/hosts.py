"""What the orchestration lends an engine at run time (`engines.base.RunServices`).

`RunHost` gives an engine its pin's checkout and environments; `check` (the gate session),
`serve` and, later, `perf` hand one to the engine they run. With `locked`, each service
takes the work-dir lock for its own duration only (a server that runs until Ctrl-C must
not hold the work dir).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from patcher.artifacts.venvs import install_plan
from patcher.base.config import Config
from patcher.base.workdir import workdir_lock
from patcher.engines.base import EngineEnv, EnvPlan, Progress, Tree
from patcher.formats.lock import Lock
from patcher.formats.pinref import PinRef
from patcher.stack.apply import checkout_tree


class RunHost:
    def __init__(self, cfg: Config, lock: Lock, progress: Progress | None = None, stream: bool = True,
                 locked: bool = False):
        self.cfg, self.lock, self.progress, self.stream, self.locked = cfg, lock, progress, stream, locked
        # environments made (or found) by this host: a check over several dtypes, or a check and its
        # bisect, build and install each once per command, not once per run
        self._envs: dict[tuple, EngineEnv] = {}

    def _guard(self):
        return workdir_lock(self.cfg) if self.locked else contextlib.nullcontext()

    def checkout(self, ref: PinRef, *, patched: bool = True) -> Tree:
        with self._guard():
            return checkout_tree(self.cfg, self.lock, ref, patched=patched, progress=self.progress)

    def environment(self, plan: EnvPlan, *, unpatched: bool = False) -> EngineEnv:
        try:
            key: tuple | None = (plan, unpatched)
            if key in self._envs:
                return self._envs[key]
        except TypeError:  # a plan that cannot be a key (an engine's own mutable recipe): made each time
            key = None
        with self._guard():
            res = install_plan(self.cfg, self.lock, plan, unpatched=unpatched, progress=self.progress,
                               stream=self.stream)
        env = EngineEnv(Path(res.python), Path(res.venv), Path(res.artifact).name, res.sha256, res.reused,
                        tuple(res.removed), dict(res.details))
        if key is not None:
            self._envs[key] = env
        return env
