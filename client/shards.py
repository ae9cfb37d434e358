"""Writing shard files: a safetensors header naming tensors by digest, then their bytes."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from client.tensors import byte_view, dtype_name, host_contiguous
from service.format.dtypes import itemsize
from service.format.safetensors_header import encode_header

SHARD_METADATA = {"format": "ckptstore.shard/1"}


def write_shard(
    path: Path,
    tensors: list[tuple[str, str, torch.Tensor]],
    on_bytes: Callable[[int], object] | None = None,
) -> int:
    """Write ``(digest, key, tensor)`` items as one shard at ``path``, fsynced; returns its size.

    Wider dtypes come first so every tensor stays aligned to its element size, as in
    files the safetensors library writes.
    """
    hosts = [(digest, host_contiguous(tensor, key)) for digest, key, tensor in tensors]
    hosts.sort(key=lambda item: -itemsize(dtype_name(item[1], item[0])))
    header, _ = encode_header([(digest, dtype_name(t, digest), list(t.shape)) for digest, t in hosts], SHARD_METADATA)
    size = len(header)
    with open(path, "wb") as handle:
        handle.write(header)
        for _, tensor in hosts:
            data = byte_view(tensor)
            handle.write(data)
            size += len(data)
            if on_bytes is not None:
                on_bytes(len(data))
        handle.flush()
        os.fsync(handle.fileno())
    return size
