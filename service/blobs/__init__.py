"""Blob stores: write-once storage of shard files keyed by shard id."""

from service.blobs.base import BlobStore, StaleUploads
from service.blobs.local import LocalBlobStore
from service.blobs.memory import MemoryBlobStore

__all__ = ["BlobStore", "LocalBlobStore", "MemoryBlobStore", "StaleUploads"]
