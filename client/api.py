"""The Client: save and load checkpoints through one transport."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, overload

import torch

from client import keys, restore, selection
from client.background import SaveHandle, Staging
from client.hashing import DigestCache, SaveLedger
from client.http_transport import HttpTransport
from client.progress import byte_bar
from client.reader import TensorReader
from client.results import LoadResult, SaveResult
from client.saving import SaveRun, SaveSettings, Snapshot, check_step_and_metrics
from client.state import FlatState, TensorRecord, flatten, flatten_extra, flatten_named_optimizer, flatten_other
from client.transport import Transport
from service.errors import (
    InvalidInputError,
    NotFoundError,
    PermissionDeniedError,
    StateEncodingError,
    StateMismatchError,
)
from service.format.names import validate_run_id, validate_tag
from service.format.sharding import DEFAULT_SHARD_BYTES
from service.records import GcReport, RetentionPolicy, RunInfo, VersionInfo
from service.retention_rules import Policy, check_policy

DEFAULT_HOME = "~/.ckptstore"
UPLOADS_IN_FLIGHT = 2
HTTP_UPLOADS_IN_FLIGHT = 4
HTTP_READS_IN_PARALLEL = 2


def default_home() -> Path:
    """``$CKPTSTORE_HOME`` or ``~/.ckptstore``, read now."""
    return Path(os.environ.get("CKPTSTORE_HOME") or DEFAULT_HOME).expanduser()


def open_transport(
    url: str | None,
    home: Path | str | None,
    token: str | None,
    *,
    create: bool = True,
    retry_seconds: float | None = None,
) -> Transport:
    """A server at ``url``; else the embedded store in ``home``; else the store the environment
    names, as ``ckptstore serve`` reads it (``CKPTSTORE_DATABASE_URL``, ``CKPTSTORE_BLOBS``,
    ``CKPTSTORE_HOME``; see :func:`service.factory.local_settings`).

    With ``create=False`` a store that does not exist yet is refused (NotFoundError naming
    the variables to set) rather than created.
    """
    if url:
        if not url.startswith(("http://", "https://")):
            raise InvalidInputError(f"CKPTSTORE_URL must start with http:// or https://, not {url[:80]!r}")
        return HttpTransport(url, token, retry_seconds=retry_seconds)
    # Here, not at the top: a client over HTTP never pays for the engine (SQLAlchemy, Alembic).
    from service.factory import local_settings, open_store

    return open_store(local_settings(home), require_current_schema=True, create=create)


def _sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters in an initialized process group (FSDP2 and
    other DTensor parallelism), checked without importing torch.distributed's checkpointing
    when no process group is up."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from client.distributed.training import is_sharded

    return is_sharded(model)


def _rank() -> int:
    return torch.distributed.get_rank()


class Client:
    """A connection to one checkpoint store.

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
    ) -> None:
        self.transport = open_transport(url, home, token, create=create, retry_seconds=retry_seconds)
        self.shard_bytes = shard_bytes
        self.digest_cache = DigestCache() if hash_cache else None
        self.ledger = SaveLedger()
        self._staging = Staging()
        self._worker: ThreadPoolExecutor | None = None
        self._pending: SaveHandle | None = None

    def close(self) -> None:
        """Wait for a background save, then release the store's resources."""
        self._wait_for_background(report=False)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self.transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        blocking: bool,
    ) -> SaveResult | SaveHandle: ...

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
        blocking: bool = True,
    ) -> SaveResult | SaveHandle:
        """Store the model (and optimizer, scheduler, extras) as the next version of ``run_id``.

        Only tensors the store lacks are written; the version becomes visible once all of
        its bytes are stored.

        With ``blocking=False`` the call returns a :class:`SaveHandle` once the state is
        snapshotted (:mod:`client.background`): tensors the digest cache does not know are
        copied into staging buffers this client reuses; hashing, writing and the commit run in
        the background, and the caller may step the optimizer at once. ``handle.result()``
        gives the SaveResult or raises the save's error; an error nobody collected is raised by
        this client's next save. Versions stay in order: every save first waits for the one
        before it, and so do this client's other calls and the process's exit.

        Given any of ``keep_last``, ``keep_best``, ``metric`` or ``mode``, the run's retention
        policy becomes exactly that before this version is committed, and the commit applies it
        (see :meth:`set_retention`): e.g. ``keep_last=3, keep_best=1, metric="val_loss"``.
        """
        self._wait_for_background(report=True)
        started = time.perf_counter()
        validate_run_id(run_id)
        tags = [validate_tag(t) for t in tags]
        if _sharded(model):  # FSDP2 / DTensor: every rank saves its shards (client.distributed)
            if not blocking:
                raise InvalidInputError(
                    "blocking=False is not supported for a sharded model; use "
                    "torch.distributed.checkpoint.async_save with client.distributed.StoreWriter"
                )
            from client.distributed import training

            if (keep_last, keep_best, metric, mode) != (None, None, None, None) and _rank() == 0:
                self._use_retention(run_id, keep_last, keep_best, metric, mode)
            return training.save_sharded(
                self, run_id, model, optim, scheduler=scheduler, extra=extra, step=step, metrics=metrics, tags=tags
            )
        flat = flatten(model, optim, scheduler, extra)
        if (keep_last, keep_best, metric, mode) != (None, None, None, None):
            self._use_retention(run_id, keep_last, keep_best, metric, mode)
        if blocking:
            return self._save_flat(run_id, flat, step=step, metrics=metrics, tags=tags, started=started)
        return self._save_in_background(run_id, flat, step=step, metrics=metrics, tags=tags, started=started)

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
        group's ``params`` a list of names); its parameters are stored as trainable, and
        :meth:`load` with ``optim=`` restores it. ``scheduler_state`` is a scheduler's state_dict.
        """
        self._wait_for_background(report=True)
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
            flat.add(TensorRecord(key, tensor, "target", trainable=trainable or name in optimized))
        if optim_state is not None:
            flatten_named_optimizer(flat, optim_state["state"], optim_state["param_groups"])
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
        """The one save path (:mod:`client.saving`)."""
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
        """Snapshot ``flat`` now; check its manifest and save it on this client's background thread.

        Step and metrics are checked now; the rest of the manifest is built and checked in the
        background (its cost grows with the tensor count): a bad key fails the handle, as any
        other error of the save does.
        """
        check_step_and_metrics(step, metrics)
        snapshot = self._staging.snapshot(flat, self.digest_cache)
        metrics = dict(metrics) if metrics is not None else None  # the caller may change it

        def save() -> SaveResult:
            run = self._save_run(
                run_id, flat, step=step, metrics=metrics, tags=tags, started=started, snapshot=snapshot
            )
            return run.run()

        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-save")
        self._pending = SaveHandle(self._worker.submit(save), snapshot.staged_bytes)
        return self._pending

    def _wait_for_background(self, *, report: bool) -> None:
        """Wait for this client's background save, if one is running. With ``report``, raise its
        error if the save failed and no ``result()`` call has raised it yet."""
        handle = self._pending
        if handle is None:
            return
        handle.wait()
        error = handle.error()
        if error is None or handle.observed:
            self._pending = None
        elif report:
            self._pending, handle.observed = None, True
            raise error

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
        """(reads in parallel, shards sent at once): a server spreads requests over its workers,
        a local disk gains nothing from more than one reader."""
        if isinstance(self.transport, HttpTransport):
            return HTTP_READS_IN_PARALLEL, HTTP_UPLOADS_IN_FLIGHT
        return 1, UPLOADS_IN_FLIGHT

    # -- load ----------------------------------------------------------------------------

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

        Every byte is verified. Keys and shapes are all checked before anything is written,
        but the bytes are checked as they arrive: after an IntegrityError the model may hold
        some bytes of the corrupt tensor (and of those after it), so load again from a
        sound version before using it.
        """
        self._wait_for_background(report=False)
        started = time.perf_counter()
        if optim is not None and model is None:
            raise InvalidInputError("loading optimizer state needs the model too: state is keyed by parameter name")
        if dtype is not None and not dtype.is_floating_point:
            raise InvalidInputError(f"dtype must be a floating dtype, not {dtype}")
        patterns = selection.check_patterns(keys)
        if model is not None and _sharded(model):  # every rank loads its shards (client.distributed)
            from client.distributed import training

            if patterns is not None:
                raise InvalidInputError("keys= is not supported for a sharded model; load every tensor")
            training.check_load_arguments(device, dtype, model)
            return training.load_sharded(
                self, validate_run_id(run_id), version, model, optim, scheduler=scheduler, strict=strict
            )
        target = torch.device(device) if device is not None else None
        manifest = self.transport.manifest(validate_run_id(run_id), version)
        with byte_bar(sum(e.nbytes for e in manifest.tensors), "load") as bar:
            reader = TensorReader(self.transport, manifest, on_bytes=bar.update, read_threads=self._widths()[0])
            result = LoadResult(run_id=run_id, version=manifest.version, step=manifest.step, metrics=manifest.metrics)
            if model is None:
                selected = selection.selected_model_keys(manifest, patterns)
                result.state_dict, result.casts = restore.materialize_model(
                    reader, selected, target or torch.device("cpu"), dtype
                )
            else:
                plan = selection.plan_model_load(manifest, model, patterns)
                result.missing_keys, result.unexpected_keys = plan.missing, plan.unexpected
                if strict and (plan.missing or plan.unexpected):
                    raise restore.mismatch_error(manifest.version, plan.missing, plan.unexpected)
                cache = self.digest_cache
                if cache is None:
                    result.casts = restore.load_into_model(reader, plan, target, dtype)
                else:  # the next save hashes only what changed since this load
                    result.casts = restore.load_into_model(reader, plan, target, dtype, cache.forget, cache.know)
            host_or_target = target or torch.device("cpu")
            if optim is not None:
                assert model is not None
                restore.restore_optimizer(reader, optim, model, host_or_target, patterns)
            if scheduler is not None:
                if "scheduler" not in manifest.state:
                    raise StateMismatchError(f"version {manifest.version} holds no scheduler state")
                scheduler.load_state_dict(restore.restore_section(reader, "scheduler", host_or_target))
            result.extra = restore.restore_section(reader, "extra", host_or_target)
        self.ledger.loaded(frozenset(manifest.digests()), restore.live_tensors(model, optim))
        result.bytes_read = reader.bytes_read
        result.seconds = time.perf_counter() - started
        return result

    # -- browsing ------------------------------------------------------------------------

    def runs(self) -> list[RunInfo]:
        """Every run in the store, most recently updated first."""
        self._wait_for_background(report=False)
        return self.transport.runs()

    def versions(self, run_id: str) -> list[VersionInfo]:
        """Every version of ``run_id``, oldest first."""
        self._wait_for_background(report=False)
        return self.transport.versions(run_id)

    def tag(self, run_id: str, version: int | str, name: str) -> int:
        """Point tag ``name`` at a version; returns the version number."""
        self._wait_for_background(report=False)
        return self.transport.tag(run_id, version, name)

    def untag(self, run_id: str, name: str) -> None:
        """Remove a tag."""
        self._wait_for_background(report=False)
        self.transport.untag(run_id, name)

    def delete(self, run_id: str, version: int | str) -> int:
        """Delete one version; returns its number. Stored bytes are reclaimed by garbage collection."""
        self._wait_for_background(report=False)
        self.ledger.forget_committed()
        return self.transport.delete_version(run_id, version)

    def gc(self, *, grace_seconds: int | None = None, dry_run: bool = False, orphans: bool = False) -> GcReport:
        """Delete the stored bytes no version references any more; returns what went (or would go).

        Shards recorded, or reported present to a save, less than ``grace_seconds`` ago (default
        one hour) are kept, so saves in progress are never affected. ``dry_run`` only reports.
        ``orphans`` also deletes blobs no shard record names (left by an interrupted collection);
        run that while no save is uploading. A server asks for an admin token.
        """
        self._wait_for_background(report=False)
        return self.transport.gc(grace_seconds=grace_seconds, dry_run=dry_run, orphans=orphans)

    # -- retention -----------------------------------------------------------------------

    def retention(self, run_id: str) -> RetentionPolicy:
        """The run's retention policy and, in ``would_remove``, the versions it would remove now."""
        self._wait_for_background(report=False)
        return self.transport.get_retention(run_id)

    def set_retention(
        self,
        run_id: str,
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] = "min",
        *,
        create_run: bool = False,
    ) -> RetentionPolicy:
        """Replace the run's retention policy; each commit from the next one on applies it.

        Kept are the last ``keep_last`` versions, the ``keep_best`` best by ``metric`` ('min':
        lowest is best; 'max': highest; ties go to the newer version), every tagged version and
        the newest one; the others are removed at the next commit (or at once with
        :meth:`apply_retention`). Neither ``keep_last`` nor ``keep_best`` clears the policy. A
        run that does not exist yet is NotFoundError, or created with ``create_run`` (so a policy
        can precede the first save; :meth:`save` with a policy does this). A server asks for an
        admin token: a policy deletes versions.
        """
        self._wait_for_background(report=False)
        try:
            return self.transport.set_retention(
                run_id,
                keep_last=keep_last,
                keep_best=keep_best,
                metric=metric,
                mode=mode if keep_best is not None else None,
                create_run=create_run,
            )
        except PermissionDeniedError as exc:
            raise PermissionDeniedError(
                f"{exc.message}: a retention policy deletes versions, so setting one needs an admin token "
                f"(an admin can run `ckptstore retention {run_id} ...`; saves with a write token then keep to it)"
            ) from exc

    def apply_retention(self, run_id: str) -> list[int]:
        """Remove now the versions the run's policy does not keep; returns their numbers."""
        self._wait_for_background(report=False)
        self.ledger.forget_committed()
        return self.transport.apply_retention(run_id)

    def _use_retention(
        self, run_id: str, keep_last: int | None, keep_best: int | None, metric: str | None, mode: str | None
    ) -> None:
        """Make the run's policy the one given, writing it only when it differs.

        Reading first lets a training job with a write token save with the policy an admin set.
        """
        wanted = check_policy(keep_last, keep_best, metric, mode)
        try:
            current = self.transport.get_retention(run_id)
        except NotFoundError:  # a new run
            current = None
        if current is None or Policy(current.keep_last, current.keep_best, current.metric, current.mode) != wanted:
            chosen: Literal["min", "max"] = "max" if wanted.mode == "max" else "min"
            # A new run: this save creates it anyway, so the policy may create it first.
            self.set_retention(
                run_id, wanted.keep_last, wanted.keep_best, wanted.metric, chosen, create_run=current is None
            )
