"""A version as a Lightning ``.ckpt`` file that ``Trainer.fit(ckpt_path=...)`` resumes from.

A version stored whole from a Lightning checkpoint (saved by ``CkptstoreCheckpointIO``, or a
``.ckpt`` brought in with ``ckptstore import``: its extras hold ``pytorch-lightning_version``) is
written back as that checkpoint: ``state_dict`` with the LightningModule's names as stored, and
every other key as it was (``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks``,
``epoch``, ``global_step``, ``hyper_parameters``, ...), so the resume is bit for bit the resume from
the original file.

Any other version (``client.save``, a ``.pt`` or Trainer import) is written in Lightning's layout
from its parts: ``state_dict`` (the names as stored: save the LightningModule itself so they
carry its attribute prefixes), ``optimizer_states`` (one optimizer, torch's layout),
``lr_schedulers`` (one), ``epoch`` (``extra["epoch"]``, else 0), ``global_step``
(``extra["global_step"]``, else the step, else 0), ``pytorch-lightning_version`` (the Lightning
installed here) and every other extra under its own key. Such a file holds no ``loops``:
Lightning restores the weights, optimizer and scheduler and starts its loop counters again, so
the resume is not bit for bit.
"""

from __future__ import annotations

import time
from importlib import metadata
from pathlib import Path
from typing import Any

from ckptstore.client.formats.export_training.torch_file import write_torch_file
from ckptstore.client.formats.export_training.version_state import VersionState, file_result, read_version
from ckptstore.client.formats.exporting import ExportResult
from ckptstore.client.formats.lightning_ckpt import VERSION_KEY, WEIGHTS_KEY
from ckptstore.client.store_protocol import Transport
from ckptstore.service.errors import StateMismatchError


def is_stored_whole(state: VersionState) -> bool:
    """Whether the version is a Lightning checkpoint stored whole (its extras hold Lightning's version)."""
    return VERSION_KEY in state.extra


def installed_lightning() -> str:
    """The version of the Lightning package installed here.

    Raises:
        StateMismatchError: neither ``lightning`` nor ``pytorch-lightning`` is installed.
    """
    for package in ("lightning", "pytorch-lightning"):
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    raise StateMismatchError(
        "a .ckpt records the Lightning version that reads it, and no Lightning is installed here: "
        "install lightning, or export --format pt"
    )


def lightning_checkpoint(state: VersionState) -> dict[str, Any]:
    """The checkpoint dict a ``.ckpt`` export writes for ``state`` (see the module docstring).

    Raises:
        StateMismatchError: an extra of a version not stored whole is named as the weights,
            optimizers or schedulers of a Lightning checkpoint.
    """
    if is_stored_whole(state):
        return {WEIGHTS_KEY: state.model, **state.extra}
    clash = sorted({WEIGHTS_KEY, "optimizer_states", "lr_schedulers"} & set(state.extra))
    if clash:
        raise StateMismatchError(
            f"{state.where} holds extra[{clash[0]!r}] but no Lightning checkpoint, so that key cannot be written "
            "as Lightning's own: export --format pt"
        )
    checkpoint: dict[str, Any] = {
        WEIGHTS_KEY: state.model,
        "optimizer_states": [state.optimizer] if state.optimizer is not None else [],
        "lr_schedulers": [state.scheduler] if state.scheduler is not None else [],
        "epoch": 0,
        "global_step": state.step or 0,
        VERSION_KEY: installed_lightning(),
    }
    checkpoint.update(state.extra)
    return checkpoint


def export_ckpt(transport: Transport, run_id: str, ref: int | str, path: Path) -> ExportResult:
    """Write version ``ref`` of ``run_id`` to the file ``path`` as a Lightning checkpoint."""
    started = time.perf_counter()
    state = read_version(transport, run_id, ref)
    checkpoint = lightning_checkpoint(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_torch_file(path, checkpoint)
    return file_result(state, path, started)
