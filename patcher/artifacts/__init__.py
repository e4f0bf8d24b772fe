"""artifacts: a patched engine as an installable artifact, and the environments it is installed into.

Overlay and full builds through the engine's adapter (builder), one isolated environment per pin
(venvs), the hash locks of every environment and their check against PyPI (envlocks), and
what `dsadapt gc` prunes of derived data no pin uses (prune). May import the stack layer and
everything below it.
"""
