"""rules: the gate's judgements, pure: what counts as equal, as divergent, as slower.

The logit rule and the runners' report schema (logits), the per-module rule with its comparison
points and the engine-facing capture tables (modules), the low-precision judgement against the
reference's own noise per phase (noise), a stored check's margins and re-judging (verdicts), the
speed gate's statistics (speed), the fixed prompt set (prompts) and the plots of each (plots). No processes, no engines: data in,
verdicts out. May import `patcher.base` and `patcher.formats`.
"""
