"""build: a patched engine as an installable artifact, and the environments it is installed into.

Overlay and full builds through the engine's adapter (builder), one isolated environment per pin
(venvs) and the hash locks of every environment (envlocks). May import the stack layer and
everything below it.
"""
