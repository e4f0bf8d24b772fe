"""runners: the standalone scripts engines' environments run, and how dsadapt runs them.

`RunnerSpec` / `run_runner` (launch: a subprocess with a log and typed errors), the stdlib runner
protocol (dsadapt_runner), the HF reference (hf_reference), bisect's hooks (capture) and the speed
gate's streaming client (stream_load). The scripts never import `patcher`. May import checkpoints
and everything below it.
"""
