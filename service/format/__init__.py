"""Format v1, the spec in code: tensor digests, shard headers, shard planning and the manifest.

It may import blake3, pydantic and :mod:`service.errors` only; no database, blob store or
store, so the client builds and checks what it sends with the same code the engine checks it with.
"""
