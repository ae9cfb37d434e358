"""An Accelerate ``save_state`` folder as the version the Accelerate plug-in would have saved.

``Accelerator.save_state(folder)`` writes the weights (``model.safetensors`` or
``pytorch_model.bin``), ``optimizer.bin`` (``torch.save`` of the optimizer's state_dict),
``scheduler.bin``, ``random_states_<process>.pkl`` (Python's, NumPy's, torch's and each
accelerator device's generator state, and the accelerator's step counter),
``custom_checkpoint_<n>.pkl`` for each object registered with ``register_for_checkpointing``
and, for a stateful data loader, ``dl_state_dict.bin``. An import keeps them all, in the
layout :func:`client.integrations.accelerate.save_state` stores, so the plug-in's
``load_state`` resumes the run from the imported version:

- the optimizer's state by position (:func:`~client.formats.torch_dicts.optimizer_state`): a
  load pairs positions with the optimizer it is given, as ``optimizer.load_state_dict`` does;
- ``extra["schedulers"]``: each ``scheduler*.bin`` in order (the first is also the version's
  scheduler, for ``client.load(..., scheduler=...)``);
- ``extra["rng"]`` (:func:`client.integrations.rng.capture_rng`'s layout) and
  ``extra["accelerator_step"]`` from ``random_states_0.pkl``;
- ``extra["custom"]``: each registered object's state in order, when every one is plain data;
- ``extra["dataloader_states"]``: each ``dl_state_dict*.bin`` by file stem (the plug-in does not
  restore data loaders; ``export --format accelerate`` writes them back).

Every file is read by the allow-list reader (:mod:`client.formats.torch_save.files`), never
unpickled. The weights, optimizer, schedulers and RNG state are the checkpoint: one the reader
refuses refuses the import. A registered object, data loader or sampler state it refuses (a
pickled object rather than data) is left out with the reader's reason, as is what the plug-in
has no place for (another process's generators, the AMP grad scaler).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ckptstore.client.formats.sources import Imported, exists, plain_values
from ckptstore.client.formats.torch_dicts import optimizer_state, unstorable
from ckptstore.client.formats.torch_save.files import read_torch_file
from ckptstore.service.errors import InvalidInputError

OPTIMIZER_FILE = "optimizer.bin"
SCHEDULER_FILE = "scheduler.bin"
RNG_FILE = "random_states_0.pkl"
SCALER_FILE = "scaler.pt"
#: Files only ``save_state`` writes: one of them beside the weights makes a folder an Accelerate folder.
MARKERS = (OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE, "custom_checkpoint_0.pkl")
_NUMBERED = re.compile(r"^(optimizer|scheduler|sampler|dl_state_dict)(?:_([1-9][0-9]{0,5}))?\.bin$")
_CUSTOM = re.compile(r"^custom_checkpoint_(0|[1-9][0-9]{0,5})\.pkl$")
_RNG = re.compile(r"^random_states_(0|[1-9][0-9]{0,5})\.pkl$")
_OTHER_MODEL = re.compile(r"^(model_[1-9][0-9]*\.safetensors|pytorch_model_[1-9][0-9]*\.bin)$")


def is_accelerate_folder(directory: Path) -> bool:
    """Whether ``directory`` holds a file only ``Accelerator.save_state`` writes."""
    return any(exists(directory / name) for name in MARKERS)


def read_accelerate_folder(directory: Path, weights: dict[str, torch.Tensor], *, expand_limit: int = 0) -> Imported:
    """The ``save_state`` folder at ``directory`` (``weights``: its model, read by the caller), whole.

    Raises:
        InvalidInputError: a file the checkpoint needs is refused, or the folder holds what a
            version cannot (several models or optimizers), naming the file.
    """
    names = sorted(p.name for p in directory.iterdir())
    several = [n for n in names if _OTHER_MODEL.match(n) or n.startswith("optimizer_")]
    if several:
        raise InvalidInputError(
            f"{directory / several[0]}: the folder holds several prepared models or optimizers; a version holds "
            "one model and one optimizer: save each with its optimizer as a run of its own"
        )
    imported = Imported(weights)

    def read(name: str, *, numpy_arrays: bool = False) -> Any:
        return read_torch_file(directory / name, numpy_arrays=numpy_arrays, expand_limit=expand_limit)

    if OPTIMIZER_FILE in names:  # numbered by the accelerator's optimizer: kept by position
        imported.optim = optimizer_state(read(OPTIMIZER_FILE), weights, str(directory / OPTIMIZER_FILE))
    schedulers = _numbered(names, "scheduler", ".bin")
    if schedulers:
        states = [plain_values(read(name)) for name in schedulers]
        imported.extra["schedulers"] = states
        imported.scheduler = states[0]
    if RNG_FILE in names:
        rng = read(RNG_FILE, numpy_arrays=True)
        imported.extra["rng"] = rng_from_accelerate(rng, str(directory / RNG_FILE))
        step = rng.get("step")
        imported.extra["accelerator_step"] = step if type(step) is int and step >= 0 else 0
        known = {"step", "random_state", "numpy_random_seed", "torch_manual_seed", "torch_cuda_manual_seed"}
        for key in sorted(k for k in rng if isinstance(k, str) and k not in known):
            imported.left_out[f"{RNG_FILE}[{key}]"] = "generators the Accelerate plug-in does not restore"
    for name in names:
        match = _RNG.match(name)
        if match and match.group(1) != "0":
            imported.left_out[name] = (
                f"process {match.group(1)}'s random number generators; a version holds process 0's, "
                "as the Accelerate plug-in saves them"
            )
    if SCALER_FILE in names:
        imported.left_out[SCALER_FILE] = "the AMP grad scaler's state, which the Accelerate plug-in does not restore"
    _read_custom(directory, names, imported, read)
    _read_loaders(directory, names, imported, read)
    return imported


def _numbered(names: list[str], kind: str, suffix: str) -> list[str]:
    """``kind.bin``, ``kind_1.bin``, ... present in ``names``, stopping at the first gap."""
    found: list[str] = []
    while (name := kind + (f"_{len(found)}" if found else "") + suffix) in names:
        found.append(name)
    return found


def _plain(directory: Path, name: str, read: Any) -> tuple[Any, str | None]:
    """The plain data in file ``name`` and None, or None and why it is left out."""
    try:
        value = plain_values(read(name, numpy_arrays=True))
    except InvalidInputError as exc:
        return None, f"not read: {str(exc).removeprefix(str(directory / name) + ': ')}"
    why = unstorable(name, value)
    return (value, None) if why is None else (None, f"cannot be stored: {why}")


def _read_custom(directory: Path, names: list[str], imported: Imported, read: Any) -> None:
    """Registered objects' states: ``extra["custom"]`` in order when all are plain data, else each
    readable one as ``extra["custom_checkpoint_<n>"]`` and the others left out."""
    numbered = sorted((int(m.group(1)), n) for n in names if (m := _CUSTOM.match(n)))
    if not numbered:
        return
    states: dict[str, Any] = {}
    for _, name in numbered:
        value, why = _plain(directory, name, read)
        if why is None:
            states[name] = value
        else:
            imported.left_out[name] = why
    complete = [index for index, _ in numbered] == list(range(len(numbered)))
    if complete and len(states) == len(numbered):
        imported.extra["custom"] = [states[name] for _, name in numbered]
    else:
        imported.extra.update((name.removesuffix(".pkl"), value) for name, value in states.items())


def _read_loaders(directory: Path, names: list[str], imported: Imported, read: Any) -> None:
    """Data loader states (``dl_state_dict*.bin``) by file stem; a sampler object is left out with why."""
    loaders: dict[str, Any] = {}
    for name in names:
        match = _NUMBERED.match(name)
        if match is None or match.group(1) not in ("dl_state_dict", "sampler"):
            continue
        value, why = _plain(directory, name, read)
        if why is not None:
            imported.left_out[name] = why
        elif match.group(1) == "dl_state_dict":
            loaders[name.removesuffix(".bin")] = value
        else:
            imported.left_out[name] = "a sampler's state, which the Accelerate plug-in does not restore"
    if loaders:
        imported.extra["dataloader_states"] = loaders


def rng_from_accelerate(state: Any, where: str) -> dict[str, Any]:
    """:func:`client.integrations.rng.capture_rng`'s layout of a ``random_states_<n>.pkl``'s generators.

    Raises:
        InvalidInputError: ``state`` lacks Python's, NumPy's or torch's state in Accelerate's layout.
    """
    try:
        version, internal, gauss = state["random_state"]
        kind, keys, position, has_gauss, cached = state["numpy_random_seed"]
        cpu = state["torch_manual_seed"]
        converted: dict[str, Any] = {
            "python": (version, internal, gauss),
            "numpy": {
                "kind": kind,
                "keys": plain_values(keys),
                "pos": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": cpu,
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidInputError(
            f"{where}: not Accelerate's random states (random_state, numpy_random_seed, torch_manual_seed)"
        ) from exc
    checks = (
        (
            isinstance(version, int) and isinstance(internal, tuple) and all(type(i) is int for i in internal),
            "random_state",
        ),
        (isinstance(kind, str) and isinstance(converted["numpy"]["keys"], torch.Tensor), "numpy_random_seed"),
        (isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8, "torch_manual_seed"),
    )
    for ok, key in checks:
        if not ok:
            raise InvalidInputError(f"{where}: its {key} is not a generator state as Accelerate saves it")
    if "torch_cuda_manual_seed" in state:
        converted["cuda"] = state["torch_cuda_manual_seed"]
    return converted
