"""Format v1, the spec in code: tensor digests, shard headers, shard planning (with tensors sent
before their digests are known), the manifest, encoded tensors and how they are read back, and
the records the store answers with.

It may import blake3, pydantic and :mod:`service.errors` only; no database, blob store or
store, so the client builds and checks what it sends with the same code the engine checks it with.
"""
