"""Laying out a shard in memory: a safetensors header naming tensors by digest, then their bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ckptstore.client.tensors import byte_view, dtype_name, host_contiguous
from ckptstore.service.format.digest import shard_id
from ckptstore.service.format.safetensors_header import header_bytes, layout_order
from ckptstore.service.format.sharding import SHARD_METADATA


@dataclass
class ShardPayload:
    """One shard ready to send: its header bytes and a zero-copy view of each tensor's bytes.

    ``tensors`` keeps the host tensors alive for as long as the views are in use.
    """

    header: bytes
    pieces: list[memoryview]
    tensors: list[torch.Tensor]

    @property
    def shard_id(self) -> str:
        """The shard's content address (the digest of its header)."""
        return shard_id(self.header)

    @property
    def size(self) -> int:
        """Bytes in the whole shard file."""
        return len(self.header) + sum(piece.nbytes for piece in self.pieces)


def build_shard(tensors: list[tuple[str, str, torch.Tensor]]) -> ShardPayload:
    """Lay out ``(digest, key, tensor)`` items as one shard, without copying CPU tensors.

    Laid out in :func:`~service.format.safetensors_header.layout_order`, so every tensor stays
    aligned to its element size. Tensors on other devices are copied to the host.
    """
    hosts = [(digest, host_contiguous(tensor, key)) for digest, key, tensor in tensors]
    named = [(digest, dtype_name(t, digest), t) for digest, t in hosts]
    layout = [named[index] for index in layout_order([dtype for _, dtype, _ in named])]
    header = header_bytes([(digest, name, t.shape) for digest, name, t in layout], SHARD_METADATA)
    return ShardPayload(header, [byte_view(t) for _, _, t in layout], [t for _, _, t in layout])
