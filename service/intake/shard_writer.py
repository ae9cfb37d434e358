"""Writing a shard from tensors whose digests are not known yet: one pass, the header last.

A save that already knows a tensor changed since it was last stored (its version counter
moved) need not hash it before asking the store about it: the answer is almost surely
"missing". The store then takes the bytes straight away, hashing each tensor from the same
memory it copies to the file, as :class:`service.intake.receiver.ShardReceiver` does for a shard
whose digests it must check. Here the digests come out of that pass instead of being checked
by it, so every byte is read once.

Each tensor is hashed piece by piece from the writer's buffer, right after the piece is copied
there and before the buffer goes to the device, so the digest is of the bytes as written and
hashing one piece overlaps the device writing the pieces before it. Equal tensors are written
once: a tensor that may equal one before it in the shard (same dtype, shape and sampled bytes)
is hashed first instead, and written only if its digest is new. So is every small tensor
(:data:`HASH_FIRST_BYTES`), where sampling cost as much as hashing.

The header names tensors by digest, so it is written last, into room left at the start of
the file. Its size does not depend on the digests (all are 64 characters), and it is padded to
a disk block so the data behind it can be written around the page cache before it is known.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptstore.service.format.digest import TensorHasher, tensor_digest
from ckptstore.service.format.safetensors_header import ShardHeader, header_bytes, header_size, laid_out_entries
from ckptstore.service.format.sharding import HASH_FIRST_BYTES, UnhashedTensor, fingerprint
from ckptstore.service.intake.direct_file import ALIGNMENT, DEFAULT_IN_FLIGHT, DirectFileWriter
from ckptstore.service.intake.receiver import staging_error


@dataclass(frozen=True)
class WrittenShard:
    """What :func:`write_shard` wrote: the digest of each tensor given, in order, and the
    header of the file, which names each distinct digest once."""

    digests: list[str]
    header: ShardHeader


def write_shard(
    path: Path,
    tensors: Sequence[UnhashedTensor],
    metadata: dict[str, str],
    *,
    direct_writes: bool = True,
    on_bytes: Callable[[int], object] | None = None,
    exists: bool = False,
) -> WrittenShard:
    """Write ``tensors``, in the order given, as a new shard file at ``path``, hashing each on the way.

    A tensor equal to one before it is not written again. The file is complete (not yet
    fsynced) when this returns; on an error it is gone. ``on_bytes`` is called with each
    tensor's size once it is written. With ``exists`` the file was made empty and is held by
    the caller (:func:`service.blobs.held_file.hold_new`).
    """
    room = header_size([(t.dtype, t.shape) for t in tensors], metadata, align=ALIGNMENT)
    try:
        writer = DirectFileWriter(path, direct=direct_writes, in_flight=DEFAULT_IN_FLIGHT, start=room, exists=exists)
    except OSError as exc:
        raise staging_error(exc, path) from exc
    digests: list[str] = []
    written: dict[str, UnhashedTensor] = {}
    seen: set[tuple[str, tuple[int, ...], bytes]] = set()
    try:
        for tensor in tensors:
            hash_first = tensor.data.nbytes <= HASH_FIRST_BYTES
            if not hash_first:
                sampled = fingerprint(tensor)
                hash_first = sampled in seen
                seen.add(sampled)
            if hash_first:  # small, or it may equal a tensor before it: hash first, write if new
                digest = tensor_digest(tensor.dtype, tensor.shape, tensor.data, parallel=False)
                if digest not in written:
                    writer.write(tensor.data)
            else:  # no tensor before it can be equal: hash the bytes as they are written
                hasher = TensorHasher(tensor.dtype, tensor.shape, parallel=False)
                writer.write(tensor.data, hasher.update)
                digest = hasher.hexdigest()
            digests.append(digest)
            written.setdefault(digest, tensor)
            if on_bytes is not None:
                on_bytes(tensor.data.nbytes)
        named = [(digest, t.dtype, t.shape) for digest, t in written.items()]
        header = header_bytes(named, metadata, align=ALIGNMENT, at_least=room)
        writer.write_head(header)
        writer.close()
    except OSError as exc:
        writer.abort()
        path.unlink(missing_ok=True)
        raise staging_error(exc, path) from exc
    except BaseException:
        writer.abort()
        path.unlink(missing_ok=True)
        raise
    # The header was written here from digests made here: its entries are known, not parsed
    # (parsing 32,768 of them took 0.3 s).
    return WrittenShard(digests, ShardHeader(header, laid_out_entries(named), dict(metadata)))
