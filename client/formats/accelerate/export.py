"""Export a version as an Accelerate ``save_state`` folder, which ``Accelerator.load_state(folder)`` resumes.

The folder holds what ``save_state`` writes for one model and one optimizer:

- ``model.safetensors``: the model's tensors under their state_dict names;
- ``optimizer.bin``: ``torch.save`` of the optimizer's state_dict, numbered as
  ``optimizer.load_state_dict`` pairs it with the optimizer's parameters: state stored by
  position keeps its numbers, state stored by parameter name is numbered in its param groups'
  order (the order the optimizer that saved it held its parameters in);
- ``scheduler.bin`` (``scheduler_<n>.bin`` for more): ``extra["schedulers"]`` as the Accelerate
  plug-in stores them, else the version's scheduler;
- ``random_states_0.pkl``: the generators (``extra["rng"]``, or the version's ``resume``
  section) and the accelerator's step counter in Accelerate's layout;
- ``custom_checkpoint_<n>.pkl``: ``extra["custom"]``, each registered object's state;
- ``dl_state_dict*.bin``: ``extra["dataloader_states"]``, each data loader's state.

The files are ``torch.save`` archives of plain data, as Accelerate writes and reads them, written by
the product's one writer of pickled files (:mod:`client.formats.export_training.torch_file`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptstore.client.formats.export_training.torch_file import write_torch_file
from ckptstore.client.formats.exporting import FILE_METADATA, ExportResult, model_entries, write_safetensors
from ckptstore.client.loading import restore
from ckptstore.client.loading.reader import TensorReader
from ckptstore.client.state import is_positional
from ckptstore.client.store_protocol import Transport
from ckptstore.service.errors import StateMismatchError

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.bin"
RNG_FILE = "random_states_0.pkl"


def export_accelerate(transport: Transport, run_id: str, ref: int | str, directory: Path) -> ExportResult:
    """Write version ``ref`` of ``run_id`` to ``directory`` as an Accelerate ``save_state`` folder.

    Raises:
        StateMismatchError: the version's optimizer or scheduler state is not one
            ``load_state_dict`` takes (the message names which).
    """
    started = time.perf_counter()
    manifest = transport.manifest(run_id, ref)
    reader = TensorReader(transport, manifest)
    cpu = torch.device("cpu")
    model = model_entries(manifest)
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / MODEL_FILE, model, reader, FILE_METADATA)
    files = [MODEL_FILE]
    on_cpu = {e.param: cpu for e in manifest.tensors if e.param is not None}
    optim = restore.restore_section(reader, "optim", cpu, on_cpu)
    if optim is not None:
        _save(numbered_optimizer(optim, f"version {manifest.version} of {run_id!r}"), directory / OPTIMIZER_FILE)
        files.append(OPTIMIZER_FILE)
    extra = restore.restore_section(reader, "extra", cpu)
    extra = extra if isinstance(extra, dict) else {}
    schedulers = extra.get("schedulers")
    if not isinstance(schedulers, list):
        scheduler = restore.restore_section(reader, "scheduler", cpu)
        schedulers = [scheduler] if scheduler is not None else []
    for index, state in enumerate(schedulers):
        files.append(_save(state, directory / ("scheduler.bin" if index == 0 else f"scheduler_{index}.bin")))
    rng = extra.get("rng")
    if not isinstance(rng, dict):
        resume = restore.restore_section(reader, "resume", cpu)
        rng = resume.get("rng") if isinstance(resume, dict) else None
    if isinstance(rng, dict):
        step = extra.get("accelerator_step")
        files.append(_save(accelerate_rng(rng, step if isinstance(step, int) else 0), directory / RNG_FILE))
    custom = extra.get("custom")
    for index, state in enumerate(custom if isinstance(custom, list) else []):
        files.append(_save(state, directory / f"custom_checkpoint_{index}.pkl"))
    loaders = extra.get("dataloader_states")
    for stem, state in sorted(loaders.items() if isinstance(loaders, dict) else []):
        if stem == "dl_state_dict" or (stem.startswith("dl_state_dict_") and stem[14:].isdigit()):
            files.append(_save(state, directory / f"{stem}.bin"))
    tensors = [e for e in manifest.tensors if e.key.startswith(("model/", "optim/"))]
    return ExportResult(
        run_id=manifest.run_id,
        version=manifest.version,
        directory=directory,
        files=files,
        tensors=len(tensors),
        bytes=sum(e.nbytes for e in tensors),
        seconds=time.perf_counter() - started,
    )


def numbered_optimizer(optim: dict[str, Any], subject: str) -> dict[str, Any]:
    """An optimizer state_dict as ``Optimizer.state_dict()`` numbers it, from the stored state.

    Positional state (its keys read back as strings of digits) keeps its numbers; state by
    parameter name is numbered in its param groups' order.

    Raises:
        StateMismatchError: a state is held by no param group.
    """
    groups = optim["param_groups"]
    if is_positional(groups):
        position = {str(i): i for g in groups for i in g["params"]}
        numbered_groups = groups
    else:
        position = {name: i for i, name in enumerate(n for g in groups for n in g["params"])}
        numbered_groups = [{**g, "params": [position[n] for n in g["params"]]} for g in groups]
    stray = next((k for k in optim["state"] if str(k) not in position), None)
    if stray is not None:
        raise StateMismatchError(f"{subject}: optimizer state for {str(stray)[:80]!r}, which no param group holds")
    state = {position[str(k)]: value for k, value in optim["state"].items()}
    return {"state": dict(sorted(state.items())), "param_groups": numbered_groups}


def accelerate_rng(rng: dict[str, Any], step: int) -> dict[str, Any]:
    """The dict ``save_state`` writes as ``random_states_<n>.pkl``, from
    :func:`client.resume.rng.capture_rng`'s layout."""
    version, internal, gauss = rng["python"]
    numpy = rng["numpy"]
    keys = numpy["keys"].cpu().numpy().astype(np.uint32)
    state: dict[str, Any] = {
        "step": step,
        "random_state": (version, tuple(internal), gauss),
        "numpy_random_seed": (numpy["kind"], keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]),
        "torch_manual_seed": rng["torch"].cpu(),
    }
    cuda = rng.get("cuda")
    if cuda is not None:
        state["torch_cuda_manual_seed"] = [cuda.cpu()] if isinstance(cuda, torch.Tensor) else [s.cpu() for s in cuda]
    return state


def _save(value: Any, path: Path) -> str:
    """``value`` (plain data; numpy arrays for NumPy's generator) written as ``torch.save`` does; the file's name."""
    write_torch_file(path, value, numpy_arrays=True)
    return path.name
