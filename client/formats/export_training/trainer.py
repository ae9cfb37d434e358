"""A version as a Hugging Face ``Trainer`` checkpoint folder, which
``trainer.train(resume_from_checkpoint=folder)`` resumes from.

The folder holds what the Trainer reads back:

- ``model.safetensors`` (or shards and their index) and ``config.json`` when the version holds
  the model's config, as ``ckptstore export`` writes them (:mod:`client.formats.exporting`); for a
  PEFT model (the version holds its ``peft_config``), ``adapter_model.safetensors`` and
  ``adapter_config.json`` instead, as the Trainer saves one (:func:`.export_formats.export_peft`);
- ``optimizer.pt``: the optimizer's state_dict in torch's layout, numbered in the groups' order
  the version recorded (:mod:`.version_state`); ``scheduler.pt``: the scheduler's state_dict;
- ``trainer_state.json``: the ``TrainerState`` the version holds (``CkptstoreCallback`` stores it,
  a Trainer folder import keeps the folder's);
- ``rng_state.pth``: the random generators' state in the Trainer's layout (``python``, ``numpy``
  as ``np.random.get_state()``'s tuple, ``cpu``, ``cuda``), from ``extra["rng"]``
  (``CkptstoreCallback``) or ``extra["rng_state"]`` (a Trainer folder import keeps each
  ``rng_state*.pth`` there, all of which are written back).

``training_args.bin`` is not written: it is a pickle of a ``TrainingArguments`` dataclass, which
only a general unpickler reads; pass your own ``TrainingArguments`` to the Trainer that resumes.
Every file loads with ``torch.load`` and ``weights_only=True`` (``rng_state.pth`` under the
``safe_globals`` the Trainer itself uses for numpy). A version without a ``TrainerState`` is
refused: the Trainer cannot resume from a folder without one (``--format pt`` writes it instead).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptstore.client.formats.export_formats import export_peft
from ckptstore.client.formats.export_training.torch_file import write_torch_file
from ckptstore.client.formats.export_training.version_state import VersionState, read_version
from ckptstore.client.formats.exporting import ExportResult, export_version, write_text_atomically
from ckptstore.client.store_protocol import Transport
from ckptstore.service.errors import StateMismatchError

TRAINER_STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_state.pth"
#: Where the Trainer plug-in keeps the generators' state, and where a Trainer folder import keeps its files.
CAPTURED_RNG, IMPORTED_RNG = "rng", "rng_state"
#: The stems of the RNG files a Trainer writes: ``rng_state``, or ``rng_state_<process index>``.
RNG_STEM = re.compile(r"rng_state(_[0-9]{1,6})?")


def trainer_rng(rng: dict[str, Any], where: str) -> dict[str, Any]:
    """``rng_state.pth``'s dict from the plug-in's layout (``python``, ``numpy`` as a dict, ``torch``, ``cuda``).

    Raises:
        StateMismatchError: ``rng`` is not that layout.
    """
    try:
        numpy_state = rng["numpy"]
        keys = numpy_state["keys"]
        state: dict[str, Any] = {
            "python": _python_state(rng["python"]),
            "numpy": (
                str(numpy_state["kind"]),
                keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys, dtype=np.uint32),
                int(numpy_state["pos"]),
                int(numpy_state["has_gauss"]),
                float(numpy_state["cached_gaussian"]),
            ),
            "cpu": rng["torch"],
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise StateMismatchError(f"{where}: extra['rng'] is not the generators' state CkptstoreCallback saves") from exc
    cuda = rng.get("cuda")
    if isinstance(cuda, list) and len(cuda) == 1:
        state["cuda"] = cuda[0]  # one device: the Trainer saves and restores that device's state alone
    elif cuda is not None:
        state["cuda"] = cuda
    return state


def imported_rng(files: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each ``rng_state*.pth`` a Trainer folder import kept (by file stem), with numpy's keys as an array again."""
    written = {}
    for stem, state in files.items():
        if not isinstance(stem, str) or not RNG_STEM.fullmatch(stem) or not isinstance(state, dict):
            continue  # not a file a Trainer writes: no name from a version becomes a path unchecked
        state = dict(state)
        numpy_state = state.get("numpy")
        if isinstance(numpy_state, (tuple, list)) and len(numpy_state) == 5:
            kind, keys, *rest = numpy_state
            array = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys, dtype=np.uint32)
            state["numpy"] = (kind, array, *rest)
        state["python"] = _python_state(state.get("python"))
        written[f"{stem}.pth"] = state
    return written


def _python_state(value: Any) -> Any:
    """``random.getstate()``'s tuple ``(version, (ints...), gauss)``, however a version holds it."""
    if isinstance(value, (list, tuple)) and len(value) == 3 and isinstance(value[1], (list, tuple)):
        return (value[0], tuple(value[1]), value[2])
    return value


def rng_files(state: VersionState) -> dict[str, dict[str, Any]]:
    """The ``rng_state*.pth`` files to write, by name (none when the version holds no generators' state)."""
    if isinstance(state.extra.get(CAPTURED_RNG), dict):
        return {RNG_FILE: trainer_rng(state.extra[CAPTURED_RNG], state.where)}
    files = state.extra.get(IMPORTED_RNG)
    if isinstance(files, dict):
        return imported_rng(files)
    return {}


def export_trainer(transport: Transport, run_id: str, ref: int | str, directory: Path) -> ExportResult:
    """Write version ``ref`` of ``run_id`` to ``directory`` as a Trainer checkpoint folder.

    Raises:
        StateMismatchError: the version holds no ``TrainerState``.
    """
    started = time.perf_counter()
    state = read_version(transport, run_id, ref)
    trainer_state = state.extra.get("trainer_state")
    if not isinstance(trainer_state, dict):
        raise StateMismatchError(
            f"{state.where} holds no TrainerState (extra['trainer_state']), which a Trainer needs to resume: "
            "save with CkptstoreCallback or import a Trainer checkpoint folder, or export --format pt"
        )
    directory.mkdir(parents=True, exist_ok=True)
    version = state.manifest.version
    if "peft_config" in state.extra or "peft_configs" in state.extra:  # the Trainer saves a PeftModel's adapter
        result = export_peft(transport, run_id, version, directory)
    else:
        result = export_version(transport, run_id, version, directory)
    if state.optimizer is not None:
        write_torch_file(directory / OPTIMIZER_FILE, state.optimizer)
        result.files.append(OPTIMIZER_FILE)
    if state.scheduler is not None:
        write_torch_file(directory / SCHEDULER_FILE, state.scheduler)
        result.files.append(SCHEDULER_FILE)
    for name, rng in rng_files(state).items():
        write_torch_file(directory / name, rng, numpy_arrays=True)
        result.files.append(name)
    write_text_atomically(directory / TRAINER_STATE_FILE, json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
    result.files.append(TRAINER_STATE_FILE)
    result.tensors, result.bytes = state.tensors, state.nbytes
    result.seconds = time.perf_counter() - started
    return result
