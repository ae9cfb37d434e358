"""Running a save: the phases that move bytes, in order, around a :class:`~client.saving.plan.SavePlan`.

1. **Plan** — look up cached digests, and (on a store that takes tensors unhashed) which of
   the last save's tensors changed in place; check the manifest with placeholder digests, so a
   bad state tree or metric fails before any byte moves.
2. **Write the changed tensors** — hand them to the store unhashed: it hashes them as it
   writes them, so their bytes are read once and its disk starts at once.
3. **Hash, ask, send** — group by group: hash, ask the store which digests it lacks, queue
   those tensors for the uploader. While a group is hashed, the shards of the groups before it
   are being written, so hashing overlaps the store's I/O.
4. **Commit** — fill in the digests, commit under the save's key.

The save names itself by its commit key from its first question on: everything the store tells
it is present, and everything it stores, is held for it until that commit (garbage collection
keeps it whatever its grace; :mod:`service.db.holds`), so a collection running beside the save
never takes what it is about to reference. Only a save silent past the store's lease (ten
minutes between two calls) can lose its holds, or one relying on a version deleted meanwhile:
its commit then names what is missing, and the save sends that and commits once more, under
holds again.
"""

from __future__ import annotations

import platform
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.client.progress import byte_bar
from ckptstore.client.results import SaveResult
from ckptstore.client.saving.hashing import (
    DigestCache,
    SaveLedger,
    Taken,
    cached_digests,
    digest_all,
    marks_of,
    samples,
)
from ckptstore.client.saving.plan import SavePlan, plan_save
from ckptstore.client.saving.upload import ShardUploader
from ckptstore.client.state import FlatState, TensorRecord
from ckptstore.client.store_protocol import Transport
from ckptstore.client.tensors import dtype_name
from ckptstore.service import __version__
from ckptstore.service.errors import MissingTensorsError
from ckptstore.service.format.bounds import MAX_SIZES_PER_QUERY
from ckptstore.service.format.dtypes import dtype_class
from ckptstore.service.format.manifest import ManifestBody, validate_body
from ckptstore.service.format.records import VersionInfo
from ckptstore.service.format.sharding import MAX_TENSORS_PER_SHARD

#: Stands in for digests while a save's manifest is checked before its tensors are hashed.
PLACEHOLDER_DIGEST = "0" * 64


@dataclass
class SaveSettings:
    """What a save needs from its client besides the state: where and how to write."""

    transport: Transport
    shard_bytes: int
    uploads_in_flight: int
    cache: DigestCache | None
    ledger: SaveLedger


@dataclass
class Snapshot:
    """A save's tensors as they were when a background save snapshotted them
    (:meth:`client.saving.snapshot.Staging.snapshot`)."""

    #: Each record's tensor: a staged copy, or the live tensor where the cache knew its digest.
    tensors: list[torch.Tensor]
    #: Each record's digest where the cache knew it (that tensor was not copied), else None.
    known: list[str | None]
    #: For staged copies of cacheable tensors: the live tensor and what the cache must know
    #: of it as it was copied, so it learns the copy's digest once it is hashed.
    teach: dict[int, tuple[torch.Tensor, Taken | None]]
    #: Bytes copied into staging buffers.
    staged_bytes: int
    #: The device type each record's live tensor is on (a staged copy is on the host).
    device_types: list[str]
    #: Done once the copies from accelerators are complete on the host (None: nothing to wait for).
    copied: torch.cuda.Event | None = None
    #: The ledger's marks (:func:`client.saving.hashing.marks_of`) of the live tensors copied,
    #: read as they were copied; None where the save has no live tensors (a save process).
    marks: dict[int, Any] | None = None
    #: For each record, whether the client saw its tensor change in place since its last save:
    #: what a save process is told, since it sees only the copies (None: the ledger tells).
    moved: list[bool] | None = None


class SaveRun:
    """One save of ``flat`` as the next version of ``run_id``; :meth:`run` does it all."""

    def __init__(
        self,
        settings: SaveSettings,
        run_id: str,
        flat: FlatState,
        *,
        step: int | None,
        metrics: dict[str, float] | None,
        tags: Sequence[str],
        started: float,
        snapshot: Snapshot | None = None,
        check_manifest: bool = True,
        save_key: str | None = None,
    ) -> None:
        """Save ``flat``'s tensors as they are now, or as a background save's ``snapshot`` of
        them holds them (then the cache is not asked here: the snapshot did). Without
        ``check_manifest`` no manifest is built: the caller only :meth:`store` s the tensors (one
        rank of a sharded save) and commits elsewhere. ``save_key`` names the save and its
        commit (default: a new random key): the store holds what the save relies on under it."""
        self.settings = settings
        self.save_key = save_key if save_key is not None else uuid.uuid4().hex
        self.snapshot = snapshot
        self.run_id = run_id
        self.flat = flat
        self.tags = list(tags)
        self.started = started
        self.records: list[TensorRecord] = flat.records
        self.tensors = snapshot.tensors if snapshot is not None else [record.tensor for record in self.records]
        self.digests: list[str] = [PLACEHOLDER_DIGEST] * len(self.records)
        #: Which tensors the digest cache may hold, and the digests it held (None: hash it).
        self.cacheable: list[bool] = []
        self.known: list[str | None] = []
        devices = snapshot.device_types if snapshot is not None else None
        self.body = manifest_body(flat, self.tensors, self.digests, step, metrics, devices) if check_manifest else None
        self.stored_bytes = 0
        self.shards = 0
        #: Small tensors handed to the store unhashed in one shard per kind (see :func:`surely_unstored`).
        self.together: set[int] = set()

    def run(self) -> SaveResult:
        """Plan, write the changed tensors, hash-ask-send the rest, commit; returns the result."""
        plan, marks = self.store()
        info = self.commit(plan)
        self.settings.ledger.keep(marks, frozenset(plan.sizes), frozenset(plan.sizes.values()))
        return SaveResult(
            run_id=self.run_id,
            version=info.version,
            bytes_total=info.bytes_total,
            bytes_new=info.bytes_new,  # the version record's: what no earlier version referenced
            bytes_stored=self.stored_bytes,
            tensors_total=len(self.records),
            tensors_new=info.tensors_new,
            shards=self.shards,
            seconds=time.perf_counter() - self.started,
            bytes_sent=plan.bytes_sent(),
        )

    def store(self) -> tuple[SavePlan, dict[int, Any]]:
        """Phases 1-3: every tensor hashed (:attr:`digests`) and stored unless the store has it.

        Returns the plan and the ledger marks to keep once a version holding these is committed.
        """
        if self.snapshot is not None and self.snapshot.copied is not None:
            self.snapshot.copied.synchronize()  # the staged copies' last bytes may still be on their way
        plan, marks = self.plan()
        lengths = plan.lengths
        with (
            byte_bar(sum(lengths), "save") as bar,
            ShardUploader(
                self.settings.transport,
                self.settings.shard_bytes,
                bar.update,
                self.settings.uploads_in_flight,
                self.save_key,
            ) as uploader,
        ):
            taken = self.write_changed(plan, uploader)
            for group in plan.groups:
                self.hash_ask_send(plan, group, uploader, bar.update)
            uploader.flush()
            self.stored_bytes, self.shards = uploader.finish()
        self.keep_unhashed_digests(plan, uploader.digests, taken)
        if self.settings.cache is not None and self.snapshot is not None:
            for index, (live, snapshot_taken) in self.snapshot.teach.items():
                self.settings.cache.put(live, self.digests[index], snapshot_taken)
        return plan, marks

    # -- phases ------------------------------------------------------------------------

    def plan(self) -> tuple[SavePlan, dict[int, Any]]:
        """The plan, and the ledger marks to keep once the version is committed."""
        settings = self.settings
        if self.snapshot is not None:  # it asked the cache about the live tensors
            self.cacheable = [False] * len(self.records)
            self.known = list(self.snapshot.known)
        else:
            self.cacheable = [record.trainable is False for record in self.records]  # see client.saving.hashing
            self.known = cached_digests(settings.cache, self.tensors, self.cacheable)
        lengths = [tensor.numel() * tensor.element_size() for tensor in self.tensors]
        marks: dict[int, Any] = {}
        likely_new = None
        holders = _holders(self.tensors)
        if _may_take_unhashed(settings.transport):
            frozen = [record.trainable is False for record in self.records]
            unseen, together = surely_unstored(
                settings.transport, self.tensors, lengths, frozen, holders, settings.shard_bytes, settings.ledger.sizes
            )
            if settings.transport.takes_unhashed:  # known now: the sizes' answer told
                changed, marks = self.changed_in_place()
                likely_new = [moved or new for moved, new in zip(changed, unseen, strict=True)]
                self.together = together
        plan = plan_save(
            lengths,
            self.known,
            shard_bytes=settings.shard_bytes,
            likely_new=likely_new,
            holders=holders,
            committed=settings.ledger.committed,
        )
        return plan, marks

    def changed_in_place(self) -> tuple[list[bool], dict[int, Any]]:
        """For each record, whether its tensor changed in place since the last save (the
        ledger's :meth:`~client.saving.hashing.SaveLedger.changed`), and the marks to keep.

        A snapshot's copies are the client's staging buffers, rewritten at every save: the
        ledger follows the live tensors they were copied from, as they were when copied, so a
        tensor staged at every save (a frozen one below the digest cache's size, or any after
        a save without a step) is not taken for changed at every save.
        """
        ledger, snapshot = self.settings.ledger, self.snapshot
        if snapshot is not None and snapshot.moved is not None:
            return snapshot.moved, {}  # a save process's copies: the client followed the live tensors
        if snapshot is None or snapshot.marks is None:
            marks = marks_of(self.tensors)
            return ledger.changed(self.tensors, marks), marks
        live = [record.tensor for record in self.records]
        uncopied = [tensor for tensor, saved in zip(live, self.tensors, strict=True) if tensor is saved]
        marks = {**marks_of(uncopied), **snapshot.marks}
        return ledger.changed(live, marks), marks

    def write_changed(self, plan: SavePlan, uploader: ShardUploader) -> dict[int, Taken | None]:
        """Hand the plan's changed tensors to the store unhashed; returns what the cache must
        know of them, read before their bytes are (a tensor changed while it is written is not
        cached as written)."""
        cache = self.settings.cache
        taken = {
            i: cache.take(self.tensors[i]) if cache is not None and self.cacheable[i] else None
            for i in plan.write_first
        }
        total = sum(plan.lengths[i] for i in plan.write_first)
        # Bytes that make one shard per kind anyway all go together, small tensors or not.
        if total <= uploader.balance_unhashed(total):
            for index in plan.write_first:
                self._add_unhashed(uploader, plan, index, together=True)
        else:  # the small tensors' shard first, beside the large ones (see ShardUploader.flush_together)
            for index in plan.write_first:
                if index in self.together:
                    self._add_unhashed(uploader, plan, index, together=True)
            uploader.flush_together()
            for index in plan.write_first:
                if index not in self.together:
                    self._add_unhashed(uploader, plan, index, together=False)
        uploader.flush()
        return taken

    def _add_unhashed(self, uploader: ShardUploader, plan: SavePlan, index: int, *, together: bool) -> None:
        uploader.add_unhashed(
            index,
            self.records[index].key,
            self.tensors[index],
            plan.lengths[index],
            frozen=self.frozen(index),
            together=together,
        )

    def hash_ask_send(
        self, plan: SavePlan, group: list[int], uploader: ShardUploader, on_skipped: Callable[[int], object]
    ) -> None:
        """Hash one group, ask the store which of its digests it lacks, queue those tensors."""
        hashed = digest_all(
            [(self.records[i].key, self.tensors[i]) for i in group],
            self.settings.cache,
            known=[self.known[i] for i in group],
            cacheable=[self.cacheable[i] for i in group],
        )
        for index, digest in zip(group, hashed, strict=True):
            self.digests[index] = digest
        asked = plan.to_ask(group, hashed)
        absent = set(self.settings.transport.missing(asked, save_key=self.save_key)) if asked else set()
        sending = plan.to_send(group, hashed, absent)
        for index in sending.indexes:
            uploader.add(
                self.digests[index],
                self.records[index].key,
                self.tensors[index],
                plan.lengths[index],
                frozen=self.frozen(index),
            )
        on_skipped(sending.skipped_bytes)

    def frozen(self, index: int) -> bool:
        """Whether tensor ``index`` was saved frozen (``trainable`` False): packed apart from the rest."""
        return self.records[index].trainable is False

    def keep_unhashed_digests(self, plan: SavePlan, digests: dict[int, str], taken: dict[int, Taken | None]) -> None:
        """Record the digests the store found for the tensors it took unhashed."""
        cache = self.settings.cache
        for index, digest in digests.items():
            self.digests[index] = digest
            plan.took_unhashed(index, digest)
            if cache is not None:
                cache.put(self.tensors[index], digest, taken[index])

    def commit(self, plan: SavePlan) -> VersionInfo:
        """Commit the version with its digests filled in, under the save's key.

        What the store told this save is present, and what it stored, is held for it until this
        commit. If a tensor is missing all the same (the save was silent past the store's lease,
        or it relied on the last version's tensors and that version was deleted and collected
        meanwhile), the commit changes nothing: ask again and send what is missing now, both
        held for the save, and commit once more. Both tries carry the save's key, so a commit
        sent again after a lost answer commits once.
        """
        transport = self.settings.transport
        assert self.body is not None, "a save built without its manifest does not commit"
        body = with_digests(self.body, self.digests)
        commit_key = self.save_key
        try:
            return transport.commit(self.run_id, body, tags=self.tags, commit_key=commit_key)
        except MissingTensorsError as missing:
            again = set(transport.missing(list(plan.sizes), save_key=commit_key))
            if any(self.tensors[i].is_meta for i, digest in enumerate(self.digests) if digest in again):
                raise missing  # a snapshot without the bytes (a save process's): the caller has them
            with ShardUploader(
                transport, self.settings.shard_bytes, None, self.settings.uploads_in_flight, commit_key
            ) as uploader:
                queued: set[str] = set()
                for index, digest in enumerate(self.digests):
                    if digest in again and digest not in queued:
                        key, tensor = self.records[index].key, self.tensors[index]
                        uploader.add(digest, key, tensor, plan.sizes[digest], frozen=self.frozen(index))
                        queued.add(digest)
                stored, shards = uploader.finish()
            self.stored_bytes += stored
            self.shards += shards
            plan.sent |= again
            return transport.commit(self.run_id, body, tags=self.tags, commit_key=commit_key)


#: Tensors below this size are told apart by the store, not by samples taken here: a save's
#: tensors this small and of sizes the store holds none of are handed over unhashed in one
#: shard per kind, where the store writes equal ones once (sampling each cost more than hashing
#: it twice).
UNSEEN_MIN_BYTES = 64 << 10


def surely_unstored(
    transport: Transport,
    tensors: list[torch.Tensor],
    lengths: list[int],
    frozen: list[bool],
    holders: list[int],
    shard_bytes: int,
    held: frozenset[int] = frozenset(),
) -> tuple[list[bool], set[int]]:
    """For each tensor, whether it cannot be stored yet and is handed to the store unhashed:
    written at once and hashed once, by the store as it writes it, instead of hashed first to
    ask about it (a first save into a new store hashes every byte once, not twice).

    A tensor cannot be stored when no stored tensor has its size (:meth:`Store.sizes_held`).
    Two tensors of this save with the same size might be equal (zero-initialised buffers and
    adapters, layer norms at one), and equal bytes must be stored once:

    - tensors of at least :data:`UNSEEN_MIN_BYTES` go unhashed when their samples
      (:func:`client.saving.hashing.samples`) match no other's of their size; the others are
      hashed first, as before;
    - smaller ones go unhashed together (the indexes returned second), in one shard per kind
      (``frozen`` or not) that the store deduplicates (:class:`client.saving.upload.ShardUploader`'s
      ``together``), when every small tensor of their kind can: of a size the store holds none of
      and the other kind has none of, held under one key (``holders``), and all of them fit one
      shard (at most ``MAX_TENSORS_PER_SHARD``, at most ``shard_bytes`` in all). Otherwise the
      kind's small tensors are all hashed first, as before, so they share one shard still.

    The store is asked only about sizes not ``held`` (sizes the caller knows it holds: those of
    the last committed version's tensors). A model of more such sizes than the store looks up at
    once is hashed first too.
    """
    flags = [False] * len(lengths)
    sizes = {nbytes for nbytes in lengths if nbytes > 0}
    asked = sizes - held
    if not sizes or len(asked) > MAX_SIZES_PER_QUERY:
        return flags, set()
    unseen = asked - transport.sizes_held(asked) if asked else set()
    together = _small_together(lengths, frozen, holders, unseen, shard_bytes)
    for index in together:
        flags[index] = True
    by_size: dict[int, list[int]] = {}
    for index, nbytes in enumerate(lengths):
        if nbytes in unseen:
            by_size.setdefault(nbytes, []).append(index)
    for nbytes, indexes in by_size.items():
        if nbytes < UNSEEN_MIN_BYTES:
            continue  # decided above
        taken_now = samples([tensors[i] for i in indexes]) if len(indexes) > 1 else [b""]
        counts = Counter(taken_now)
        for index, taken in zip(indexes, taken_now, strict=True):
            flags[index] = counts[taken] == 1
    return flags, together


def _small_together(
    lengths: list[int], frozen: list[bool], holders: list[int], unseen: set[int], shard_bytes: int
) -> set[int]:
    """The small tensors (under :data:`UNSEEN_MIN_BYTES`) that go unhashed in one shard per kind:
    those of each kind whose small tensors all may (see :func:`surely_unstored`)."""
    small = [i for i, nbytes in enumerate(lengths) if 0 < nbytes < UNSEEN_MIN_BYTES]
    kinds_of_size: dict[int, set[bool]] = {}
    for index in small:
        kinds_of_size.setdefault(lengths[index], set()).add(frozen[index])
    together = set()
    for kind in (False, True):
        mine = [i for i in small if frozen[i] == kind]
        if (
            mine
            and len(mine) <= MAX_TENSORS_PER_SHARD
            and sum(lengths[i] for i in mine) <= shard_bytes
            and all(lengths[i] in unseen and holders[i] == 1 and len(kinds_of_size[lengths[i]]) == 1 for i in mine)
        ):
            together.update(mine)
    return together


def _may_take_unhashed(transport: Transport) -> bool:
    """Whether ``transport`` takes unhashed tensors, or has not said yet: a server tells with its
    first answer about sizes, which :func:`surely_unstored` asks anyway (one question, not two)."""
    may = getattr(transport, "may_take_unhashed", None)
    return transport.takes_unhashed if may is None else bool(may)


def _holders(tensors: list[torch.Tensor]) -> list[int]:
    """How many keys hold each tensor's object (tied weights: more than one)."""
    counts: dict[int, int] = {}
    for tensor in tensors:
        counts[id(tensor)] = counts.get(id(tensor), 0) + 1
    return [counts[id(tensor)] for tensor in tensors]


def manifest_body(
    flat: FlatState,
    tensors: list[torch.Tensor],
    digests: list[str],
    step: int | None,
    metrics: dict[str, float] | None,
    device_types: list[str] | None = None,
) -> ManifestBody:
    """The manifest body of a save, validated (StateEncodingError/InvalidManifestError naming the problem).

    ``tensors``: each record's tensor, or the copy a background save's snapshot holds of it;
    ``device_types``: where the snapshot's copies are, the device each live tensor is on (by
    default each tensor's own).

    Entries are built as plain dicts and the whole body is validated once: a TensorEntry
    built on its own is checked again when the body holds it.
    """
    return validate_body(
        {
            "tensors": [
                _entry(record, tensor, digest, device_types[index] if device_types is not None else None)
                for index, (record, tensor, digest) in enumerate(zip(flat.records, tensors, digests, strict=True))
            ],
            "state": flat.state,
            "step": step,
            "metrics": dict(metrics or {}),
            "library": library_versions(),
            "optimizer_class": flat.optimizer_class,
        }
    )


def check_step_and_metrics(step: int | None, metrics: dict[str, float] | None) -> None:
    """Refuse a bad ``step`` or ``metrics`` as :func:`manifest_body` would, without the tensors
    (InvalidManifestError naming the problem): what a background save checks before it returns."""
    validate_body({"tensors": [], "step": step, "metrics": dict(metrics or {})})


def library_versions() -> dict[str, str]:
    """The versions a manifest records of the libraries that wrote it."""
    return {"ckptstore": __version__, "torch": torch.__version__, "python": platform.python_version()}


def with_digests(body: ManifestBody, digests: list[str]) -> ManifestBody:
    """``body`` with each entry's placeholder replaced by its digest, in place.

    The body was validated with placeholders, and a digest (made by this client's hashing, so
    of the right form) does not change what else an entry may hold, so the entries are not
    validated again. The body is the save's own, built for it and not yet shown to anyone:
    each digest is written into its entry, where copying 32,768 frozen entries cost more than
    writing their bytes.
    """
    for entry, digest in zip(body.tensors, digests, strict=True):
        if entry.digest != digest:
            entry.__dict__["digest"] = digest
    return body


def _entry(record: TensorRecord, tensor: torch.Tensor, digest: str, device_type: str | None) -> dict[str, Any]:
    name = dtype_name(tensor, record.key)
    if device_type is None:
        # tensor.device.type builds a device object each time: 0.3 us, against 0.05 for is_cpu.
        device_type = "cpu" if tensor.is_cpu else tensor.device.type
    return {
        "key": record.key,
        "dtype": name,
        "shape": list(tensor.shape),
        "dtype_class": dtype_class(name),
        "digest": digest,
        "placement": record.placement,
        "param": record.param,
        "device_type": device_type,
        "trainable": record.trainable,
        "requires_grad": record.requires_grad,
    }
