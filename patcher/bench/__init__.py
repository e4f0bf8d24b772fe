"""bench: `dsadapt bench`: what dsadapt costs next to the tools it replaces, written to docs/benchmarks.md.

Builds and check timings (builds), stack operations next to raw git (stack_ops) and the speed
gate's section of the page (speed_doc). May import every layer but the CLI.
"""
