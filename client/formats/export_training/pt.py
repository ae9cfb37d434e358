"""A version as one ``torch.save`` training checkpoint, the layout ``ckptstore import`` reads back.

The file is a dict::

    {
        "model": state_dict,                 # every model tensor, canonical names
        "optimizer": optimizer.state_dict(), # torch's layout: state by position, param_groups
        "lr_scheduler": scheduler.state_dict(),
        "step": 1000,                        # the version's step
        **extra,                             # every extra, under its own key ("epoch", "loss", ...)
        **metrics,                           # metrics not already among the extras
    }

``optimizer``, ``lr_scheduler`` and ``step`` are written when the version holds them (a version
without an optimizer gives a weights-and-extras file); ``step`` is left to the extras when they
hold ``step`` or ``global_step`` already (an imported checkpoint's own key). Resume a plain
training loop with ``ckpt = torch.load`` of the file (``weights_only=True``),
``model.load_state_dict(ckpt["model"])``, ``optim.load_state_dict(ckpt["optimizer"])``,
``sched.load_state_dict(ckpt["lr_scheduler"])``. ``ckptstore import`` of the file stores the same
version again (model, optimizer by position, scheduler, step, extras and metrics).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ckptstore.client.formats.export_training.torch_file import write_torch_file
from ckptstore.client.formats.export_training.version_state import VersionState, file_result, read_version
from ckptstore.client.formats.exporting import ExportResult
from ckptstore.client.formats.torch_dicts import MODEL_KEYS, OPTIMIZER_KEYS, SCHEDULER_KEYS, STEP_KEYS
from ckptstore.client.store_protocol import Transport
from ckptstore.service.errors import StateMismatchError

MODEL, OPTIMIZER, SCHEDULER, STEP = "model", "optimizer", "lr_scheduler", "step"
#: Keys an extra may not have in this file: on import they would name the model, optimizer or scheduler.
RESERVED = frozenset(MODEL_KEYS + OPTIMIZER_KEYS + SCHEDULER_KEYS)


def training_dict(state: VersionState) -> dict[str, Any]:
    """The dict a ``.pt`` export writes for ``state`` (see the module docstring).

    Raises:
        StateMismatchError: an extra's key would be read back as the model, optimizer or scheduler.
    """
    clash = sorted(RESERVED & set(state.extra))
    if clash:
        raise StateMismatchError(
            f"{state.where} holds extra[{clash[0]!r}], which a .pt checkpoint reads as its model, optimizer or "
            "scheduler: export --format hf, or store that extra under another name"
        )
    checkpoint: dict[str, Any] = {MODEL: state.model}
    if state.optimizer is not None:
        checkpoint[OPTIMIZER] = state.optimizer
    if state.scheduler is not None:
        checkpoint[SCHEDULER] = state.scheduler
    if state.step is not None and not set(STEP_KEYS) & set(state.extra):
        checkpoint[STEP] = state.step
    checkpoint.update(state.extra)
    for name, value in state.metrics.items():
        checkpoint.setdefault(name, value)
    return checkpoint


def export_pt(transport: Transport, run_id: str, ref: int | str, path: Path) -> ExportResult:
    """Write version ``ref`` of ``run_id`` to the file ``path`` as a ``torch.save`` training checkpoint."""
    started = time.perf_counter()
    state = read_version(transport, run_id, ref)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_torch_file(path, training_dict(state))
    return file_result(state, path, started)
