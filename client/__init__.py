"""ckptstore's Python client: save and load PyTorch checkpoints with correct placement.

    from ckptstore import client
    client.save("my-run", model, optim, step=100)
    client.load("my-run", model=model, optim=optim, device="cuda")

The module-level functions use a client built from ``CKPTSTORE_URL`` / ``CKPTSTORE_HOME``
as they are when the function is called; build a :class:`Client` to choose explicitly.

Rooms by job: the top-level modules (api, connection, results, store_protocol, state, jsonstate,
keys, names, placement, tensors, progress, cyclic_gc) are the floor: none but :mod:`client.api`
imports a package of ``client`` (the torch-free :mod:`client.connection` opens a server through
:mod:`client.http`). The Client drives :mod:`client.saving`, :mod:`client.loading`,
:mod:`client.http` and, for sharded models, :mod:`client.distributed`; above it sit
:mod:`client.formats`, :mod:`client.integrations` and :mod:`client.cli`.

This package may import ``service`` and, at import, only its torch-free
:mod:`client.connection`: the Client and the rest load when first used, so torch-free tools
(the server image, ``ckptstore serve``) import it. It hands :func:`default_client` to
:func:`client.connection.provide_default_client`, so the packages below the Client reach the
default one without importing this package back.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from ckptstore.client import connection
from ckptstore.service.errors import (
    CheckpointError,
    ConflictError,
    IntegrityError,
    InvalidInputError,
    InvalidManifestError,
    InvalidNameError,
    InvalidShardError,
    MissingTensorsError,
    NotFoundError,
    StateEncodingError,
    StateMismatchError,
    StorageError,
    StorageFullError,
)
from ckptstore.service.format.records import RunInfo, VersionInfo

if TYPE_CHECKING:
    import torch

    from ckptstore.client.api import Client
    from ckptstore.client.connection import Connection
    from ckptstore.client.results import LoadResult, SaveResult
    from ckptstore.client.saving.snapshot import SaveHandle

# Imported on first use (all but Connection import torch), so torch-free tools (the server image, the
# ``ckptstore serve`` command) can import this package.
_LAZY = {
    "Client": "ckptstore.client.api",
    "Connection": "ckptstore.client.connection",
    "LoadResult": "ckptstore.client.results",
    "SaveHandle": "ckptstore.client.saving.snapshot",
    "SaveResult": "ckptstore.client.results",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckptstore.client' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "Client",
    "ConflictError",
    "Connection",
    "IntegrityError",
    "InvalidInputError",
    "InvalidManifestError",
    "InvalidNameError",
    "InvalidShardError",
    "LoadResult",
    "MissingTensorsError",
    "NotFoundError",
    "RunInfo",
    "SaveHandle",
    "SaveResult",
    "StateEncodingError",
    "StateMismatchError",
    "StorageError",
    "StorageFullError",
    "VersionInfo",
    "default_client",
    "load",
    "runs",
    "save",
    "versions",
]

#: The variables that choose the default client's store (URL and TOKEN first).
_CLIENT_VARIABLES = ("URL", "TOKEN", "HOME", "DATABASE_URL", "BLOBS", "RETRY_SECONDS")
_clients: dict[tuple[str | None, ...], Client] = {}
_clients_lock = threading.Lock()


def default_client() -> Client:
    """The client for the current ``CKPTSTORE_URL`` / ``CKPTSTORE_TOKEN``, or without a URL the
    store ``CKPTSTORE_DATABASE_URL`` / ``CKPTSTORE_BLOBS`` / ``CKPTSTORE_HOME`` name.

    Read at every call; one client is kept per distinct setting so the digest cache of
    frozen tensors survives between saves.
    """
    settings = tuple(os.environ.get(f"CKPTSTORE_{name}") or None for name in _CLIENT_VARIABLES)
    with _clients_lock:
        if settings not in _clients:
            url, token = settings[:2]
            from ckptstore.client.api import Client

            _clients[settings] = Client(url, token=token)
        return _clients[settings]


connection.provide_default_client(default_client)


@overload
def save(
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


def save(
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
    """Store the model (and optimizer, scheduler, extras) as the next version of ``run_id``,
    with the default client (:func:`default_client`).

    Only tensors the store lacks are written; the version becomes visible once all of its
    bytes are stored. ``keep_last``, ``keep_best``, ``metric`` and ``mode`` set the run's
    retention policy first; ``blocking=False`` returns a :class:`SaveHandle` once the state is
    snapshotted and saves in the background. The random number generators are recorded too
    (``rng=False`` leaves them out), and the state of ``dataloader`` and ``stateful`` objects.
    Every argument is as in :meth:`Client.save`.
    """
    return default_client().save(
        run_id,
        model,
        optim,
        scheduler=scheduler,
        extra=extra,
        step=step,
        metrics=metrics,
        tags=tags,
        keep_last=keep_last,
        keep_best=keep_best,
        metric=metric,
        mode=mode,
        rng=rng,
        dataloader=dataloader,
        stateful=stateful,
        blocking=blocking,
    )


def load(
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
    """Load a version into ``model``/``optim``/``scheduler`` (or return its state_dict), with
    the default client (:func:`default_client`).

    Every byte is verified; strict by default (missing or unexpected model keys raise
    StateMismatchError before anything is written). A load with ``optim`` is a resume: it also
    restores the random number generators the version recorded (``rng=`` forces either way), and
    ``dataloader`` / ``stateful`` objects get their saved state. Every argument is as in
    :meth:`Client.load`.
    """
    return default_client().load(
        run_id,
        version,
        model=model,
        optim=optim,
        scheduler=scheduler,
        device=device,
        dtype=dtype,
        strict=strict,
        keys=keys,
        rng=rng,
        dataloader=dataloader,
        stateful=stateful,
    )


def versions(run_id: str) -> list[VersionInfo]:
    """Versions of a run, from the default client's store."""
    return default_client().versions(run_id)


def runs() -> list[RunInfo]:
    """Runs in the default client's store."""
    return default_client().runs()
