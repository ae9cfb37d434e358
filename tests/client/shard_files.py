"""What the stored shard files hold, read from the blob store itself."""

from __future__ import annotations

import io

from ckptstore.service.blobs import BlobStore
from ckptstore.service.format.safetensors_header import read_header


def stored_digests(blobs: BlobStore) -> list[str]:
    """Every tensor digest held in any stored shard, with repeats."""
    digests = []
    for blob_id in blobs.list_ids():
        size = blobs.size(blob_id)
        assert size is not None
        data = bytearray(size)
        blobs.read_into(blob_id, 0, memoryview(data))
        digests += [entry.digest for entry in read_header(io.BytesIO(bytes(data)), size).entries]
    return digests
