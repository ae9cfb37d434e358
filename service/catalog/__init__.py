"""The catalog: what the store holds and how it is named.

Committing versions (``commit``), which digests and shards are held (``lookup``), runs and
versions as listed (``listings``, ``embedded_runs``), refs, tags and deleting versions
(``versions``), shared manifest parts (``manifest_parts``), retention policies and their
application (``retention_rules``, ``retention``) and comparing versions (``diff``).

It may import :mod:`service.format`, :mod:`service.errors`, :mod:`service.db` (with its
collection lock) and :mod:`service.schema_revisions`; never :mod:`service.intake`,
:mod:`service.reclaim`, the store or ``api``.
"""
