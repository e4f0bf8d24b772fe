"""bench: `dsadapt bench`: what dsadapt costs next to the tools it replaces, written to docs/benchmarks.md.

Builds and check timings (builds), stack operations next to raw git (stack_ops) and the speed
gate's section of the page (gate_reports). May import every layer but the CLI.
"""
