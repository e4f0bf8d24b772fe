"""gate: running engines against the reference and writing verdicts.

`dsadapt check` (equivalence: reference cache, the engine's gate session, the report), `dsadapt bisect`'s
captures (bisect), `dsadapt perf` (perf: both builds side by side), what an engine is lent at run
time (hosts), `dsadapt serve` of an engine through its speed-gate recipe (serve) and the per-pin
summary of every verdict (report, `dsadapt report`). The judgements
themselves live in `patcher.rules`. May import artifacts and below; never offline.
"""
