"""Intake: receiving, hashing and writing shards into the store.

A shard's bytes are hashed from the memory they are written from (``receiver``,
``unhashed_receiver``, ``shard_writer``), written with ``O_DIRECT`` or buffered as ``write_mode``
measures (``direct_file``), and recorded by ``ingest``; ``direct_uploads`` lets a client put a
shard straight into S3.

It may import :mod:`service.format`, :mod:`service.errors`, :mod:`service.db`,
:mod:`service.blobs` and the collection lock (:mod:`service.db.lock`); never :mod:`service.catalog`,
:mod:`service.reclaim`, the store or ``api``.
"""
