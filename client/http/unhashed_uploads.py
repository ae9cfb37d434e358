"""Tensors sent to a server before they are hashed: the server hashes them as it writes them.

A save that knows its tensors are new (they changed since it last saved them, or no stored
tensor has their size) gains nothing from hashing them first: the answer to "which are
missing" is "all of them". Over HTTP that hash was a tenth of a second per 512 MiB before the
first byte could leave, and the server hashed every byte again to check it. Here the bytes go
at once (``POST /v1/shards``, :mod:`service.intake.unhashed_receiver` on the server), and the server's
answer carries the digests it computed.

A shard names each digest once, so tensors that may be equal (the same dtype, shape and sampled
bytes) are hashed here first and each distinct one is sent once. A server that predates the
route (404) or keeps its blobs in S3, where shards go to S3 directly and must be named by their
digests, gets hashed shards as before (:func:`hashed_shard`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptstore.client.http.session import HttpSession
from ckptstore.service.errors import IntegrityError
from ckptstore.service.format.digest import all_digests, tensor_digest
from ckptstore.service.format.records import ShardReceipt, TensorsReceipt
from ckptstore.service.format.safetensors_header import header_bytes, layout_order
from ckptstore.service.format.sharding import SHARD_METADATA, UnhashedTensor, encode_layout, fingerprint

PATH = "/v1/shards"


def send_unhashed(
    session: HttpSession, tensors: Sequence[UnhashedTensor], extra_headers: dict[str, str] | None = None
) -> tuple[ShardReceipt, list[str]]:
    """Store ``tensors`` as one shard the server hashes; the receipt and each tensor's digest, in
    order. ``extra_headers`` go with the upload (a save's ``Save-Key``).

    Raises:
        NotFoundError: the server has no such route (it predates it).
        IntegrityError: the server's digests disagree with the ones computed here, or are malformed.
        CheckpointError: as :meth:`HttpSession.put_bytes` raises them.
    """
    order = layout_order([tensor.dtype for tensor in tensors])
    ordered = [tensors[i] for i in order]
    sent, twins, known = distinct(ordered)
    layout = encode_layout([(ordered[i].dtype, ordered[i].shape) for i in sent])
    body = [memoryview(layout), *(ordered[i].data for i in sent)]
    headers = {"Content-Type": "application/octet-stream", **(extra_headers or {})}
    answer = session.put_bytes(PATH, body, headers, f"uploading {len(sent)} tensors", method="POST")
    receipt = TensorsReceipt.model_validate_json(answer.content)
    if len(receipt.digests) != len(sent) or not all_digests(receipt.digests):
        raise IntegrityError(f"the server answered {len(receipt.digests)} digests for {len(sent)} tensors")
    found = dict(zip(sent, receipt.digests, strict=True))
    for index, digest in known.items():
        if index in found and found[index] != digest:
            raise IntegrityError(
                f"the server hashed tensor {index} of the upload to {found[index][:16]}…, not {digest[:16]}…"
            )
    digests = [""] * len(tensors)
    for position, index in enumerate(order):
        digests[index] = found[twins.get(position, position)]
    return receipt.shard, digests


def distinct(tensors: Sequence[UnhashedTensor]) -> tuple[list[int], dict[int, int], dict[int, str]]:
    """Which of ``tensors`` to send so that no two are equal.

    Returns the indexes to send, in order; for each tensor not sent, the index of the equal one
    sent; and the digests computed here (of the tensors that share a fingerprint with another).
    """
    groups: dict[tuple[str, tuple[int, ...], bytes], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(fingerprint(tensor), []).append(index)
    known: dict[int, str] = {}
    for members in groups.values():
        if len(members) > 1:
            for index in members:
                known[index] = tensor_digest(tensors[index].dtype, tensors[index].shape, tensors[index].data)
    first: dict[str, int] = {}
    sent: list[int] = []
    twins: dict[int, int] = {}
    for index in range(len(tensors)):
        digest = known.get(index)
        if digest is None or first.setdefault(digest, index) == index:
            sent.append(index)
        else:
            twins[index] = first[digest]
    return sent, twins, known


def hashed_shard(tensors: Sequence[UnhashedTensor]) -> tuple[bytes, list[memoryview], list[str]]:
    """``tensors`` hashed here, as a shard to upload named by digests: its header, its pieces (each
    distinct tensor once, laid out by dtype), and each tensor's digest in the order given."""
    digests = [tensor_digest(tensor.dtype, tensor.shape, tensor.data) for tensor in tensors]
    chosen: dict[str, UnhashedTensor] = {}
    for index in layout_order([tensor.dtype for tensor in tensors]):
        chosen.setdefault(digests[index], tensors[index])
    header = header_bytes([(digest, t.dtype, t.shape) for digest, t in chosen.items()], SHARD_METADATA)
    return header, [tensor.data for tensor in chosen.values()], digests
