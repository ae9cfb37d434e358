"""The Client: save and load checkpoints through one transport."""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from ckptstore.client import keys
from ckptstore.client.connection import Connection
from ckptstore.client.cyclic_gc import paused_collection
from ckptstore.client.integrations.model_configs import with_model_configs
from ckptstore.client.loading import restore, selection
from ckptstore.client.loading.readahead import local_reads
from ckptstore.client.loading.reader import TensorReader
from ckptstore.client.progress import byte_bar
from ckptstore.client.results import LoadResult, SaveResult
from ckptstore.client.resume import section as resume
from ckptstore.client.saving import save_process
from ckptstore.client.saving.background import BackgroundSaves
from ckptstore.client.saving.cadence import Background, background_mode
from ckptstore.client.saving.hashing import DigestCache, SaveLedger
from ckptstore.client.saving.save_process import SaveProcess
from ckptstore.client.saving.saver import SaveRun, SaveSettings, Snapshot, check_step_and_metrics
from ckptstore.client.saving.shared_staging import SharedSnapshot
from ckptstore.client.saving.snapshot import SaveHandle
from ckptstore.client.state import (
    FlatState,
    FlattenCache,
    TensorRecord,
    flatten,
    flatten_extra,
    flatten_optimizer_state,
    flatten_other,
)
from ckptstore.service.errors import InvalidInputError, StateEncodingError, StateMismatchError
from ckptstore.service.format.names import validate_run_id, validate_tag
from ckptstore.service.format.sharding import DEFAULT_SHARD_BYTES

if TYPE_CHECKING:
    from ckptstore.service.format.manifest import Manifest

UPLOADS_IN_FLIGHT = 2


def _sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters in an initialized process group (FSDP2 and
    other DTensor parallelism), checked without importing torch.distributed's checkpointing
    when no process group is up."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not (distributed and isinstance(model, torch.nn.Module)):  # not a module: flatten says why
        return False
    from ckptstore.client.distributed.training import is_sharded

    return is_sharded(model)


class Client(Connection):
    """A connection to one checkpoint store that saves and loads checkpoints (browsing and
    management come from :class:`client.connection.Connection`).

    Args:
        url: a ckptstore server; None to open the store in this process: the one
            ``CKPTSTORE_DATABASE_URL`` and ``CKPTSTORE_BLOBS`` name when set (as ``ckptstore
            serve`` reads them), else the embedded store in ``home``.
        home: the embedded store's folder (default ``$CKPTSTORE_HOME`` or ``~/.ckptstore``);
            given, the store is the embedded one there whatever the environment says.
        token: bearer token for a server.
        retry_seconds: how long a server's requests that are safe to repeat are retried
            through connection errors and 429/5xx answers (default ``$CKPTSTORE_RETRY_SECONDS``
            or 60 s, enough to ride out a server restart).
        create: False to refuse (NotFoundError naming the variables to set) a store that does
            not exist yet instead of creating it, as ``ckptstore ls``, ``verify`` and ``gc`` do.
        shard_bytes: target size of each shard written.
        hash_cache: reuse digests of frozen tensors that did not change since this client
            last hashed them.
        background: where ``save(..., blocking=False)`` hashes, writes and commits: ``"thread"``
            (one of this process), ``"process"`` (a helper this client starts, which opens the
            same store, so the loop's interpreter is not shared: :mod:`client.saving.save_process`),
            or ``"auto"`` (the default, unless ``$CKPTSTORE_BACKGROUND`` says otherwise): the
            thread until saves come often, then a process (:mod:`client.saving.cadence`).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        home: Path | str | None = None,
        token: str | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        hash_cache: bool = True,
        retry_seconds: float | None = None,
        create: bool = True,
        background: Background | None = None,
    ) -> None:
        mode = background_mode(background)
        super().__init__(url, home=home, token=token, retry_seconds=retry_seconds, create=create)
        prepare_writes = getattr(self.transport, "prepare_writes", None)
        if prepare_writes is not None:  # an embedded store picks its write mode before the first save
            prepare_writes()
        self.shard_bytes = shard_bytes
        self.digest_cache = DigestCache() if hash_cache else None
        self.ledger = SaveLedger()
        self._flattened = FlattenCache()  # with the names of the models it saves
        make = functools.partial(  # the helper opens this store too
            SaveProcess, str(home) if home is not None else None, shard_bytes, self._widths()[1], url=url, token=token,
            retry_seconds=retry_seconds,
        )  # fmt: skip
        self._background = BackgroundSaves.of_mode(mode, make)

    def close(self) -> None:
        """Wait for a background save, then release the store's resources and the staging buffers."""
        self._background.close()
        self.transport.close()

    def __enter__(self) -> Client:
        return self

    def _settle(self) -> None:
        self._background.wait(report=False)

    def _history_changed(self) -> None:
        self.ledger.forget_committed()

    # -- save ----------------------------------------------------------------------------

    @overload
    def save(
        self,
        run_id: str,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer | None = None,
        *,
        scheduler: Any = None,
        extra: dict[str, Any] | None = None,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        tags: list[str] | tuple[str, ...] = (),
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] | None = None,
        rng: bool = True,
        dataloader: Any = None,
        stateful: Mapping[str, Any] | None = None,
        blocking: Literal[True] = True,
    ) -> SaveResult: ...

    @overload
    def save(
        self,
        run_id: str,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer | None = None,
        *,
        scheduler: Any = None,
        extra: dict[str, Any] | None = None,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        tags: list[str] | tuple[str, ...] = (),
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] | None = None,
        rng: bool = True,
        dataloader: Any = None,
        stateful: Mapping[str, Any] | None = None,
        blocking: Literal[False],
    ) -> SaveHandle: ...

    @overload
    def save(
        self,
        run_id: str,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer | None = None,
        *,
        scheduler: Any = None,
        extra: dict[str, Any] | None = None,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        tags: list[str] | tuple[str, ...] = (),
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] | None = None,
        rng: bool = True,
        dataloader: Any = None,
        stateful: Mapping[str, Any] | None = None,
        blocking: bool,
    ) -> SaveResult | SaveHandle: ...

    @paused_collection()
    def save(
        self,
        run_id: str,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer | None = None,
        *,
        scheduler: Any = None,
        extra: dict[str, Any] | None = None,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        tags: list[str] | tuple[str, ...] = (),
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] | None = None,
        rng: bool = True,
        dataloader: Any = None,
        stateful: Mapping[str, Any] | None = None,
        blocking: bool = True,
    ) -> SaveResult | SaveHandle:
        """Store the model (and optimizer, scheduler, extras) as the next version of ``run_id``.

        Only tensors the store lacks are written; the version becomes visible once all of
        its bytes are stored.

        With ``blocking=False`` the call returns a :class:`SaveHandle` once the state is
        snapshotted (:mod:`client.saving.snapshot`): tensors the digest cache does not know are
        copied into staging buffers this client reuses; hashing, writing and the commit run in
        the background, and the caller may step the optimizer at once. ``handle.result()``
        gives the SaveResult or raises the save's error; an error nobody collected is raised by
        a later save of this client. Versions stay in order: saves run one after another, and
        this client's other calls and the process's exit wait for them; a small background
        snapshot may be taken while the save before it runs (:mod:`client.saving.background`).

        Given any of ``keep_last``, ``keep_best``, ``metric`` or ``mode``, the run's retention
        policy becomes exactly that before this version is committed, and the commit applies it
        (see :meth:`set_retention`): e.g. ``keep_last=3, keep_best=1, metric="val_loss"``.

        A transformers or PEFT model's configs are recorded in ``extra`` unless it sets those
        keys itself (:mod:`client.integrations.model_configs`: ``model_config``,
        ``generation_config``, ``peft_config``), so ``ckptstore export`` writes them back.

        Every version records what a resume needs besides the model (:mod:`client.resume`): the
        random number generators (Python's ``random``, NumPy's global state, torch's CPU and
        every CUDA device's; ``rng=False`` leaves them out), and the ``state_dict()`` of
        ``dataloader`` (a torchdata ``StatefulDataLoader``, so a resume goes on mid-epoch at the
        next batch) and of each object in ``stateful`` (by name; anything with ``state_dict`` and
        ``load_state_dict``). :meth:`load` puts them back.
        """
        self._background.wait(report=True, keep=0 if blocking else self._background.overlap)
        started = time.perf_counter()
        validate_run_id(run_id)
        tags = [validate_tag(t) for t in tags]
        extra = with_model_configs(model, extra)  # a transformers or PEFT model's configs, for export
        objects = resume.stateful_objects(dataloader, stateful)
        if _sharded(model):  # FSDP2 / DTensor: every rank saves its shards (client.distributed)
            if objects:
                raise InvalidInputError(
                    "dataloader= and stateful= are not supported for a sharded model; save their state_dict() in extra="
                )
            if not blocking:
                raise InvalidInputError(
                    "blocking=False is not supported for a sharded model; use "
                    "torch.distributed.checkpoint.async_save with client.distributed.StoreWriter"
                )
            from ckptstore.client.distributed import training

            if (keep_last, keep_best, metric, mode) != (None, None, None, None) and torch.distributed.get_rank() == 0:
                self._use_retention(run_id, keep_last, keep_best, metric, mode)
            return training.save_sharded(
                self, run_id, model, optim, scheduler=scheduler, extra=extra, step=step, metrics=metrics, tags=tags
            )
        flat = flatten(model, optim, scheduler, extra, reuse=self._flattened)
        resume.record(flat, rng=rng, objects=objects)
        if (keep_last, keep_best, metric, mode) != (None, None, None, None):
            self._use_retention(run_id, keep_last, keep_best, metric, mode)
        if blocking and any(record.tensor.is_cuda for record in flat.records):
            # Accelerator tensors reach the host in one batched copy into reused pinned buffers,
            # not one synchronising copy per tensor for hashing and another for writing.
            snapshot = self._background.staging.snapshot(flat, self.digest_cache, host_too=False)
            return self._save_run(
                run_id, flat, step=step, metrics=metrics, tags=tags, started=started, snapshot=snapshot
            ).run()
        if blocking:
            return self._save_flat(run_id, flat, step=step, metrics=metrics, tags=tags, started=started)
        return self._save_in_background(run_id, flat, step=step, metrics=metrics, tags=tags, started=started)

    @paused_collection()
    def save_state_dict(
        self,
        run_id: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        trainable: bool = False,
        extra: dict[str, Any] | None = None,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        tags: list[str] | tuple[str, ...] = (),
        optim_state: dict[str, Any] | None = None,
        scheduler_state: Any = None,
    ) -> SaveResult:
        """Store a plain ``{name: tensor}`` dict as the next version of ``run_id``.

        Each tensor becomes ``model/<name>`` with placement ``target`` and the given
        ``trainable`` flag, so a base model imported this way (``ckptstore import``) is stored
        once and every later :meth:`save` of a model holding the same weights dedups against it.
        Tensors may be memory-mapped: they are hashed and written shard by shard, never copied
        all at once. ``extra`` is stored as in :meth:`save` (JSON with its tensors by key;
        what is neither is refused naming its path) and comes back as ``LoadResult.extra``.

        ``optim_state`` is an optimizer state_dict keyed by parameter name (the layout
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives: ``state`` by name, each
        group's ``params`` a list of names; its parameters are stored as trainable), or one that
        numbers its parameters 0, 1, ... in its groups' order (``Optimizer.state_dict()``), kept
        by position; :meth:`load` with ``optim=`` restores either. ``scheduler_state`` is a
        scheduler's state_dict.
        """
        self._background.wait(report=True)
        started = time.perf_counter()
        validate_run_id(run_id)
        tags = [validate_tag(t) for t in tags]
        flat = FlatState()
        optimized = {n for g in optim_state["param_groups"] for n in g["params"]} if optim_state is not None else set()
        for name, tensor in tensors.items():
            key = keys.model_key(name) if isinstance(name, str) else ""
            if not key or not name or not name.isprintable() or len(key) > len("model/") + 1000:
                raise InvalidInputError(
                    f"tensor name {str(name)[:80]!r} cannot be stored: use 1-1000 printable characters"
                )
            if not isinstance(tensor, torch.Tensor):
                raise StateEncodingError(f"{key}: a {type(tensor).__name__}, not a tensor")
            grad = tensor.requires_grad if isinstance(tensor, torch.nn.Parameter) else None  # a file's own Parameter
            flat.add(TensorRecord(key, tensor, "target", trainable=trainable or name in optimized, requires_grad=grad))
        if optim_state is not None:
            flatten_optimizer_state(flat, optim_state)
        if scheduler_state is not None:
            flatten_other(flat, "scheduler", scheduler_state)
        if extra is not None:
            flatten_extra(flat, extra)
        return self._save_flat(run_id, flat, step=step, metrics=metrics, tags=tags, started=started)

    def _save_flat(
        self,
        run_id: str,
        flat: FlatState,
        *,
        step: int | None,
        metrics: dict[str, float] | None,
        tags: list[str],
        started: float,
    ) -> SaveResult:
        """The one save path (:mod:`client.saving.saver`)."""
        return self._save_run(run_id, flat, step=step, metrics=metrics, tags=tags, started=started).run()

    def _save_run(
        self,
        run_id: str,
        flat: FlatState,
        *,
        step: int | None,
        metrics: dict[str, float] | None,
        tags: list[str],
        started: float,
        snapshot: Snapshot | None = None,
    ) -> SaveRun:
        """A save of ``flat``, or of a background ``snapshot`` of it, with its manifest checked."""
        return SaveRun(
            self.save_settings(self.ledger),
            run_id,
            flat,
            step=step,
            metrics=metrics,
            tags=tags,
            started=started,
            snapshot=snapshot,
        )

    def _save_in_background(
        self,
        run_id: str,
        flat: FlatState,
        *,
        step: int | None,
        metrics: dict[str, float] | None,
        tags: list[str],
        started: float,
    ) -> SaveHandle:
        """Snapshot ``flat`` now; save it in the background (:mod:`client.saving.background`).

        Step and metrics are checked now; the rest of the manifest is built and checked in the
        background (its cost grows with the tensor count): a bad key fails the handle, as any
        other error of the save does.
        """
        check_step_and_metrics(step, metrics)
        metrics = dict(metrics) if metrics is not None else None  # the caller may change it

        def here(snapshot: Snapshot) -> SaveResult:
            run = self._save_run(
                run_id, flat, step=step, metrics=metrics, tags=tags, started=started, snapshot=snapshot
            )
            return run.run()

        def elsewhere(helper: SaveProcess, shared: SharedSnapshot) -> SaveResult | None:
            ledger = self.ledger  # the client's: it follows the live tensors the snapshot copied

            def request() -> dict[str, Any]:
                return save_process.message(shared, flat, run_id, step=step, metrics=metrics, tags=tags, ledger=ledger)

            return save_process.save_elsewhere(
                helper, shared, request, started=started, cache=self.digest_cache, ledger=ledger
            )

        return self._background.start(flat, self.digest_cache, here, elsewhere)

    def save_settings(self, ledger: SaveLedger) -> SaveSettings:
        """What a save through this client writes to and with: transport, shard size, uploads
        in flight, the digest cache, and ``ledger`` (the client's own, or a fresh one for
        saves whose commit another process makes)."""
        return SaveSettings(self.transport, self.shard_bytes, self._widths()[1], self.digest_cache, ledger)

    @property
    def read_threads(self) -> int:
        """Reads a load runs at once through this client's transport."""
        return self._widths()[0]

    def _widths(self) -> tuple[int, int]:
        """(reads in parallel, shards sent at once): a server spreads requests over its workers;
        a local store reads on one thread per four cores, up to four (see :func:`local_reads`)."""
        if (http := sys.modules.get("ckptstore.client.http.transport")) and isinstance(
            self.transport, http.HttpTransport
        ):
            return http.HTTP_READS_IN_PARALLEL, http.HTTP_UPLOADS_IN_FLIGHT  # an embedded client never imports httpx
        return local_reads(os.cpu_count() or 1), UPLOADS_IN_FLIGHT

    # -- load ----------------------------------------------------------------------------

    def _load_model(
        self,
        reader: TensorReader,
        manifest: Manifest,
        result: LoadResult,
        *,
        model: torch.nn.Module | None,
        target: torch.device | None,
        dtype: torch.dtype | None,
        strict: bool,
        patterns: list[str] | None,
    ) -> None:
        """The model part of :meth:`load`: into ``model``, or as ``result.state_dict`` without one."""
        if model is None:
            selected = selection.selected_model_keys(manifest, patterns)
            result.state_dict, result.casts = restore.materialize_model(
                reader, selected, target or torch.device("cpu"), dtype
            )
            restore.restore_requires_grad(
                (result.state_dict[name], reader.entries[key]) for name, key in selected.items()
            )
            return
        plan = selection.plan_model_load(manifest, model, patterns)
        result.missing_keys, result.unexpected_keys = plan.missing, plan.unexpected
        if strict and (plan.missing or plan.unexpected):
            raise restore.mismatch_error(manifest.version, plan.missing, plan.unexpected)
        cache = self.digest_cache
        if cache is None:
            result.casts = restore.load_into_model(reader, plan, target, dtype)
        else:  # the next save hashes only what changed since this load
            result.casts = restore.load_into_model(reader, plan, target, dtype, cache.forget_many, cache.know)

    @paused_collection()
    def load(
        self,
        run_id: str,
        version: int | str = "latest",
        *,
        model: torch.nn.Module | None = None,
        optim: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        strict: bool = True,
        keys: Sequence[str] | None = None,
        rng: bool | None = None,
        dataloader: Any = None,
        stateful: Mapping[str, Any] | None = None,
    ) -> LoadResult:
        """Load a version into ``model``/``optim``/``scheduler`` (or return its state_dict).

        Model tensors are read into the model's own parameters and buffers (moved to
        ``device`` if given): a CPU tensor of the stored dtype is filled in place, without an
        extra copy. Optimizer state lands on each parameter's device with its saved dtype;
        ``dtype`` casts floating model tensors only. Strict by default: missing or
        unexpected model keys raise StateMismatchError before anything is written.

        Names are canonical (:mod:`client.names`): a version saved from a model wrapped by
        torch.compile, DDP, FSDP or activation checkpointing loads into the plain model and
        into any other wrapping of it, optimizer state included.

        ``keys`` (glob patterns over state_dict names, e.g. ``["*lora_*"]``) loads only the
        model tensors they select, reading only their bytes: strict within that subset, the
        model's other tensors untouched. With ``optim``, only the state of the selected
        parameters is read, and ``optim`` must optimize exactly those (grouped as when saved).

        The version's optimizer class, where recorded, must be ``optim``'s: a strict load into
        another class is refused before anything is written (``strict=False`` loads it anyway).
        Optimizer state an import kept by position (the file numbered the parameters) goes to
        ``optim``'s parameters in its groups' order, as ``optim.load_state_dict`` would.

        What the version recorded for a resume (:mod:`client.resume`) comes back on request:
        ``dataloader`` and each object of ``stateful`` get the state saved under their name
        (refused before anything is written if the version holds none), and the random number
        generators are restored when the load is a resume (``optim`` given) or ``rng=True``;
        ``rng=False`` never touches them, and a load of weights alone (no ``optim``) leaves the
        caller's generators as they are. ``LoadResult.rng_restored`` says whether they were.

        Every byte is verified. Keys and shapes are all checked before anything is written,
        but the bytes are checked as they arrive: after an IntegrityError the model may hold
        some bytes of the corrupt tensor (and of those after it), so load again from a
        sound version before using it.
        """
        self._background.wait(report=False)
        started = time.perf_counter()
        if optim is not None and model is None:
            raise InvalidInputError("loading optimizer state needs the model too: state is keyed by parameter name")
        if dtype is not None and not dtype.is_floating_point:
            raise InvalidInputError(f"dtype must be a floating dtype, not {dtype}")
        patterns = selection.check_patterns(keys)
        objects = resume.stateful_objects(dataloader, stateful)
        if model is not None and _sharded(model):  # every rank loads its shards (client.distributed)
            from ckptstore.client.distributed import training

            if objects or rng:
                raise InvalidInputError("rng=, dataloader= and stateful= are not supported for a sharded model")

            if patterns is not None:
                raise InvalidInputError("keys= is not supported for a sharded model; load every tensor")
            training.check_load_arguments(device, dtype, model)
            return training.load_sharded(
                self, validate_run_id(run_id), version, model, optim, scheduler=scheduler, strict=strict
            )
        target = torch.device(device) if device is not None else None
        manifest = self.transport.manifest(validate_run_id(run_id), version)
        if optim is not None:  # before anything is written
            restore.check_optimizer(manifest, optim, strict=strict, partial=patterns is not None)
        resuming = resume.plan(manifest, rng=rng, resuming=optim is not None, objects=objects)
        with byte_bar(lambda: sum(e.nbytes for e in manifest.tensors), "load") as bar:
            reader = TensorReader(self.transport, manifest, on_bytes=bar.update, read_threads=self.read_threads)
            result = LoadResult(run_id=run_id, version=manifest.version, step=manifest.step, metrics=manifest.metrics)
            self._load_model(
                reader, manifest, result, model=model, target=target, dtype=dtype, strict=strict, patterns=patterns
            )
            host_or_target = target or torch.device("cpu")
            if optim is not None:
                assert model is not None
                restore.restore_optimizer(reader, optim, model, host_or_target, patterns)
            if scheduler is not None:
                if "scheduler" not in manifest.state:
                    raise StateMismatchError(f"version {manifest.version} holds no scheduler state")
                scheduler.load_state_dict(restore.restore_section(reader, "scheduler", host_or_target))
            result.extra = restore.restore_section(reader, "extra", host_or_target)
            if resuming.anything:
                resume.apply(resuming, restore.restore_section(reader, resume.SECTION, torch.device("cpu")))
                result.rng_restored = resuming.rng
        self.ledger.loaded(frozenset(manifest.digests()), restore.live_tensors(model, optim))
        result.bytes_read = reader.bytes_read
        result.seconds = time.perf_counter() - started
        return result
