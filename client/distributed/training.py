"""``Client.save`` / ``Client.load`` of a sharded model (FSDP2 ``fully_shard``, DTensor parameters).

Every rank calls them. The state comes from ``torch.distributed.checkpoint.state_dict``
(``get_state_dict`` / ``set_state_dict``): model tensors and optimizer state keyed by parameter
name, each rank holding its shards, which :class:`~client.distributed.StoreWriter` and
:class:`~client.distributed.StoreReader` store and read. Placement is PyTorch's own: state is
loaded into the optimizer's existing tensors (Adam's ``step`` stays on the CPU unless the
group is fused or capturable), and the manifest records the same rules for other loaders.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ckptstore.client import keys, names
from ckptstore.client.distributed.clients import StoreClient
from ckptstore.client.distributed.reader import StoreReader
from ckptstore.client.distributed.writer import StoreWriter
from ckptstore.client.loading import restore
from ckptstore.client.results import LoadResult, SaveResult
from ckptstore.service.errors import CheckpointError, InvalidInputError


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded across the ranks of an initialized process group."""
    return dist.is_available() and dist.is_initialized() and any(isinstance(p, DTensor) for p in model.parameters())


def save_sharded(
    client: StoreClient,
    run_id: str,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None,
    *,
    scheduler: Any,
    extra: dict[str, Any] | None,
    step: int | None,
    metrics: dict[str, float] | None,
    tags: Sequence[str],
) -> SaveResult:
    """Save every rank's shards of ``model`` (and ``optim``…) as one version; call on every rank."""
    model_state, optim_state = get_state_dict(model, optim if optim is not None else [])
    state: dict[str, Any] = {"model": model_state}
    if optim is not None:
        state["optim"] = optim_state
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if extra is not None:
        state["extra"] = extra
    writer = StoreWriter(run_id, client=client, step=step, metrics=metrics, tags=tags)
    # Canonical names (client.names) are the FQNs get_state_dict reports.
    writer.trainable = frozenset(f"model.{name}" for name, p in names.parameters(model).items() if p.requires_grad)
    metadata = _unwrapped(lambda: dcp.save(state, storage_writer=writer))
    result = metadata.storage_data
    assert isinstance(result, SaveResult)
    return result


def load_sharded(
    client: StoreClient,
    run_id: str,
    version: int | str,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None,
    *,
    scheduler: Any,
    strict: bool,
) -> LoadResult:
    """Load a version (saved by any number of ranks, or by one process) into every rank's shards."""
    started = time.perf_counter()
    model_state, optim_state = get_state_dict(model, optim if optim is not None else [])
    reader = StoreReader(run_id, version, client=client)
    manifest = client.transport.manifest(run_id, version)
    if isinstance(version, str):  # every rank must read the same version: pin the one found
        reader.version = manifest.version
    stored = {keys.model_name(e.key) for e in manifest.tensors if e.key.startswith("model/")}
    missing, unexpected = restore.compare_keys(stored, set(model_state))
    if strict and (missing or unexpected):
        raise restore.mismatch_error(manifest.version, missing, unexpected)
    for name in missing:
        del model_state[name]
    state: dict[str, Any] = {"model": model_state}
    if optim is not None:
        state["optim"] = optim_state
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    planner = DefaultLoadPlanner(allow_partial_load=not strict)
    _unwrapped(lambda: dcp.load(state, storage_reader=reader, planner=planner))
    set_state_dict(
        model,
        optim if optim is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    return LoadResult(
        run_id=run_id,
        version=manifest.version,
        missing_keys=missing,
        unexpected_keys=unexpected,
        step=manifest.step,
        metrics=manifest.metrics,
        bytes_read=reader.bytes_read,
        seconds=time.perf_counter() - started,
    )


def check_load_arguments(device: str | torch.device | None, dtype: torch.dtype | None, model: torch.nn.Module) -> None:
    """Refuse what a sharded load cannot honour: another device, or a cast of the sharded weights."""
    if dtype is not None:
        raise InvalidInputError(
            "dtype= is not supported for a sharded model: its parameters keep their dtype "
            "(set compute precision with FSDP's MixedPrecisionPolicy)"
        )
    if device is not None:
        devices = {p.device.type for p in model.parameters()}
        if devices != {torch.device(device).type}:
            raise InvalidInputError(
                f"device={device!s} differs from the sharded model's {sorted(devices)}; "
                "a sharded model loads on the devices its mesh placed it on"
            )


def _unwrapped(call: Any) -> Any:
    """Run a DCP call; a ckptstore error on any rank is raised as itself, not as DCP's wrapper."""
    try:
        return call()
    except CheckpointException as exc:
        for rank, (failure, _trace) in sorted(exc.failures.items()):
            if isinstance(failure, CheckpointError):
                failure.add_note(f"raised on rank {rank} of the sharded checkpoint")
                raise failure from exc
        raise
