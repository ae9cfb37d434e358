"""Tensor digests on the client, with a cache for frozen tensors that did not change.

Frozen weights (the base model under a LoRA adapter) are hashed once per process: the cache
remembers a tensor object by weak reference together with its storage pointer, layout and
autograd version counter, which in-place operations move, and a sample of its bytes.

The version counter alone is not enough: a write through ``.data`` or a numpy view, a fused
optimizer (``AdamW(fused=True)`` moves only ``step``) and BatchNorm's running statistics all
change a tensor in place without moving it. So a hit also needs :data:`SAMPLE_ELEMENTS`
elements spread over the tensor to be bit for bit as they were; each of those writes rewrites
the whole tensor. They are read as :data:`SAMPLE_RUNS` runs of neighbours, evenly spaced (a
write to any stretch longer than 1/32 of the tensor and 8 elements meets one): a save checks every frozen
tensor, whose memory the training step has just pushed out of the CPU's caches, and 32 reads
from memory cost an eighth of 256. Only model tensors that do not require grad and hold at least
:data:`CACHE_MIN_BYTES` are cached: trainable weights and optimizer state change every step
(an optimizer may update only some rows, which a sample can miss), and small tensors cost
little to hash.

A :class:`SaveLedger` tells which tensors of the client's last save have changed in place
since (their counter moved): a save writes those without hashing them first.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ckptstore.client.tensors import NUMPY_NATIVE, byte_view, dtype_name, host_contiguous
from ckptstore.service.format.digest import tensor_digest

#: Tensors below this size are hashed in the calling thread (see :func:`digest_all`).
INLINE_BYTES = 1 << 20
#: Smaller tensors are always hashed (see the module's docstring).
CACHE_MIN_BYTES = 64 << 10
#: Elements (at least; all of a smaller tensor) that a cache hit compares with the tensor as it was hashed.
SAMPLE_ELEMENTS = 256
#: How many runs of neighbouring elements the sample is read in.
SAMPLE_RUNS = 32

_Fingerprint = tuple[int, int | torch.SymInt, torch.Size, tuple[int, ...], torch.dtype, torch.device, int]


def fingerprint(tensor: torch.Tensor) -> _Fingerprint | None:
    """Identity, layout and version counter of ``tensor`` (None for inference tensors)."""
    try:
        version = tensor._version
    except RuntimeError:  # inference tensors have no version counter
        return None
    # The Size and device objects as they come: copying the shape to a tuple and naming the
    # device as a string doubled the cost (0.92 -> 0.46 us a tensor), and they compare alike.
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tensor.shape,
        tensor.stride(),
        tensor.dtype,
        tensor.device,
        version,
    )


def _picked(tensor: torch.Tensor) -> torch.Tensor:
    """A view of the elements :func:`sample` reads, in order (no copy, no synchronisation)."""
    flat = tensor.detach().reshape(-1)
    count = flat.numel()
    run = SAMPLE_ELEMENTS // SAMPLE_RUNS
    if count >= SAMPLE_ELEMENTS:
        rows = flat[: count - count % run].view(-1, run)
        return rows[:: rows.shape[0] // SAMPLE_RUNS]
    return flat


def sample(tensor: torch.Tensor) -> bytes:
    """The bytes of :data:`SAMPLE_ELEMENTS` elements of ``tensor`` (all of a smaller one), in
    :data:`SAMPLE_RUNS` runs of neighbours evenly spaced, the first element included."""
    picked = _picked(tensor)
    if picked.is_cpu and picked.dtype in NUMPY_NATIVE and not (picked.is_conj() or picked.is_neg()):
        return picked.numpy().tobytes()  # numpy gathers the strided elements: half the time
    return bytes(byte_view(host_contiguous(picked, "sample")))


def samples(tensors: list[torch.Tensor]) -> list[bytes]:
    """:func:`sample` of each of ``tensors``. The samples of accelerator tensors are gathered on
    their device and copied to the host in one transfer per device: a copy each would wait for
    the device once per tensor (a hundred frozen tensors, a hundred synchronisations)."""
    found: list[bytes | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.is_cpu:
            found[index] = sample(tensor)
        else:
            by_device.setdefault(tensor.device, []).append(index)
    for indexes in by_device.values():
        for index, data in zip(indexes, gathered_samples([tensors[i] for i in indexes]), strict=True):
            found[index] = data
    return [data if data is not None else b"" for data in found]


def gathered_samples(tensors: list[torch.Tensor]) -> list[bytes]:
    """:func:`sample` of each of ``tensors`` (all on one device), gathered there into one byte
    tensor and copied to the host at once; one by one where a dtype has no byte view.

    A sample's runs of neighbours are rows whose elements lie side by side, so each tensor's
    picked rows are viewed as bytes where they lie and concatenated, by row width, with the
    others': no copy (nor kernel launch) per tensor, as a ``contiguous()`` each would take.
    """
    try:
        with torch.no_grad():
            blocks = [_byte_rows(t) for t in tensors]
            widths: dict[int, list[torch.Tensor]] = {}
            for block in blocks:
                widths.setdefault(block.shape[1], []).append(block)
            joined = [torch.cat(same).view(-1) for same in widths.values()]
            host = (torch.cat(joined) if len(joined) > 1 else joined[0]).cpu() if joined else None
    except (RuntimeError, TypeError):  # a dtype with no byte view: the slow, exact way
        return [sample(t) for t in tensors]
    data = host.numpy().tobytes() if host is not None else b""
    starts, start = {}, 0
    for width, same in widths.items():  # where each width's rows begin in ``data``
        starts[width] = start
        start += width * sum(block.shape[0] for block in same)
    out = []
    for block in blocks:
        width, size = block.shape[1], block.shape[0] * block.shape[1]
        out.append(data[starts[width] : starts[width] + size])
        starts[width] += size
    return out


def _sample_rows(count: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (rows, elements a row) shape and element strides of the runs :func:`sample` reads
    from a contiguous tensor of ``count`` >= :data:`SAMPLE_ELEMENTS` elements."""
    run = SAMPLE_ELEMENTS // SAMPLE_RUNS
    rows = count // run
    step = rows // SAMPLE_RUNS
    return (-(-rows // step), run), (step * run, 1)  # the rows rows[::step] holds


def _byte_rows(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`_picked` of ``tensor`` as a 2-D uint8 view, one row per run (one row for a small
    tensor); copied only where its elements do not lie side by side or are conjugated/negated.

    A contiguous tensor's rows are one ``as_strided`` view of it (a fifth of the time of the
    views :func:`_picked` chains, which matters at a hundred frozen tensors a save)."""
    if tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
        count = tensor.numel()
        shape, strides = _sample_rows(count) if count >= SAMPLE_ELEMENTS else ((1, count), (max(count, 1), 1))
        return tensor.as_strided(shape, strides, tensor.storage_offset()).view(torch.uint8)
    picked = _picked(tensor).resolve_conj().resolve_neg()
    if picked.dim() == 1:
        picked = picked.contiguous().view(1, picked.numel())
    elif picked.stride(1) != 1:
        picked = picked.contiguous()
    return picked.view(torch.uint8)


def sample_reader(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy view of the bytes :func:`sample` reads from a contiguous CPU ``tensor``, made from
    its address: ``reader.tobytes()`` is its sample in one C call (a sample through torch costs
    a dozen tensor operations). None for other tensors.

    The view holds no reference to the tensor (the cache must not keep a model alive): read it
    only while holding the storage it had here, with the offset and layout it had here, which
    :meth:`DigestCache.get_many` checks first (the fingerprint, and the held storage's address).
    """
    if not tensor.is_cpu or not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        return None
    count, size = tensor.numel(), tensor.element_size()
    if count == 0:
        return None
    raw = (ctypes.c_char * (count * size)).from_address(tensor.data_ptr())
    memory = np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)
    if count < SAMPLE_ELEMENTS:
        return memory
    (picked, run), (stride, _) = _sample_rows(count)
    return np.lib.stride_tricks.as_strided(memory, (picked, run * size), (stride * size, 1), writeable=False)


@dataclass(frozen=True)
class Taken:
    """What the cache keeps of a tensor, read before its bytes are hashed: if the tensor changes
    while it is hashed, the entry no longer matches it."""

    fingerprint: _Fingerprint
    sample: bytes
    #: :func:`sample_reader` of the tensor, where it has one.
    reader: np.ndarray | None = None


@dataclass
class _Entry:
    ref: weakref.ref[torch.Tensor]
    taken: Taken
    digest: str


class DigestCache:
    """Remembers digests of unchanged frozen tensors for the life of the process.

    Callers offer it only model tensors (see the module's docstring); it refuses tensors that
    require grad or are smaller than ``min_bytes``.
    """

    def __init__(self, min_bytes: int = CACHE_MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, tensor: torch.Tensor) -> str | None:
        """The cached digest of ``tensor`` if it is the same object, unchanged since hashing."""
        return self.get_many([tensor])[0]

    def get_many(self, tensors: list[torch.Tensor]) -> list[str | None]:
        """:meth:`get` for each of ``tensors`` in order, taking the lock once.

        A save asks for every tensor; one call for all of them took 1.25 -> 0.75 ms for 915.
        """
        with self._lock:
            entries = [self._entries.get(id(tensor)) for tensor in tensors]
        digests: list[str | None] = [None] * len(tensors)
        others = []  # candidates without a reader: sampled through torch, gathered per device
        for index, (tensor, entry) in enumerate(zip(tensors, entries, strict=True)):
            if entry is None or not _same_layout(tensor, entry):
                continue
            reader = entry.taken.reader
            if reader is None:
                others.append(index)
                continue
            # The storage is held while the reader reads, so another thread assigning the tensor
            # new data cannot free the memory under it; its address shows it is the one read.
            storage = tensor.untyped_storage()
            if storage.data_ptr() == entry.taken.fingerprint[0] and reader.tobytes() == entry.taken.sample:
                digests[index] = entry.digest
            del storage
        for index, taken in zip(others, samples([tensors[i] for i in others]), strict=True):
            entry = entries[index]
            if entry is not None and entry.taken.sample == taken:
                digests[index] = entry.digest
        self.hits += len(digests) - digests.count(None)
        return digests

    def take(self, tensor: torch.Tensor) -> Taken | None:
        """What :meth:`put` needs, read now, before ``tensor``'s bytes are; None if it is not cached."""
        if tensor.requires_grad or tensor.layout != torch.strided or tensor.is_meta:
            return None
        if tensor.nelement() * tensor.element_size() < self.min_bytes:
            return None
        taken = fingerprint(tensor)
        if taken is None:
            return None
        reader = sample_reader(tensor)
        return Taken(taken, reader.tobytes() if reader is not None else sample(tensor), reader)

    def know(self, tensor: torch.Tensor, digest: str) -> None:
        """Remember ``digest`` for ``tensor``, whose bytes were just verified to hash to it (a
        load): the same rules as after hashing it, read now."""
        self.put(tensor, digest, self.take(tensor))

    def forget_many(self, tensors: list[torch.Tensor]) -> None:
        """Drop the entries of ``tensors`` (and with them the weak references that block swap_tensors)."""
        entries = self._entries
        with self._lock:
            if not entries:
                return
            for tensor in tensors:
                entry = entries.get(id(tensor))
                if entry is not None and entry.ref() is tensor:
                    del entries[id(tensor)]

    def put(self, tensor: torch.Tensor, digest: str, taken: Taken | None) -> None:
        """Remember ``digest`` for ``tensor`` as :meth:`take` found it before its bytes were read."""
        if taken is None:
            return
        key = id(tensor)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.ref() is tensor:  # hashed before: keep its weak reference
                entry.taken, entry.digest = taken, digest
                return

        def forget(_ref: weakref.ref[torch.Tensor], key: int = key) -> None:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry.ref is _ref:
                    del self._entries[key]

        with self._lock:
            self._entries[key] = _Entry(weakref.ref(tensor, forget), taken, digest)


_Mark = tuple[int, int]


def _mark(tensor: torch.Tensor) -> _Mark | None:
    try:
        return tensor.untyped_storage().data_ptr(), tensor._version
    except RuntimeError:  # inference tensors have no version counter
        return None


def marks_of(tensors: Iterable[torch.Tensor]) -> dict[int, _Mark]:
    """What :class:`SaveLedger` keeps of each of ``tensors``, read now: by ``id``, its storage
    pointer and version counter (none for an inference tensor)."""
    marks = {}
    for tensor in tensors:
        mark = _mark(tensor)
        if mark is not None:
            marks[id(tensor)] = mark
    return marks


class SaveLedger:
    """What this client's last save left: which of its tensors changed in place since it began,
    and which digests its version references.

    It keeps each tensor's ``id``, storage pointer and version counter, read before its bytes
    were, and holds no reference: a tensor that is gone, or another one at the same address,
    is at worst taken for changed, which costs writing its bytes (a changed tensor's digest
    always comes from its bytes). Only the last save's tensors are kept.
    """

    def __init__(self) -> None:
        self._marks: dict[int, _Mark] = {}
        #: Digests the last committed version references: stored while it exists, so a save
        #: need not ask about them (if a deletion and a sweep took them, the commit says so
        #: and the save sends them then).
        self.committed: frozenset[str] = frozenset()
        #: The byte sizes of those digests' tensors: the store holds a tensor of each size while
        #: that version exists, so a save need not ask (:func:`client.saving.saver.surely_unstored`;
        #: one a sweep took is then hashed and asked about, as any tensor that may be stored).
        self.sizes: frozenset[int] = frozenset()

    def keep(self, marks: dict[int, _Mark], committed: frozenset[str], sizes: frozenset[int] = frozenset()) -> None:
        """Make ``marks`` (from :func:`marks_of`), the ``committed`` digests and their tensors'
        ``sizes`` the last save's."""
        self._marks, self.committed, self.sizes = marks, committed, sizes

    def follow(self, marks: dict[int, _Mark]) -> None:
        """Make ``marks`` the last save's, leaving the digests and sizes as they are (a save
        process committed the version, and keeps those in its own ledger)."""
        self._marks = marks

    def loaded(self, digests: frozenset[str], tensors: list[torch.Tensor]) -> None:
        """Take the digests of a version this client just loaded as stored, as a committed
        version's are, and the ``tensors`` it was loaded into as a save's: a resumed job's first
        save asks only about what changed, and writes what changed in place since (trainable
        weights, optimizer state) without hashing it first."""
        self.committed = self.committed | digests
        self._marks = marks_of(tensors)

    def forget_committed(self) -> None:
        """Forget the last version's digests and sizes (this client deleted a version: they may go)."""
        self.committed = frozenset()
        self.sizes = frozenset()

    def changed(self, tensors: list[torch.Tensor], now: dict[int, _Mark]) -> list[bool]:
        """For each of ``tensors``, whether the last save held it and its version counter has moved
        since (same storage): changed in place, as trainable weights and optimizer state are by
        every step, so its bytes are almost surely not stored yet. ``now``: fresh marks (:func:`marks_of`)."""
        before = self._marks
        flags = []
        for tensor in tensors:
            old, new = before.get(id(tensor)), now.get(id(tensor))
            flags.append(old is not None and new is not None and old[0] == new[0] and old[1] != new[1])
        return flags


def cached_digests(
    cache: DigestCache | None, tensors: list[torch.Tensor], cacheable: list[bool] | None = None
) -> list[str | None]:
    """Each tensor's digest from ``cache``, or None where it must be hashed (every one without a
    cache, and those not ``cacheable``: by default all are)."""
    if cache is None:
        return [None] * len(tensors)
    if cacheable is None:
        return cache.get_many(tensors)
    asked = [t for t, ok in zip(tensors, cacheable, strict=True) if ok]
    answers = iter(cache.get_many(asked))
    return [next(answers) if ok else None for ok in cacheable]


def _same_layout(tensor: torch.Tensor, entry: _Entry | None) -> bool:
    """Whether ``entry`` holds ``tensor`` as it is now, but for its bytes: the same object, storage,
    layout and version counter (the sample, compared next, stands for the bytes)."""
    if entry is None or tensor.requires_grad or entry.ref() is not tensor:
        return False
    try:
        # The version counter first: a tensor changed in place (optimizer state, every
        # step) is told apart without building its whole fingerprint.
        if tensor._version != entry.taken.fingerprint[-1]:
            return False
    except RuntimeError:  # inference tensors have no version counter
        return False
    return entry.taken.fingerprint == fingerprint(tensor)


def digest_of(tensor: torch.Tensor, key: str) -> str:
    """The digest of one tensor's dtype, shape and bytes."""
    host = host_contiguous(tensor, key)
    return tensor_digest(dtype_name(host, key), list(host.shape), byte_view(host))


def _is_large(tensor: torch.Tensor) -> bool:
    # Other layouts are refused by digest_of; the size of their values does not matter.
    return tensor.layout == torch.strided and tensor.nelement() * tensor.element_size() >= INLINE_BYTES


def digest_all(
    tensors: list[tuple[str, torch.Tensor]],
    cache: DigestCache | None,
    threads: int = 2,
    known: list[str | None] | None = None,
    cacheable: list[bool] | None = None,
) -> list[str]:
    """Digests of ``(key, tensor)`` pairs in order, reusing the cache where it is safe.

    ``known`` holds digests the caller already took from the cache (None: hash that one);
    without it the cache is asked here. Only tensors flagged ``cacheable`` (by default all) go
    to the cache. Tensors of at least ``INLINE_BYTES`` are hashed on ``threads`` threads;
    smaller ones in the calling thread meanwhile, since handing them to a thread costs more
    than hashing them.
    """
    results: list[str | None]
    if known is not None:
        results = list(known)
    else:
        results = cached_digests(cache, [t for _, t in tensors], cacheable)
    # The same tensor object under several keys (tied weights) is hashed once.
    first_index: dict[int, int] = {}
    large: list[int] = []
    small: list[int] = []
    for index, result in enumerate(results):
        tensor = tensors[index][1]
        if result is None and first_index.setdefault(id(tensor), index) == index:
            (large if _is_large(tensor) else small).append(index)

    def work(index: int) -> None:
        key, tensor = tensors[index]
        taken = cache.take(tensor) if cache is not None and (cacheable is None or cacheable[index]) else None
        digest = digest_of(tensor, key)
        results[index] = digest
        if cache is not None:
            cache.put(tensor, digest, taken)

    if len(large) > 1 and threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            futures = [pool.submit(work, index) for index in large]
            try:
                for index in small:
                    work(index)
                for future in futures:
                    future.result()
            finally:
                for future in futures:  # after a failure, hash no more
                    future.cancel()
    else:
        for index in sorted(large + small):
            work(index)
    for index, result in enumerate(results):
        if result is None:
            results[index] = results[first_index[id(tensors[index][1])]]
    return [r for r in results if r is not None]
