"""offline: running the gate on a machine without network.

Packing a bundle (pack: the carry rule, wheels, dsadapt's own wheel), installing from it
(install: `dsadapt install --offline`) and the stdlib bootstrap script copied into every bundle
(bootstrap). Sits beside the gate: neither imports the other. May import build and below.
"""
