"""upstream: what the upstream publishes and how a pinned tree gets here, verified against the lock.

Sources that materialize a pinned tree (sources: git, mirror, pypi), resolving a tag into a pin
(resolve), newer upstream tags (tags) and the CI matrix built from them (matrix). May import the
engines (for their declarations) and everything below.
"""
