"""StoreWriter: ckptstore as the storage of ``torch.distributed.checkpoint.save``.

DCP plans what each rank writes; every rank then hashes its own chunks and stores the ones
the store lacks as content-addressed shards (:meth:`StoreWriter.write_data`, the same code
as a single-process save: :class:`client.saving.saver.SaveRun`). The coordinator gathers each
chunk's digest and commits **one** manifest whose tensors carry ``chunks`` tiling their
global shape (:meth:`StoreWriter.finish`). Until that commit nothing is visible: a rank that
dies mid-save leaves stored shards that no version references, which garbage collection
reclaims, and no version.

The coordinator names the save in the global plan (each plan's ``storage_data``: the commit
key), and every rank asks and stores under that key: what the store reports present and what
the ranks store is held for the save until the coordinator's commit, whatever garbage
collection's grace (see :mod:`client.saving.saver`).

Non-tensor items are stored as JSON (:mod:`client.jsonstate`), taken from the planner
before it would pickle them, or refused with an error naming the item. Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptstore.client import jsonstate
from ckptstore.client.distributed.clients import StoreClient, default_store_client
from ckptstore.client.distributed.layout import ObjPath, StateTrees, fqn, names_a_run, stored_path, tensor_key
from ckptstore.client.placement import group_places_step_on_device
from ckptstore.client.results import SaveResult
from ckptstore.client.saving.hashing import SaveLedger
from ckptstore.client.saving.saver import SaveRun, library_versions
from ckptstore.client.state import FlatState, TensorRecord
from ckptstore.client.tensors import TORCH_TO_NAME, dtype_name
from ckptstore.service.errors import StateEncodingError
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.format.dtypes import dtype_class
from ckptstore.service.format.manifest import TENSOR_REF, validate_body
from ckptstore.service.format.names import validate_run_id, validate_tag

#: Called by every rank once its chunks are stored, before it reports them (tests pause a rank
#: here to kill it at the moment its bytes are stored but no version exists).
after_write_hook: Callable[[int], None] | None = None


@dataclass(frozen=True)
class StoredChunk:
    """What a rank reports of one chunk it wrote: its digest and where it came from.

    ``stored_bytes`` and ``shards`` are the rank's totals, carried by its first result only.
    """

    digest: str
    device_type: str
    requires_grad: bool
    sent: bool
    stored_bytes: int = 0
    shards: int = 0


@dataclass(frozen=True)
class StoredValue:
    """What a rank reports of one non-tensor item: its JSON encoding."""

    encoded: Any


class StoreWriter(StorageWriter):
    """A ``StorageWriter`` saving into a ckptstore run as its next version.

    ``dcp.save(state_dict, storage_writer=StoreWriter("run"))`` on every rank; ``dcp.async_save``
    works the same. DCP calls, on every rank: :meth:`reset`, :meth:`set_up_storage_writer`,
    :meth:`prepare_local_plan`, :meth:`write_data`; on the coordinator also
    :meth:`prepare_global_plan` and, last, :meth:`finish`, which commits the version. The
    :class:`~client.results.SaveResult` is then ``metadata.storage_data`` of the metadata
    ``dcp.save`` returns on every rank (and :attr:`result` on the coordinator).

    Args:
        run_id: the run the version is added to.
        client: the store to write to (default :func:`client.default_client`, from the environment).
        step, metrics, tags: recorded with the version, as ``client.save`` records them.
    """

    def __init__(
        self,
        run_id: str,
        *,
        client: StoreClient | None = None,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        tags: Sequence[str] = (),
    ) -> None:
        self.run_id = validate_run_id(run_id)
        self.client = client if client is not None else default_store_client()
        self.step = step
        self.metrics = dict(metrics or {})
        self.tags = [validate_tag(tag) for tag in tags]
        #: FQNs of the trainable model tensors; None: each tensor's ``requires_grad`` tells.
        self.trainable: frozenset[str] | None = None
        self.result: SaveResult | None = None
        self.rank = 0
        self.is_coordinator = False
        #: The key this save commits under, made by the coordinator's global plan.
        self.save_key: str | None = None
        self._started = time.perf_counter()

    # -- the StorageWriter protocol, in the order DCP calls it ----------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save; a ``checkpoint_id`` given to ``dcp.save`` names the run."""
        if checkpoint_id is not None:
            self.run_id = validate_run_id(str(checkpoint_id))
        self.result = None
        self.save_key = None
        self._started = time.perf_counter()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Learn this rank's role."""
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def storage_meta(self) -> StorageMeta | None:
        """The run this save goes to, recorded in DCP's metadata."""
        return StorageMeta(checkpoint_id=self.run_id, save_id=uuid.uuid4().hex)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Nothing to add: chunks are named by digest once written."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Name the save: every rank's plan carries the key it stores under and the coordinator
        commits with (DCP has already given each replicated item to one rank)."""
        self.save_key = uuid.uuid4().hex
        return [dataclasses.replace(plan, storage_data=self.save_key) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Encode this rank's non-tensor items, then hash and store its chunks the store lacks."""
        values = {item.index.fqn: self._encode_value(item, planner) for item in plan.items if _is_value(item)}
        items = [item for item in plan.items if not _is_value(item)]
        flat = FlatState()
        requires_grad = []
        for item in items:
            tensor = planner.resolve_data(item)
            assert isinstance(tensor, torch.Tensor)
            _check_chunk(item, tensor)
            frozen = self.trainable is not None and item.index.fqn not in self.trainable
            flat.add(TensorRecord(_label(item), tensor.detach(), "target", trainable=False if frozen else None))
            requires_grad.append(bool(tensor.requires_grad))
        # A fresh ledger: this rank does not commit, so it must not take the last version's
        # digests as stored (see client.saving.hashing.SaveLedger); the coordinator's commit checks all.
        # The save's key from the global plan (a plan DCP kept from an earlier save may carry that
        # save's key: holds under it lapse unreleased, as those of a killed save do).
        key = plan.storage_data if isinstance(plan.storage_data, str) else None
        run = SaveRun(
            self.client.save_settings(SaveLedger()),
            self.run_id,
            flat,
            step=None,
            metrics=None,
            tags=(),
            started=time.perf_counter(),
            check_manifest=False,
            save_key=key,
        )
        save_plan, _ = run.store()
        results = []
        counted: set[str] = set()
        for number, (item, record, digest) in enumerate(zip(items, flat.records, run.digests, strict=True)):
            sent = digest in save_plan.sent and digest not in counted
            counted.add(digest)
            chunk = StoredChunk(
                digest,
                "cpu" if record.tensor.is_cpu else record.tensor.device.type,
                requires_grad[number],
                sent,
                run.stored_bytes if number == 0 else 0,
                run.shards if number == 0 else 0,
            )
            results.append(WriteResult(item.index, save_plan.lengths[number], chunk))
        results += [
            WriteResult(item.index, 0, StoredValue(values[item.index.fqn])) for item in plan.items if _is_value(item)
        ]
        if after_write_hook is not None:
            after_write_hook(self.rank)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit one manifest for every rank's chunks; the SaveResult goes in ``metadata.storage_data``."""
        stored: dict[tuple[str, tuple[int, ...]], Any] = {
            (r.index.fqn, tuple(r.index.offset or ())): r.storage_data for rank in results for r in rank
        }
        paths: dict[str, ObjPath] = dict(metadata.planner_data or {})
        trees = StateTrees()
        tensors: list[tuple[ObjPath, TensorStorageMetadata, list[tuple[list[int], list[int], StoredChunk]]]] = []
        for name, described in metadata.state_dict_metadata.items():
            path = tuple(paths.get(name, (name,)))
            if isinstance(described, TensorStorageMetadata):
                chunks = [(list(c.offsets), list(c.sizes), stored[(name, tuple(c.offsets))]) for c in described.chunks]
                tensors.append((path, described, chunks))
                if stored_path(path)[0] != "model":
                    trees.put(path, {TENSOR_REF: tensor_key(path)})
            else:
                trees.put(path, stored[(name, ())].encoded)
        state = trees.sections()
        groups = _param_groups(state.get("optim"))
        entries = [self._entry(path, described, chunks, groups) for path, described, chunks in tensors]
        body = validate_body(
            {
                "tensors": entries,
                "state": state,
                "step": self.step,
                "metrics": self.metrics,
                "library": library_versions(),
            }
        )
        # The save's key: the commit is retried after a lost answer, and commits once; it releases
        # what the ranks' stores and questions held.
        key = self.save_key if self.save_key is not None else uuid.uuid4().hex
        info = self.client.transport.commit(self.run_id, body, tags=self.tags, commit_key=key)
        sent = {c.digest: _nbytes(d, s) for _, d, chunks in tensors for _, s, c in chunks if c.sent}
        every = [c for _, _, chunks in tensors for _, _, c in chunks]
        self.result = SaveResult(
            run_id=self.run_id,
            version=info.version,
            bytes_total=info.bytes_total,
            bytes_new=info.bytes_new,  # the version record's: what no earlier version referenced
            bytes_stored=sum(c.stored_bytes for c in every),
            tensors_total=len(entries),
            tensors_new=info.tensors_new,
            shards=sum(c.shards for c in every),
            seconds=time.perf_counter() - self._started,
            bytes_sent=sum(sent.values()),
        )
        metadata.storage_data = self.result

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` can name a run."""
        return names_a_run(checkpoint_id)

    # -- helpers ------------------------------------------------------------------------

    def _encode_value(self, item: WriteItem, planner: SavePlanner) -> Any:
        """The JSON of a non-tensor item, from the planner's object itself (never its pickle)."""
        name = item.index.fqn
        lookup = getattr(planner, "lookup_object", None)
        if lookup is None:
            raise StateEncodingError(
                f"{name}: planner {type(planner).__name__} hands out non-tensor values only pickled; "
                "ckptstore stores them as JSON and needs a planner with lookup_object (DefaultSavePlanner)"
            )

        def refuse(tensor: torch.Tensor, path: str) -> str:
            raise StateEncodingError(f"{path}: a tensor inside a value DCP stores whole (a tuple?); use a list")

        return jsonstate.encode(lookup(item.index), name, refuse)

    def _entry(
        self,
        path: ObjPath,
        described: TensorStorageMetadata,
        chunks: list[tuple[list[int], list[int], StoredChunk]],
        groups: list[dict[str, Any]],
    ) -> dict[str, Any]:
        key = tensor_key(path)
        try:
            name = TORCH_TO_NAME[described.properties.dtype]
        except KeyError:
            raise StateEncodingError(f"{fqn(path)}: dtype {described.properties.dtype} cannot be stored") from None
        shape = list(described.size)
        first = chunks[0][2]
        entry: dict[str, Any] = {
            "key": key,
            "dtype": name,
            "shape": shape,
            "dtype_class": dtype_class(name),
            "device_type": first.device_type,
        }
        filled = [(o, s, c) for o, s, c in chunks if 0 not in s]
        if 0 in shape:
            entry["digest"] = tensor_digest(name, shape, b"")
        elif len(filled) == 1 and filled[0][1] == shape:
            entry["digest"] = filled[0][2].digest
        else:
            entry["chunks"] = [{"offsets": o, "shape": s, "digest": c.digest} for o, s, c in filled]
        where = stored_path(path)
        if where[0] == "model":
            model_fqn = fqn(path)
            trainable = self.trainable
            entry["trainable"] = model_fqn in trainable if trainable is not None else first.requires_grad
        entry["placement"], param = _placement(where, first.device_type, groups)
        if param is not None:
            entry["param"] = param
        return entry


def _is_value(item: WriteItem) -> bool:
    return item.type == WriteItemType.BYTE_IO


def _label(item: WriteItem) -> str:
    """A name for one chunk in errors: the item and, when sharded, where the chunk starts."""
    offsets = list(item.tensor_data.chunk.offsets) if item.tensor_data is not None else []
    return f"{item.index.fqn}@{offsets}" if any(offsets) else item.index.fqn


def _check_chunk(item: WriteItem, tensor: torch.Tensor) -> None:
    if item.tensor_data is None:
        raise StateEncodingError(f"{item.index.fqn}: DCP planned a tensor item without its shape")
    want = list(item.tensor_data.chunk.sizes)
    if list(tensor.shape) != want:
        raise StateEncodingError(
            f"{_label(item)}: the planner resolved a {list(tensor.shape)} tensor for a {want} chunk"
        )
    dtype_name(tensor, _label(item))


def _nbytes(described: TensorStorageMetadata, shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=described.properties.dtype).element_size()


def _param_groups(optim: Any) -> list[dict[str, Any]]:
    """The optimizer's param groups as stored JSON (empty if the state has none)."""
    groups = optim.get("param_groups") if isinstance(optim, dict) else None
    return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []


def _placement(where: ObjPath, device_type: str, groups: list[dict[str, Any]]) -> tuple[str, str | None]:
    """How load places a tensor (docs/FORMAT.md §3), by where it sits in the state."""
    section = where[0]
    if section == "model":
        return "target", None
    if section == "optim" and len(where) >= 4 and where[1] == "state":
        name = str(where[2])
        group = next((g for g in groups if name in (g.get("params") or ())), {})
        if where[3:] == ("step",) and not group_places_step_on_device(group):
            return "host", None
        return "param", name
    if section == "optim" and len(where) >= 3 and where[1] == "param_groups":
        index = where[2]
        owners = groups[index].get("params") if isinstance(index, int) and index < len(groups) else None
        if isinstance(owners, list) and owners and isinstance(owners[0], str):
            return "param", owners[0]
        return "target", None
    return ("host", None) if device_type == "cpu" else ("target", None)
