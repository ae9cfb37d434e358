"""Checking a shard file before it is stored: header rules, then every tensor's digest."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from service.errors import IntegrityError, InvalidShardError
from service.format.digest import TensorHasher
from service.format.safetensors_header import MAX_HEADER_BYTES, ShardHeader, read_header


def verify_shard_file(path: Path, *, max_header_bytes: int = MAX_HEADER_BYTES) -> ShardHeader:
    """Validate the shard at ``path`` and hash every tensor against its digest name.

    Raises:
        InvalidShardError: the file breaks a header or layout rule.
        IntegrityError: a tensor's bytes do not match the digest it is stored under.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        header = read_header(handle, size, max_header_bytes=max_header_bytes)
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for entry in header.entries:
                    hasher = TensorHasher(entry.dtype, entry.shape)
                    hasher.update(view[header.data_start + entry.begin : header.data_start + entry.end])
                    actual = hasher.hexdigest()
                    if actual != entry.digest:
                        raise IntegrityError(
                            f"shard tensor {entry.digest[:16]}… hashes to {actual[:16]}…: its bytes were "
                            "changed or cut in transit; retry the save (stored tensors are not sent again)"
                        )
            finally:
                view.release()
    return header


__all__ = ["verify_shard_file", "InvalidShardError"]
