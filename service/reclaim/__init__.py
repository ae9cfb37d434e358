"""Reclaiming space: garbage collection (``gc``), staging cleanup, compaction of small shards and
compression of stored tensors at rest (``compression``, ``encoding_choice``,
``encoded_compaction``, ``compression_buffers``).

It may import :mod:`service.format`, :mod:`service.errors`, :mod:`service.db`,
:mod:`service.blobs`, :mod:`service.catalog` and :mod:`service.intake` (to write what it
rewrites); never the store or ``api``.
"""
