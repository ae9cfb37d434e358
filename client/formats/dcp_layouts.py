"""The layouts training frameworks give a DCP checkpoint's state dict, read and written back.

A DCP folder (read by :mod:`client.formats.dcp.folder`) holds whatever dict was passed to
``dcp.save``. The common ones:

- ``get_state_dict``'s: ``{"model", "optim", "scheduler"?, "extra"?}``, what ``export --format
  dcp`` writes for a version saved with ``client.save``;
- **torchtitan**'s: ``{"model", "optimizer", "lr_scheduler", "train_state", "dataloader"?}``: the
  optimizer flattened by ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``
  (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), the scheduler's state_dict, and the step
  in ``train_state["step"]``;
- **torchtune**'s: ``{"model", "optimizer"`` (or ``"opt_state_dict"``) ``, "seed", "epochs_run",
  "total_epochs", "max_steps_per_epoch"}``: the step is ``epochs_run * max_steps_per_epoch``.

:func:`read_layout` finds the model, the optimizer (keyed by parameter name, nested or
flattened; or by position), the scheduler and the step under any of these names, and keeps every
other entry as an extra (one that cannot be stored, such as torchtitan's pickled data loader
bytes, is left out with why). A flattened optimizer's param groups are the parameters whose
settings agree, in the order the file names them; a load into an optimizer grouped otherwise is
refused, never guessed. :func:`written_layout` gives a version stored from such a folder back in its
framework's layout (chosen by the extras it kept: ``train_state`` is torchtitan's,
``epochs_run`` torchtune's), so ``dcp.load`` of the framework's own state dict resumes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ckptstore.client.formats.dcp.folder import read_dcp_folder
from ckptstore.client.formats.pickled.allowlist import shown
from ckptstore.client.formats.sources import Imported
from ckptstore.client.formats.torch_dicts import optimizer_state, tensor_dict, unstorable
from ckptstore.service.errors import InvalidInputError

OPTIMIZER_KEYS = ("optim", "optimizer", "opt_state_dict")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler")
#: The extras that name a framework's layout, and the keys its optimizer and scheduler go under.
TORCHTITAN = "train_state"
TORCHTUNE = "epochs_run"
_STATE, _GROUPS = "state.", "param_groups."
_FLAT = (_STATE, _GROUPS)


def read_dcp(directory: Path) -> Imported:
    """The DCP checkpoint folder at ``directory``, in any layout of the module docstring.

    Raises:
        InvalidInputError: the folder is refused, or its state has no ``model`` entry, two
            entries for one part, or an optimizer state that names parameters the model lacks.
    """
    return read_layout(read_dcp_folder(directory), str(directory))


def _one(state: dict[str, Any], names: tuple[str, ...], what: str, where: str) -> str | None:
    present = [name for name in names if name in state]
    if len(present) > 1:
        raise InvalidInputError(
            f"{where} holds both {present[0]!r} and {present[1]!r}: which is the {what} is ambiguous"
        )
    return present[0] if present else None


def read_layout(state: dict[str, Any], where: str) -> Imported:
    """What an import stores from the state dict of a DCP folder (see the module docstring)."""
    if "model" not in state:
        raise InvalidInputError(
            f"{where} is a DCP checkpoint without a 'model' entry (it holds {[shown(k) for k in list(state)[:10]]}); "
            "save {'model': model_state_dict, 'optim': optim_state_dict} as get_state_dict gives them"
        )
    state = dict(state)
    imported = Imported(tensor_dict(state.pop("model"), f"{where} 'model'"))
    optim_key = _one(state, OPTIMIZER_KEYS, "optimizer", where)
    if optim_key is not None:
        optim = state.pop(optim_key)
        subject = f"{where} {optim_key!r}"
        if isinstance(optim, dict) and optim and all(isinstance(k, str) and k.startswith(_FLAT) for k in optim):
            optim = unflatten_optimizer(optim, list(imported.model), subject)
        imported.optim = optimizer_state(optim, imported.model, subject)
    scheduler_key = _one(state, SCHEDULER_KEYS, "scheduler", where)
    if scheduler_key is not None:
        imported.scheduler = state.pop(scheduler_key)
    imported.step = _step(state)
    extra = state.pop("extra", {})
    for key, value in {**(extra if isinstance(extra, dict) else {"extra": extra}), **state}.items():
        why = unstorable(key, value)
        if why is None:
            imported.extra[key] = value
        else:
            imported.left_out[shown(key, 80)] = f"cannot be stored: {why}"
    return imported


def _count(value: Any) -> int | None:
    """A non-negative integer, or a one-element integer tensor holding one; None otherwise."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    return value if type(value) is int and value >= 0 else None


def _step(state: dict[str, Any]) -> int | None:
    """torchtitan's ``train_state["step"]``, torchtune's ``epochs_run * max_steps_per_epoch``, or a ``step``."""
    train_state = state.get(TORCHTITAN)
    if isinstance(train_state, dict) and _count(train_state.get("step")) is not None:
        return _count(train_state["step"])
    epochs, per_epoch = _count(state.get(TORCHTUNE)), _count(state.get("max_steps_per_epoch"))
    if epochs is not None and per_epoch is not None:
        return epochs * per_epoch
    return _count(state.get("step"))


def _parameter(rest: str, names: set[str], subject: str) -> tuple[str, str]:
    """``(parameter name, what follows it)`` of a flattened key's ``rest``: the longest name of the
    model that ``rest`` starts with, then a dot."""
    cut = len(rest)
    while (cut := rest.rfind(".", 0, cut)) > 0:
        if rest[:cut] in names:
            return rest[:cut], rest[cut + 1 :]
    raise InvalidInputError(f"{subject}: {shown(rest, 80)} names no parameter of the model's state_dict")


def _same_settings(value: Any) -> Any:
    """A hashable key for a param group setting, equal for equal settings (tensors by their bytes)."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().view(-1)
        return ("tensor", str(value.dtype), tuple(value.shape), flat.view(torch.uint8).numpy().tobytes())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_same_settings(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _same_settings(v)) for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))))
    return (type(value).__name__, repr(value))


def unflatten_optimizer(flat: dict[str, Any], model_names: list[str], subject: str) -> dict[str, Any]:
    """``get_optimizer_state_dict``'s nested layout (keyed by name) of its flattened one.

    Each ``state.<fqn>.<key>[.<key>...]`` goes to ``state[fqn]`` (nested keys as nested dicts), each
    ``param_groups.<fqn>.<setting>`` to ``fqn``'s group; parameters whose settings all agree share
    a group, the groups in the order the flattened dict first names them (the optimizer's own
    order, which flattening follows).

    Raises:
        InvalidInputError: a key names no parameter of the model, or a parameter has state but no
            param group settings.
    """
    names = set(model_names)
    state: dict[str, dict[str, Any]] = {}
    settings: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section = _STATE if key.startswith(_STATE) else _GROUPS
        name, rest = _parameter(key[len(section) :], names, subject)
        if section == _GROUPS:
            settings.setdefault(name, {})[rest] = value
            continue
        node = state.setdefault(name, {})
        *parents, last = rest.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise InvalidInputError(f"{subject}: {shown(key, 80)} nests under a value that is not a dict")
        node[last] = value
    stray = next((name for name in state if name not in settings), None)
    if stray is not None:
        raise InvalidInputError(f"{subject}: parameter {shown(stray, 80)} has state but no param group settings")
    groups: dict[Any, dict[str, Any]] = {}
    for name in settings:  # in the file's order: the optimizer's groups in order, as flattening wrote them
        same = tuple(sorted((k, _same_settings(v)) for k, v in settings[name].items()))
        groups.setdefault(same, {**settings[name], "params": []})["params"].append(name)
    return {"state": state, "param_groups": list(groups.values())}


def flatten_optimizer(optim: dict[str, Any]) -> dict[str, Any]:
    """The flattened layout (``state.<fqn>.<key>``, ``param_groups.<fqn>.<setting>``) of a state keyed by name."""
    flat: dict[str, Any] = {}

    def nested(prefix: str, value: dict[str, Any]) -> None:
        for key, child in value.items():
            if isinstance(child, dict):
                nested(f"{prefix}.{key}", child)
            else:
                flat[f"{prefix}.{key}"] = child

    for name, per_param in optim["state"].items():
        nested(f"{_STATE}{name}", per_param)
    for group in optim["param_groups"]:
        for name in group["params"]:
            flat.update((f"{_GROUPS}{name}.{k}", v) for k, v in group.items() if k != "params")
    return flat


def written_layout(model: dict[str, Any], optim: Any, scheduler: Any, extra: dict[str, Any]) -> dict[str, Any] | None:
    """The state dict to ``dcp.save`` in torchtitan's or torchtune's layout for a version whose
    extras hold ``train_state`` or ``epochs_run``; None for any other version."""
    if TORCHTITAN in extra:
        state: dict[str, Any] = {"model": model, **extra}
        if optim is not None:
            state["optimizer"] = flatten_optimizer(optim)
        if scheduler is not None:
            state["lr_scheduler"] = scheduler
        return state
    if TORCHTUNE in extra:
        state = {"model": model, **extra}
        if optim is not None:
            state["optimizer"] = optim
        return state
    return None
