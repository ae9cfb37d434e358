"""The raw bytes of many tensors at once, small ones gathered into one buffer per dtype and device.

Handing a tensor's bytes to the store or a shard takes a host view of its memory: a detach, a
numpy view and a cast, some 10-20 us a tensor in all, which a save of 32,768 small tensors paid
for each (0.6 s). Tensors of at most :data:`GATHER_MAX_BYTES` are instead copied together, in
one native call per dtype and device, into one buffer, and each is a slice of it. The copy is
bounded by what one shard holds, a tensor off the host costs one transfer per group instead of
one each, and the buffer is the save's own: what the store hashes and writes from it cannot
change under it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ckptstore.client.tensors import byte_view, host_contiguous
from ckptstore.service.format.sharding import HASH_FIRST_BYTES

#: Tensors of at most this many bytes are gathered; larger ones are viewed in place. The store
#: hashes the tensors of up to this size before it writes them, from the memory given.
GATHER_MAX_BYTES = HASH_FIRST_BYTES


def byte_views(items: Sequence[tuple[str, torch.Tensor, int]]) -> list[memoryview]:
    """The bytes of each ``(key, tensor, nbytes)`` (``nbytes`` its size), in the order given.

    Each tensor must have passed :func:`client.tensors.check_storable`. A view holds the memory
    it shows alive.
    """
    views: list[memoryview | None] = [None] * len(items)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for position, (key, tensor, nbytes) in enumerate(items):
        if nbytes <= GATHER_MAX_BYTES:
            groups.setdefault((tensor.dtype, tensor.device), []).append(position)
        else:
            views[position] = byte_view(host_contiguous(tensor, key))
    for positions in groups.values():
        tensors = [items[position][1] for position in positions]
        with torch.no_grad():  # no graph: the copy is of the values alone
            # One tensor is flattened to a view of itself: torch.cat copies it (bits resolved).
            flat = (
                torch._utils._flatten_dense_tensors(tensors)
                if len(tensors) > 1
                else torch.cat([tensors[0].reshape(-1)])
            )
        data = byte_view(flat.detach().cpu())
        offset = 0
        for position in positions:
            nbytes = items[position][2]
            views[position] = data[offset : offset + nbytes]
            offset += nbytes
    return views  # type: ignore[return-value]  # every position was filled above
