"""A version's whole state in memory, on the CPU, in the layouts training code ``torch.save``\\ s.

:func:`read_version` gives the model's state_dict (canonical names, manifest order), the
optimizer's state_dict in torch's own layout (:func:`positional_optimizer`), the scheduler's
state_dict, the extras and the step, every byte verified as a load verifies it.

A torch optimizer's state_dict numbers its parameters 0, 1, ... in its groups' order. A version
keeps that order either way: state an import kept by position is already numbered, and state
``client.save`` keyed by name lists each group's parameter names in the optimizer's own order
(``optimizer.param_groups``), so position ``i`` is the ``i``-th name over the groups. Only a
version whose groups list no parameters while state is held for some cannot be numbered: that
is refused (:class:`StateMismatchError`), never guessed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptstore.client.formats.exporting import ExportResult
from ckptstore.client.loading import restore, selection
from ckptstore.client.loading.reader import TensorReader
from ckptstore.client.state import is_positional
from ckptstore.client.store_protocol import Transport
from ckptstore.service.errors import StateMismatchError
from ckptstore.service.format.manifest import Manifest

CPU = torch.device("cpu")


@dataclass
class VersionState:
    """What a version holds, as plain Python values and CPU tensors."""

    manifest: Manifest
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    scheduler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def where(self) -> str:
        """``version N of 'run'``, for messages."""
        return f"version {self.manifest.version} of run {self.manifest.run_id!r}"

    @property
    def tensors(self) -> int:
        """How many tensors the version holds."""
        return len(self.manifest.tensors)

    @property
    def nbytes(self) -> int:
        """The bytes of the version's tensors."""
        return sum(entry.nbytes for entry in self.manifest.tensors)


def read_version(transport: Transport, run_id: str, ref: int | str) -> VersionState:
    """Version ``ref`` of ``run_id``, read whole onto the CPU (see the module docstring).

    Raises:
        StateMismatchError: the optimizer state cannot be numbered in torch's layout.
    """
    manifest = transport.manifest(run_id, ref)
    reader = TensorReader(transport, manifest)
    model, _ = restore.materialize_model(reader, selection.selected_model_keys(manifest, None), CPU, None)
    result = VersionState(manifest, model, step=manifest.step, metrics=dict(manifest.metrics))
    saved: Any = manifest.state.get("optim")
    if isinstance(saved, dict):
        on_cpu = {entry.param: CPU for entry in manifest.tensors if entry.param is not None}
        decoded = restore.restore_section(reader, "optim", CPU, on_cpu)
        result.optimizer = positional_optimizer(decoded, f"version {manifest.version} of run {manifest.run_id!r}")
    result.scheduler = restore.restore_section(reader, "scheduler", CPU)
    extra = restore.restore_section(reader, "extra", CPU)
    result.extra = extra if isinstance(extra, dict) else {}
    return result


def positional_optimizer(decoded: dict[str, Any], where: str) -> dict[str, Any]:
    """A decoded optimizer section (state by name or by position) as ``Optimizer.state_dict()``
    writes it: ``state`` keyed by int position, each group's ``params`` a list of positions.

    Raises:
        StateMismatchError: state is held for a parameter no group lists, so its position is unknown.
    """
    groups = decoded["param_groups"]
    if is_positional(groups):
        position = {str(p): p for group in groups for p in group["params"]}
    else:
        names = [name for group in groups for name in group["params"]]
        position = {name: index for index, name in enumerate(names)}
    state: dict[int, Any] = {}
    for key, value in decoded["state"].items():
        name = str(key)
        if name not in position:
            raise StateMismatchError(
                f"{where} holds optimizer state for {name[:80]!r}, which no param group lists, so its place in "
                "the optimizer's order is unknown: export --format hf --optimizer keeps it by name"
            )
        state[position[name]] = value
    numbered = []
    for group in groups:
        params = [p if type(p) is int else position[p] for p in group["params"]]
        numbered.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return {"state": dict(sorted(state.items())), "param_groups": numbered}


def file_result(state: VersionState, path: Path, started: float) -> ExportResult:
    """What an export of ``state`` as the one file ``path`` wrote, begun at ``started`` (``perf_counter``)."""
    return ExportResult(
        run_id=state.manifest.run_id,
        version=state.manifest.version,
        directory=path.parent,
        files=[path.name],
        tensors=state.tensors,
        bytes=state.nbytes,
        seconds=time.perf_counter() - started,
    )
