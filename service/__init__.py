"""ckptstore's torch-free engine: format, metadata database, blob stores and the store itself.

The engine is :class:`service.store.Store`, a small facade over one module per job: ``lookup``
(which digests and sizes are held, where bytes live), ``ingest`` (storing shards), ``commit``,
``gc`` and ``compaction``, ``retention``, ``listings``, ``versions`` (refs, tags, deleting a
version) and ``cleanup`` (temporary files). Below it lie ``format/`` (the spec in code),
``db/`` (the metadata database) and ``blobs/`` (shard storage); beside it, ``api/`` (the HTTP
face, which calls the Store).

The core (all of it but ``api/``) may import the standard library, pydantic(-settings),
SQLAlchemy, Alembic, blake3, boto3 and its own modules; never torch, numpy, fastapi,
starlette or ``client`` (tests/test_layering.py holds it to that). Modules import in one
direction, counting imports inside functions: a lower module that needs a higher one's object
asks only for what it uses, as plain arguments or a protocol it defines itself (e.g.
:class:`service.reclaim.cleanup.Staged`).
"""

__version__ = "0.1.0"
