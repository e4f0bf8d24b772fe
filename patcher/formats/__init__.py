"""formats: the project's files and their data types, parsed and written by pure functions.

`ENGINE@TAG` references (pinref), upstream.lock (lock), one patch (patchfile), a stack on disk
(stackfiles: series + patches, stack hash, pre-image chain), which artifact members make a tree
(sourcetree), wheels rewritten without recompression (wheel), and the offline bundle's manifest
(bundle). May import `patcher.base` only: no git processes, no engines, no network.
"""
