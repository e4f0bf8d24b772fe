"""cli: the thin click layer: argument parsing, progress, tables, `--json`, and errors rendered once.

The command group with lazily registered commands (main), the error edge (render), the output
options every command takes (options: -q, -v, --color) and one module per command family (commands/). The only layer that prints; nothing below imports it.
"""
