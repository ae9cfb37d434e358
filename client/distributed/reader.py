"""StoreReader: ckptstore as the storage of ``torch.distributed.checkpoint.load``.

DCP's metadata is rebuilt from the version's JSON manifest (never unpickled): every tensor's
global shape, dtype and chunks, every non-tensor item and its path (:mod:`client.distributed.layout`).
DCP then plans which pieces of which chunks each rank needs, for whatever sharding the ranks
have now, so a version saved by N ranks loads on M. Each rank reads only the chunks it needs,
verifies each against its digest, and copies the requested part into place; a chunk that is
exactly a destination tensor is read straight into it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptstore.client import jsonstate
from ckptstore.client.distributed.clients import StoreClient, default_store_client
from ckptstore.client.distributed.layout import ObjPath, fqn, names_a_run, stored_items
from ckptstore.client.loading.reader import PieceSpec, TensorReader
from ckptstore.client.tensors import NAME_TO_TORCH, is_plain_dense
from ckptstore.service.errors import InvalidInputError, StateEncodingError, StateMismatchError
from ckptstore.service.format.manifest import Manifest, TensorEntry
from ckptstore.service.format.names import validate_run_id


@dataclass(frozen=True)
class _Chunk:
    """One stored chunk of a tensor: the entry it belongs to, where it starts, what it holds."""

    entry: TensorEntry
    offsets: tuple[int, ...]
    spec: PieceSpec

    @property
    def label(self) -> str:
        return f"{self.entry.key}@{list(self.offsets)}" if any(self.offsets) else self.entry.key


class StoreReader(StorageReader):
    """A ``StorageReader`` loading a version of a ckptstore run.

    ``dcp.load(state_dict, storage_reader=StoreReader("run"))`` on every rank. DCP calls, on
    every rank: :meth:`reset`, :meth:`read_metadata`, :meth:`set_up_storage_reader`,
    :meth:`prepare_local_plan`, :meth:`read_data`; on the coordinator also
    :meth:`prepare_global_plan`, which checks that every rank resolved the same version.

    Args:
        run_id: the run to read.
        version: a number, ``"latest"`` or a tag. Each rank resolves it itself; pass a number
            when a save to the run may commit while the ranks start loading.
        client: the store to read from (default :func:`client.default_client`).
    """

    def __init__(self, run_id: str, version: int | str = "latest", *, client: StoreClient | None = None) -> None:
        self.run_id = validate_run_id(run_id)
        self.version = version
        self.client = client if client is not None else default_store_client()
        self.manifest: Manifest | None = None
        self.bytes_read = 0
        self._chunks: dict[MetadataIndex, _Chunk] = {}
        self._values: dict[str, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load; a ``checkpoint_id`` given to ``dcp.load`` names the run."""
        if checkpoint_id is not None:
            self.run_id = validate_run_id(str(checkpoint_id))
        self.manifest = None

    # The extra arguments are named ``options``, not ``kwargs``: DCP retries a failed read with
    # ``rank=`` when the parameter is called ``kwargs``, which would hide the first error.
    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        """DCP's metadata for the version, rebuilt from its JSON manifest."""
        manifest = self.client.transport.manifest(self.run_id, self.version)
        self.manifest = manifest
        entries = {entry.key: entry for entry in manifest.tensors}
        described: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        paths: dict[str, ObjPath] = {}
        self._chunks, self._values = {}, {}
        for item in stored_items(manifest):
            name = fqn(item.path)
            if name in described:
                raise StateMismatchError(f"version {manifest.version}: two items are named {name!r} for DCP")
            paths[name] = item.path
            if item.key is None:
                described[name] = BytesStorageMetadata()
                self._values[name] = item.value
                continue
            entry = entries.get(item.key)
            if entry is None:
                raise StateMismatchError(f"version {manifest.version}: state refers to tensor {item.key!r}, not stored")
            chunks = _chunks_of(entry)
            for chunk in chunks:
                self._chunks[MetadataIndex(name, chunk.offsets)] = chunk
            described[name] = TensorStorageMetadata(
                TensorProperties(dtype=NAME_TO_TORCH[entry.dtype]),
                torch.Size(entry.shape),
                [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.spec.shape)) for c in chunks],
            )
        return Metadata(
            state_dict_metadata=dict(described),
            planner_data=paths,
            storage_meta=StorageMeta(checkpoint_id=self.run_id),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: :meth:`read_metadata` kept what the reads need."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Tag the plan with the version this rank resolved, for the coordinator to compare."""
        assert self.manifest is not None, "read_metadata comes first"
        plan.storage_data = self.manifest.version
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Refuse a load whose ranks resolved ``version`` to different versions."""
        seen = sorted({plan.storage_data for plan in plans if plan.storage_data is not None})
        if len(seen) > 1:
            raise InvalidInputError(
                f"the ranks resolved {self.version!r} of run {self.run_id} to different versions {seen} "
                "(a save committed meanwhile); load a version number"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the chunks this rank's plan needs, verified, into the planner's tensors."""
        assert self.manifest is not None, "read_metadata comes first"
        by_chunk: dict[str, list[tuple[ReadItem, torch.Tensor]]] = {}
        chunks: dict[str, _Chunk] = {}
        for request in plan.items:
            if request.type == LoadItemType.BYTE_IO:
                _deliver_value(planner, request, self._decode(request.storage_index.fqn))
                continue
            chunk = self._chunks[request.storage_index]
            chunks[chunk.label] = chunk
            by_chunk.setdefault(chunk.label, []).append((request, planner.resolve_tensor(request).detach()))
        into = {label: requests[0][1] for label, requests in by_chunk.items() if _fills_whole(requests, chunks[label])}
        reader = TensorReader(
            self.client.transport,
            self.manifest,
            read_threads=self.client.read_threads,
            digests=[c.spec.digest for c in chunks.values() if 0 not in c.spec.shape],
        )
        pieces = {label: chunk.spec for label, chunk in chunks.items()}
        with closing(reader.read_pieces(pieces, into=into)) as stream:
            for label, tensor in stream:
                for request, destination in by_chunk[label]:
                    source = _narrow(tensor, request.storage_offsets, request.lengths)
                    if source.data_ptr() != destination.data_ptr() or source.numel() == 0:
                        destination.copy_(source)
                    planner.commit_tensor(request, destination)
        self.bytes_read += reader.bytes_read
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` can name a run."""
        return names_a_run(checkpoint_id)

    def _decode(self, name: str) -> Any:
        def no_tensor(key: str) -> torch.Tensor:
            raise StateEncodingError(f"{name}: a stored value refers to tensor {key!r} inside it")

        return jsonstate.decode(self._values[name], no_tensor)


def _chunks_of(entry: TensorEntry) -> list[_Chunk]:
    if entry.digest is not None:
        return [_Chunk(entry, (0,) * len(entry.shape), PieceSpec(entry.dtype, list(entry.shape), entry.digest))]
    return [
        _Chunk(entry, tuple(c.offsets), PieceSpec(entry.dtype, list(c.shape), c.digest)) for c in entry.chunks or ()
    ]


def _fills_whole(requests: list[tuple[ReadItem, torch.Tensor]], chunk: _Chunk) -> bool:
    """Whether the chunk can be read straight into its one destination: the request takes the
    whole chunk, and the destination is plain CPU memory of the stored dtype."""
    if len(requests) != 1:
        return False
    request, destination = requests[0]
    return (
        not any(request.storage_offsets)
        and list(request.lengths) == chunk.spec.shape
        and destination.dtype == NAME_TO_TORCH[chunk.spec.dtype]
        and is_plain_dense(destination)
    )


def _narrow(tensor: torch.Tensor, offsets: Iterable[int], lengths: Iterable[int]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, start, length)
    return tensor


def _deliver_value(planner: LoadPlanner, request: ReadItem, value: Any) -> None:
    """Put a non-tensor value where the planner's ``load_bytes`` would, without unpickling."""
    if not isinstance(planner, DefaultLoadPlanner):
        raise StateEncodingError(
            f"{request.dest_index.fqn}: planner {type(planner).__name__} takes non-tensor values only as pickled "
            "bytes; ckptstore never pickles: load with DefaultLoadPlanner"
        )
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[request.dest_index.fqn], value)
    else:
        planner.state_dict[request.dest_index.fqn] = value
