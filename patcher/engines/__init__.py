"""engines: the engines, one package each, behind one protocol.

The contract (base: `Engine`, its data and the services engines are lent), the speed gate's part
of it (serving), the loader that finds adapters through the entry-point group ``dsadapt.engines``
(registry) and dsadapt's own engines (vllm, lmdeploy, triton). Nothing outside this package
branches on an engine's name. May import runners and everything below it.
"""
