"""Blob stores: write-once storage of shard files keyed by shard id (local folder, S3, memory).

It may import boto3 and botocore (the S3 store only), :mod:`service.errors` and
:mod:`service.format`; never the metadata database, the store or its job modules.
"""

from ckptstore.service.blobs.base import BlobStore, StaleUploads
from ckptstore.service.blobs.local import LocalBlobStore
from ckptstore.service.blobs.memory import MemoryBlobStore

__all__ = ["BlobStore", "LocalBlobStore", "MemoryBlobStore", "StaleUploads"]
